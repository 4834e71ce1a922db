"""The RPC calls of the terminal UI, off its event loop.

Each call blocks (urllib), so it runs on a daemon thread of its own, and what it returns
(or the ``RpcError`` that refused it) comes back to the app's loop as an ``Answer``
message (``post_message`` is thread-safe), which the app runs (``Answer.deliver``). A
call still under way when the app ends is dropped: its answer has no screen left to go
to, and a closed app takes no message.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from textual.app import App
from textual.message import Message

from tether.cli.client import RpcError

__all__ = ["Answer", "in_background"]

T = TypeVar("T")


class Answer(Message):
    """A call's answer, to be handed to its callback on the app's loop."""

    def __init__(self, deliver: Callable[[], None]) -> None:
        super().__init__()
        self.deliver = deliver


def in_background(
    app: App[Any],
    work: Callable[[], T],
    then: Callable[[T], None],
    failed: Callable[[RpcError], None],
) -> None:
    """Run ``work()`` on a thread; ``then(result)`` or ``failed(error)`` on the app's loop
    (the app handles ``Answer``). Anything else ``work`` raises is ``failed`` too, as
    ``internal``: a screen shows one line, never a traceback."""

    def deliver(fn: Callable[[Any], None], value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: it has ended
            app.post_message(Answer(lambda: fn(value)))

    def run() -> None:
        try:
            result = work()
        except RpcError as exc:
            deliver(failed, exc)
            return
        except Exception as exc:
            deliver(failed, RpcError("internal", f"{type(exc).__name__}: {exc}"))
            return
        deliver(then, result)

    threading.Thread(target=run, name="tether-tui-call", daemon=True).start()
