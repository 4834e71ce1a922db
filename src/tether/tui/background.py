"""The RPC calls of the terminal UI, off its event loop.

Each call blocks (urllib), so it runs on a daemon thread of its own, and what it returns
(or the ``RpcError`` that refused it) is handed back on the app's loop. A call still under
way when the app ends is dropped: its answer has no screen left to go to.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any, TypeVar

from textual.app import App

from tether.cli.client import RpcError

__all__ = ["in_background"]

T = TypeVar("T")


def in_background(
    app: App[Any],
    work: Callable[[], T],
    then: Callable[[T], None],
    failed: Callable[[RpcError], None],
) -> None:
    """Run ``work()`` on a thread; ``then(result)`` or ``failed(error)`` on the app's loop.
    Anything else ``work`` raises is ``failed`` too, as ``internal``: a screen shows one
    line, never a traceback."""

    def deliver(fn: Callable[[Any], None], value: Any) -> None:
        # The app has ended meanwhile (not running, or its loop cancelled the call).
        with contextlib.suppress(RuntimeError, CancelledError):
            app.call_from_thread(fn, value)

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
