"""A session host's answers: the one-shot slot an asker blocks on, and a control's
answer sent once its record is durable."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from tether.actors.ports import Durable
from tether.wire.errors import StoreUnavailable

__all__ = ["Call", "Reply", "durable_reply"]


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


def durable_reply(durable: Durable, reply: Reply, value: Any) -> None:
    """A control that took effect is answered once its record is durable (semantics
    §17.1: issued, then recorded, then answered), by the commit this host's thread makes
    when its mailbox runs dry; if that commit fails, the control stands all the same,
    and its caller hears that a crash may undo it."""

    def done(error: BaseException | None) -> None:
        if error is None:
            reply.set(value)
        else:
            why = f"it took effect, but its record may not survive a crash: {error}"
            reply.set(None, StoreUnavailable(why))

    durable.then(done)


@dataclass(frozen=True, slots=True)
class Call:
    message: Any
    reply: Reply
