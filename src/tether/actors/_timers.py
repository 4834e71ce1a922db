"""One timer queue for every session's grace and deadline clocks (semantics §14.1).

A heap and one thread, instead of a ``threading.Timer`` thread per clock. A callback runs
on the timer thread and must only hand a message to an actor (it must not block).

Every session's clocks depend on that one thread, so no value may stop it: callers
refuse bad durations up front (``wire.vocab``), and here, as a second line, a delay that
slipped through is clamped to ``[0, MAX_SECONDS]`` (NaN and inf included) before it
reaches the heap, the thread never waits longer than ``_MAX_WAIT`` at a time, and an
error anywhere in its loop is logged, never fatal.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable

import structlog

from tether.wire.vocab import MAX_SECONDS

__all__ = ["TimerHandle", "TimerQueue"]

log = structlog.get_logger("tether.timers")

_MAX_WAIT = 3600.0  # the longest single wait: far below what a lock's timeout can hold


def _clamp(delay: object) -> float:
    """A delay the heap and the thread can hold: finite, within ``[0, MAX_SECONDS]``."""
    try:
        seconds = float(delay)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # 10**400, or not a number at all
        seconds = math.nan
    if math.isfinite(seconds) and 0.0 <= seconds <= MAX_SECONDS:
        return seconds
    log.error("timer.bad_delay", delay=repr(delay)[:40], clamped_to=MAX_SECONDS)
    return 0.0 if seconds < 0 else MAX_SECONDS  # NaN and anything too long: the cap


class TimerHandle:
    __slots__ = ("_queue", "cancelled", "when")

    def __init__(self, queue: TimerQueue, when: float) -> None:
        self._queue = queue
        self.cancelled = False
        self.when = when  # time.monotonic() at which it fires

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._queue.cancelled += 1


class TimerQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, TimerHandle, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.cancelled = 0  # cancelled entries still in the heap (a hint: no lock)
        self._thread = threading.Thread(target=self._loop, name="tether-timers", daemon=True)
        self._thread.start()

    def after(self, delay: float, callback: Callable[[], None]) -> TimerHandle:
        when = time.monotonic() + _clamp(delay)
        handle = TimerHandle(self, when)
        with self._cond:
            heap = self._heap
            if self.cancelled > 1024 and self.cancelled * 2 > len(heap):
                # Most clocks are cancelled long before they fire (a watchdog's `after`
                # outlives most turns): drop them rather than let the heap grow.
                heap[:] = [entry for entry in heap if not entry[2].cancelled]
                heapq.heapify(heap)
                self.cancelled = 0
            earliest = heap[0][0] if heap else None
            heapq.heappush(heap, (when, next(self._seq), handle, callback))
            if earliest is None or when < earliest:
                self._cond.notify()  # only a new earliest clock changes the thread's wait
        return handle

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        self._thread.join()

    def _loop(self) -> None:
        while not self._closed:
            try:
                self._next()
            except Exception:  # the one clock thread of every session must not die
                log.exception("timer.loop_failed")
                time.sleep(0.01)  # and must not spin if the same error comes again

    def _next(self) -> None:
        """Wait for the earliest clock and run its callback (or return on close)."""
        with self._cond:
            while True:
                if self._closed:
                    return
                if self._heap:
                    left = self._heap[0][0] - time.monotonic()
                    if left <= 0:
                        _, _, handle, callback = heapq.heappop(self._heap)
                        break
                    self._cond.wait(min(left, _MAX_WAIT))
                else:
                    self._cond.wait()
        if handle.cancelled:
            with self._cond:
                self.cancelled = max(self.cancelled - 1, 0)
            return
        try:
            callback()
        except Exception:  # one failing callback must not stop every clock
            log.exception("timer.failed")
