"""A turn that reaches its pids limit ends there (semantics §15.5, issue 19).

The kernel enforces ``pids.max`` by refusing forks; it kills nothing. A fork bomb held at
its limit would spin there until a deadline or a person stopped it, and a tool that
cannot fork any more has usually failed in a way its driver cannot name. So a breach
ends the turn, as the memory limit's OOM kill does: the worker is killed and the turn
ends ``crashed`` with error ``pids limit``.

One thread per pool, started with the first turn that has a pids limit, waits on the
``pids.events`` files of the leaves it watches (the kernel signals a change as POLLPRI,
at most every ~10 ms) and hands each breach to the pool, which checks under its lock that
the leaf still runs the turn it was watched for.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable

import structlog

from tether.contain.cgroup import Leaf

__all__ = ["LimitWatch"]

_RECHECK = 0.25  # seconds: a notice is coalesced, never lost; a re-read is cheap anyway
log = structlog.get_logger("tether.limits")


class LimitWatch:
    """Calls ``breached(leaf, turn)`` once when a watched leaf's pids limit refuses a fork."""

    def __init__(self, breached: Callable[[Leaf, str], None]) -> None:
        self._breached = breached
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[Leaf, str]] = {}  # pids.events fd -> (leaf, turn)
        self._by_leaf: dict[int, int] = {}  # id(leaf) -> fd
        self._poller = select.poll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller.register(self._wake_r, select.POLLIN)
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, leaf: Leaf, turn: str) -> None:
        """Watch ``leaf`` for ``turn`` (its baseline was taken at dispatch). Never blocks."""
        self.unwatch(leaf)
        try:
            fd = os.open(leaf.file("pids.events"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:  # the leaf went meanwhile: its turn is ending anyway
            log.debug("limits.watch_failed", leaf=leaf.path, error=repr(exc))
            return
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            self._watched[fd] = (leaf, turn)
            self._by_leaf[id(leaf)] = fd
            self._poller.register(fd, select.POLLPRI | select.POLLERR)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="tether-limits", daemon=True
                )
                self._thread.start()
        self._wake()

    def unwatch(self, leaf: Leaf) -> None:
        with self._lock:
            fd = self._by_leaf.pop(id(leaf), None)
            if fd is None:
                return
            del self._watched[fd]
            self._poller.unregister(fd)
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fd in self._watched:
                self._poller.unregister(fd)
                os.close(fd)
            self._watched.clear()
            self._by_leaf.clear()
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _loop(self) -> None:
        while True:
            self._poller.poll(_RECHECK * 1000)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            with self._lock:
                if self._closed:
                    return
                states = {fd: _state(fd, leaf) for fd, (leaf, _) in self._watched.items()}
                hit = [(fd, self._watched[fd]) for fd, st in states.items() if st == "hit"]
                done = [fd for fd, st in states.items() if st != "within"]
                for fd in done:
                    leaf, _ = self._watched.pop(fd)
                    del self._by_leaf[id(leaf)]
                    self._poller.unregister(fd)
                    os.close(fd)
            for _, (leaf, turn) in hit:
                log.info("limits.pids_hit", leaf=leaf.path, turn=turn)
                self._breached(leaf, turn)


def _state(fd: int, leaf: Leaf) -> str:
    """``hit``, ``within`` or ``gone``; read through the polled descriptor: that read is
    what clears its POLLPRI."""
    try:
        text = os.pread(fd, 4096, 0).decode()
    except OSError:  # the leaf was removed: its worker is gone, and its turn with it
        return "gone"
    return "hit" if leaf.pids_limit_hit(text) else "within"
