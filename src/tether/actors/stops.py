"""A running turn's interrupts and the stop that stands on it (semantics §5, §14.2;
how each travels: docs/design.md, section 6).

Requested is kept apart from took-effect. ``PendingStop`` records the issued stop (the
first one stands; an abort overrides a cancel) and ``delivered`` that the driver saw the
cancel at a boundary; a grace or deadline timer only *requests* a kill; the outcome
(``forced``, ``escalated`` included) is decided when the turn has ended (``decide``), from
what actually happened to it.

The stop's clock, one timer at a time:

- a cancel arms its **deadline** (the interrupt's, or the runtime's ``cancel_deadline``);
- a boundary taking the cancel disarms it and arms the **grace** (``delivered``);
- the grace firing requests a kill (``force``);
- the deadline firing with no boundary seen asks the worker (``Escalate``) and arms
  ``ESCALATE_WAIT``: on its ``Escalating`` answer, or when that runs out, a kill is
  requested (``escalate``); a turn no worker has taken escalates at once;
- an abort disarms it and kills at once;
- a pause stops it, keeping what is left of it (``pause``), a resume runs it again
  (``resume``);
- a dispose shortens a pending cancel's deadline to its grace, never lengthens it.

A timer carries the clock's generation, so one re-armed or cancelled meanwhile is
ignored (``fired``). These are the session's helpers: its host's thread calls them, with
the session and its running turn; nothing here takes a lock or reads a clock of its own.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import structlog

from tether.actors import reports
from tether.actors.clock import Timer
from tether.actors.outcomes import TurnFacts, TurnOutcome, decide_outcome
from tether.actors.ports import TurnOver
from tether.actors.services import TimerKind
from tether.actors.turn import Turn
from tether.wire.frames import Cancel, CancelFrame, Delivered, Escalate, Preempt, Steer, SteerFrame
from tether.wire.records import Stop, StopOrigin
from tether.wire.text import discarded_text
from tether.wire.vocab import Kind

if TYPE_CHECKING:
    from tether.actors.agent import Session

__all__ = [
    "ESCALATE_WAIT",
    "STEERS_KEPT",
    "Interrupt",
    "PendingStop",
    "decide",
    "delivered",
    "disarm",
    "discarded",
    "dispose",
    "escalating",
    "fired",
    "issue",
    "pause",
    "resume",
]

log = structlog.get_logger("tether.agent")

ESCALATE_WAIT = 1.0  # seconds to wait for a worker's answer to Escalate before killing
STEERS_KEPT = 16  # undelivered steers remembered per turn, to note those never delivered


@dataclass(frozen=True, slots=True)
class Interrupt:
    """An authorized interrupt, as the host hands it to the session."""

    kind: Kind
    origin: StopOrigin
    by: str
    reason: str
    grace: float
    deadline: float | None = None
    turn: str | None = None  # the guard: act only if this is still the running turn
    trace: str | None = None  # the caller's trace context (telemetry on)


@dataclass(slots=True)
class PendingStop:
    """The turn's stop (a cancel or an abort) and what became of it so far. An abort over
    a cancel replaces ``stop``, ``grace`` and ``at`` and keeps the rest: what the cancel
    did still counts."""

    stop: Stop
    grace: float
    at: float  # wall clock at acceptance: the report's requested_at
    # The first stop the turn got: the one that discarded its pending steers (semantics §5).
    first: Literal["cancel", "abort"]
    delivered: bool = False  # a boundary (or an await) took the cancel
    # When and how the cancel took effect in the driver (a shield held it: at its exit).
    delivered_at: float | None = None
    delivered_via: str = "boundary"
    force: bool = False  # the grace fired: a kill was requested
    escalating: bool = False  # the deadline passed: the worker was asked (Escalate)
    escalate: bool = False  # no boundary before the deadline: a kill was requested
    # The clock (grace, deadline or escalate); ``gen`` tells a timer that fired before it
    # was re-armed or cancelled from the current one.
    clock: TimerKind | None = None
    timer: Timer | None = None
    due: float = 0.0  # the monotonic time at which the clock fires
    gen: int = 0
    # the clock a pause stopped: which, and what was left of it
    stopped_clock: tuple[TimerKind, float] | None = None

    @property
    def kind(self) -> Literal["cancel", "abort"]:
        return "abort" if self.stop.kind == "abort" else "cancel"  # only these two pend


# ---- issuing ---------------------------------------------------------------------------


def issue(s: Session, t: Turn, i: Interrupt) -> Steer | Stop | None:
    """Issue ``i`` to the running turn ``t``: what was issued (the steer, or the stop), or
    None when it changes nothing (a steer to a stopping turn, a second cancel, a second
    abort: the stop that stands is the first)."""
    match i.kind:
        case "steer":
            return _steer(s, t, i)
        case "preempt":
            return _preempt(s, t, i)
        case "cancel":
            return _cancel(s, t, i)
        case "abort":
            return _abort(s, t, i)


def _steer(s: Session, t: Turn, i: Interrupt) -> Steer | None:
    if t.stop is not None:
        log.info("interrupt.dropped", session=s.id, kind="steer", why="turn is stopping")
        return None
    steer = Steer(i.reason, i.origin, i.by)
    s.services.executor.signal(t.id, SteerFrame(t.id, steer))
    if i.origin in ("user", "parent"):  # the system's own steers have their own trace
        if t.steers is None:
            t.steers = deque(maxlen=STEERS_KEPT)
        t.steers.append(steer)
        if s.recovers:  # a crash before a boundary took it delivers it after
            s.services.store.put_steer(t.id, steer)
    return steer


def _preempt(s: Session, t: Turn, i: Interrupt) -> Stop:
    stop = Stop("preempt", i.origin, i.by, i.reason)
    s.services.executor.signal(t.id, Preempt(t.id, stop))
    reports.preempt_issued(t, stop, s.services.clock.now())
    return stop


def _cancel(s: Session, t: Turn, i: Interrupt) -> Stop | None:
    if t.stop is not None:
        return None  # one pending stop per turn: the first one stands
    h = s.services
    stop = Stop("cancel", i.origin, i.by, i.reason)
    t.stop = p = PendingStop(stop, i.grace, h.clock.now(), "cancel")
    # the signal first, the bookkeeping after
    h.executor.signal(t.id, CancelFrame(t.id, Cancel(stop)))
    s.marker(t, "cancelled", stop.origin, stop.by, stop.reason)
    reports.accepted(s, t, p)
    deadline = i.deadline if i.deadline is not None else h.cancel_deadline
    if deadline is not None:
        _arm(s, t, p, deadline, "deadline")
    return stop


def _abort(s: Session, t: Turn, i: Interrupt) -> Stop | None:
    p = t.stop
    if p is not None and p.kind == "abort":
        return None
    h = s.services
    stop = Stop("abort", i.origin, i.by, i.reason)
    now = h.clock.now()
    if p is None:
        t.stop = p = PendingStop(stop, i.grace, now, "abort")
    else:  # over a pending cancel
        p.stop, p.grace, p.at = stop, i.grace, now
    disarm(p)
    p.stopped_clock = None
    h.executor.kill(t.id)  # a frozen tree too: SIGKILL needs no thaw
    s.marker(t, "aborted", stop.origin, stop.by, stop.reason)
    reports.accepted(s, t, p)
    return stop


# ---- what the worker says ----------------------------------------------------------------


def delivered(s: Session, t: Turn, frame: Delivered) -> None:
    """What the driver was handed at a boundary: each steer's marker, and a cancel taken
    (no escalation then: its grace starts)."""
    for steer in frame.steers:
        s.marker(t, "steered", steer.origin, steer.by, steer.text)
        if t.steers:
            with contextlib.suppress(ValueError):  # not kept: the system's, or a very old one
                t.steers.remove(steer)
    p = t.stop
    if not frame.cancel or p is None:
        return
    if not p.delivered:
        p.delivered = True
        if p.kind == "cancel" and not p.escalate:
            _arm(s, t, p, p.grace, "grace")
    if not frame.held and p.delivered_at is None:
        # When the cancel took effect; one a shield held took effect at its exit.
        p.delivered_at = s.services.clock.now()
        p.delivered_via = frame.via


def escalating(s: Session, t: Turn) -> None:
    """The worker will never hand the cancel over now: escalate to an abort."""
    p = t.stop
    if p is not None and p.escalating and not p.delivered:
        _escalate(s, t, p)


# ---- the clock -------------------------------------------------------------------------


def fired(s: Session, t: Turn, which: TimerKind, gen: int) -> None:
    """The stop's clock fired (``gen``: the generation it was armed with)."""
    p = t.stop
    if p is None or gen != p.gen or t.paused or p.kind != "cancel":
        return  # stale, or stopped by a pause (re-armed on resume)
    p.timer = p.clock = None
    h = s.services
    if which == "grace":
        p.force = True
        # Only a request: whether anything was forced is known when the turn ends.
        h.executor.kill(t.id)
    elif p.delivered:
        return
    elif which == "deadline" and h.executor.dispatched(t.id):
        # The worker decides whether its boundary came first (semantics §5: a boundary
        # reached before the deadline must win even if its report is in flight).
        p.escalating = True
        h.executor.signal(t.id, Escalate(t.id))
        _arm(s, t, p, ESCALATE_WAIT, "escalate")
    else:  # no worker yet, or the worker did not answer: nothing can deliver it now
        _escalate(s, t, p)


