"""An answer slot for asking a session host (``actors.host``): the asker blocks on a held
lock that the host releases."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Reply"]


class Reply:
    """A one-shot answer slot: the asker blocks on a held lock that the host releases.

    A lock hand-off is the cheapest cross-thread wake CPython has; pykka's ``ask``
    builds a queue-backed future per call, which the hot paths (interrupt, status)
    would pay on every call.
    """

    __slots__ = ("_error", "_lock", "_value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error
        self._lock.release()

    def get(self) -> Any:
        self._lock.acquire()
        if self._error is not None:
            raise self._error
        return self._value
