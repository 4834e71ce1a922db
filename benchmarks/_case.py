"""What a case function gets and may raise; kept apart so cases import nothing heavy.

A case is a generator function `def case(cfg: Cfg) -> Iterator[Samples]`: it sets up,
then yields one `{series: [samples]}` dict per repetition; the harness closes the
generator when it has enough, so cleanup lives in the case's own `finally`/`with` blocks.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

Samples = dict[str, list[float]]
CaseFunc = Callable[["Cfg"], Generator[Samples, None, None]]
T = TypeVar("T")

# Development only: `TETHER_BENCH_SCALE=0.02` runs the large-session cases at 2% of their
# session counts (the harness prints it, and each scaled case says so in its notes).
SCALE_ENV = "TETHER_BENCH_SCALE"


def scale() -> float:
    """The session-count scale factor from the environment (1 unless set)."""
    value = float(os.environ.get(SCALE_ENV) or 1)
    if not 0 < value <= 1:
        raise ValueError(f"{SCALE_ENV} must be in (0, 1], not {value:g}")
    return value


class Skip(Exception):
    """The case cannot run here (an optional peer is not installed); the reason is noted."""


@dataclass
class Cfg:
    quick: bool
    notes: list[str] = field(default_factory=list)

    def n(self, quick: int, full: int) -> int:
        """A sample count: fewer in --quick, never fewer than the statistic needs."""
        return quick if self.quick else full

    def sessions(self, n: int) -> int:
        """A session count `n`, times the scale factor (never below 16), noted when scaled.

        Figures named for a count (`list_100k_ms`) are only meaningful unscaled.
        """
        factor = scale()
        if factor == 1:
            return n
        got = max(16, math.ceil(n * factor))
        self.note(f"SCALED ({SCALE_ENV}={factor:g}): {got:,} sessions, not {n:,}")
        return got

    _keyed: dict[str, int] = field(default_factory=dict)

    def note(self, text: str, key: str | None = None) -> None:
        """Add a note for the report; a later note with the same `key` replaces it."""
        if key is not None and key in self._keyed:
            self.notes[self._keyed[key]] = text
        elif text not in self.notes:
            if key is not None:
                self._keyed[key] = len(self.notes)
            self.notes.append(text)


def poll_until(
    probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.001
) -> T:
    """Call `probe` until it returns something other than None; TimeoutError after `timeout`.

    The sleep between probes releases the GIL, so a poll in the host never starves the
    runtime threads it is waiting for.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def ms_since(t0_ns: int, t1_ns: int) -> float:
    return (t1_ns - t0_ns) / 1e6


def us_since(t0_ns: int, t1_ns: int) -> float:
    return (t1_ns - t0_ns) / 1e3