def _escalate(s: Session, t: Turn, p: PendingStop) -> None:
    disarm(p)
    p.escalate = True
    s.services.executor.kill(t.id)


def _arm(s: Session, t: Turn, p: PendingStop, delay: float, which: TimerKind) -> None:
    """Run the stop's clock; a paused turn holds it until resumed (semantics §14.4)."""
    disarm(p)
    if t.paused:
        p.stopped_clock = (which, delay)
        return
    p.gen += 1
    p.clock = which
    p.due = s.services.clock.monotonic() + delay
    p.timer = s.services.arm(s.id, t.id, which, delay, p.gen)


def disarm(p: PendingStop) -> None:
    """Cancel the stop's clock (a timer already on its way is stale now)."""
    if p.timer is not None:
        p.timer.cancel()
    p.timer = p.clock = None
    p.gen += 1


def pause(s: Session, t: Turn) -> None:
    """A pause: the stop's clock stops, keeping what was left of it."""
    p = t.stop
    if p is not None and p.timer is not None and p.clock is not None:
        stopped = (p.clock, max(p.due - s.services.clock.monotonic(), 0.0))
        disarm(p)
        p.stopped_clock = stopped


def resume(s: Session, t: Turn) -> None:
    """A resume: the clock a pause stopped runs again for what was left of it."""
    p = t.stop
    if p is not None and p.stopped_clock is not None:
        which, left = p.stopped_clock
        p.stopped_clock = None
        _arm(s, t, p, left, which)


