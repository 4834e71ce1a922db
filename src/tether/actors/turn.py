"""The running turn, as its session keeps it: ``Turn``.

One record per claimed turn, from its claim to its end, written only by its session's
host's thread. Its own fields first; then one field for each helper that keeps a part of
it, None until that part is needed (a turn nobody stops, watches, traces or reports on
carries none of them), each written by that helper alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tether.wire.frames import Steer
from tether.wire.records import Message, Recovered

if TYPE_CHECKING:
    from tether.actors.approvals import Pending
    from tether.actors.listener import Controls
    from tether.actors.reports import Book
    from tether.actors.stops import PendingStop
    from tether.actors.watchdog import Watch
    from tether.telemetry.hooks import TurnSpan

__all__ = ["Turn"]


@dataclass(slots=True)
class Turn:
    """One claimed turn of a session, from its claim to its end."""

    id: str
    message: Message
    # The turn's latest assistant text, kept as the worker says it, so that its end can
    # name its partial work without reading the store.
    last_say: str | None = None
    paused: bool = False  # frozen in place (semantics §14.4) until resumed
    wake_latch: bool = False  # a waking send came while it stopped: the queue goes on after
    # A user's or a parent's steers issued to the turn and not yet delivered, in order (the
    # last few, ``actors.stops``): those left when the turn ends were never delivered, and
    # the transcript says so, since whoever issued one was told it was bound to this turn.
    steers: deque[Steer] | None = None
    # A crash interrupted it and it runs on (semantics §17.1, ``actors.recovery``): how
    # often, and what its driver is told of the latest time.
    recoveries: int = 0
    recovered: Recovered | None = None
    # The helpers' parts:
    stop: PendingStop | None = None  # the stop that stands and its clock (actors.stops)
    watch: Watch | None = None  # the stall watchdog's clock and ladder (actors.watchdog)
    book: Book | None = None  # the tool calls and preempts its report lists (actors.reports)
    # Telemetry on (semantics §16.3): the turn's span (its trace rides in the turn's spec
    # and in its parent's notice), and the control actions' spans that have not landed
    # yet (actors.listener).
    span: TurnSpan | None = None
    controls: Controls | None = None
    # Its calls that wait for a decision, by approval id, and the last one's number (its
    # timer's generation) (semantics §17.2, actors.approvals).
    approvals: dict[str, Pending] | None = None
    approval_gen: int = 0
