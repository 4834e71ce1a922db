"""The runtimes a program forgets to close are closed, as ``close()`` would, when its
main thread ends (those this process opened: a forked child leaves its copies alone)."""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from tether.runtime.runtime import Runtime

__all__ = ["register", "unregister"]

log = structlog.get_logger("tether.runtime")  # the runtime's logger, shared by its modules

# The runtimes this process opened and has not closed, oldest first.
_open: dict[int, Runtime] = {}
_open_lock = threading.Lock()
_exit_hook = False


def _close_at_exit() -> None:
    """Close every runtime the program left open, newest first, as close() would."""
    with _open_lock:
        left = [rt for rt in _open.values() if rt._pid == os.getpid()]
    for rt in reversed(left):
        log.info("runtime.closed_at_exit")
        try:
            rt.close()
        except Exception:  # the others must still close
            log.exception("runtime.close_at_exit_failed")


def register(rt: Runtime) -> None:
    """Close ``rt`` when the program's main thread ends, unless it is closed before."""
    global _exit_hook
    with _open_lock:
        _open[id(rt)] = rt
        if _exit_hook:
            return
        _exit_hook = True
    # threading's own exit hooks run as the main thread ends, before the interpreter
    # joins threads and before atexit: threads and processes may still start there
    # (atexit refuses both from 3.12), and the pool's tool executor is not shut yet
    # (hooks run last registered first, and concurrent.futures registered earlier).
    hook = getattr(threading, "_register_atexit", None)
    try:
        if hook is None:
            raise RuntimeError("no threading exit hooks")
        hook(_close_at_exit)
    except RuntimeError:  # already shutting down, or no such hook here
        atexit.register(_close_at_exit)


def unregister(rt: Runtime) -> None:
    """``rt`` is closing: nothing is left to do for it at exit."""
    with _open_lock:
        _open.pop(id(rt), None)