def dispose(s: Session, t: Turn, origin: StopOrigin, by: str, grace: float) -> None:
    """A dispose's stop: a cancel with ``grace`` as its grace and its deadline (escalating
    to an abort), or a deadline of that length for a cancel pending (only ever sooner than
    its own, never later); a frozen turn reaches no boundary, so it is aborted (semantics
    §14.4)."""
    p = t.stop
    if t.paused:
        s.interrupt(Interrupt("abort", origin, by, "disposed", grace))
    elif p is None:
        s.interrupt(Interrupt("cancel", origin, by, "disposed", grace, grace))
    elif not p.delivered and p.kind == "cancel" and not p.escalate:
        due = s.services.clock.monotonic() + grace
        if p.timer is None or p.due > due:
            _arm(s, t, p, grace, "deadline")


# ---- the end -------------------------------------------------------------------------------


def decide(s: Session, t: Turn, over: TurnOver) -> TurnOutcome:
    """The turn's outcome, and the markers of a kill that took effect (forced,
    escalated)."""
    end, p = over.end, t.stop
    decided = decide_outcome(
        TurnFacts(
            stop=None if p is None else p.stop,
            end="died" if end is None else end.outcome,
            force_requested=p is not None and p.force,
            escalate_requested=p is not None and p.escalate,
            error=over.error if end is None else end.error,
        )
    )
    if decided.forced and p is not None:
        why = f"no end {p.grace:g}s after the cancel"
        s.marker(t, "forced", "system", "system", why)
    if decided.escalated:
        s.marker(t, "escalated", "system", "system", "no boundary before the deadline")
    return decided


def discarded(s: Session, t: Turn) -> None:
    """The steers no boundary took, now that the turn has ended: a stop discarded them
    (semantics §5) or the turn ended first. Each gets a ``discarded`` marker with its
    text, and ``data.stop``, the stop that discarded it (None: the end came first)."""
    first = None if t.stop is None else t.stop.first
    for steer in t.steers or ():
        s.marker(
            t,
            "discarded",
            steer.origin,
            steer.by,
            steer.text,
            text=discarded_text(steer.origin, steer.by, first, steer.text),
            data={"stop": first},
        )
    t.steers = None
