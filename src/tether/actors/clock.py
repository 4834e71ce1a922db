"""Where a session reads the time and sets its timers: services it is given.

A session reads two clocks: wall time for what it records (a stop's ``requested_at``, a
report's ``effective_at``, a turn id's timestamp) and monotonic time for what it
measures (the watchdog's idle time, what is left of a grace or deadline clock that a
pause stops). Both come from its services' ``Clock``, and its timers from their ``arm``
(a ``Timer`` it can cancel). The runtime passes ``SYSTEM_CLOCK`` and the one
``TimerQueue``; a test passes a clock and timers it moves by hand, and so runs the
state machine with no thread, no process and no sleep.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock", "Timer"]


class Clock(Protocol):
    def now(self) -> float:
        """Wall time in seconds since the epoch (``time.time()``): for records."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (``time.monotonic()``): for durations
        and deadlines."""


class SystemClock:
    """The real clocks."""

    __slots__ = ()

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()


class Timer(Protocol):
    """An armed timer: it fires once unless cancelled first."""

    def cancel(self) -> None: ...
