"""Stop reports (semantics §15.6): what a cancel, an abort or a preempt did to a turn,
durable as soon as the stop is accepted and completed when it took effect.

A turn has one report. The cancel's or abort's is written when the stop is accepted
(``accepted``) and completed once the turn has ended (``land``): when and how the stop
took effect, what it killed, what became of each tool call it found open. A preempt's is
written when its worker says it landed (``preempt_landed``), unless the turn's own stop
has one, and gets the turn's outcome at the end. Which tool calls a report lists and
when a stop took effect: docs/DECISIONS.md, "Stop reports".

The book (``Book``) is gathered as the turn runs: the worker's tool calls opening and
closing (``tool_marks``) and the preempts issued (``preempt_issued``). These are the
session's helpers: its host's thread calls them, with the session and its running turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from tether.actors.outcomes import TurnOutcome
from tether.actors.ports import TurnOver
from tether.actors.turn import Turn
from tether.wire.frames import ToolFateName, ToolKilled, ToolMark
from tether.wire.records import Stop, StopReport, ToolFate

if TYPE_CHECKING:
    from tether.actors.agent import Session
    from tether.actors.stops import PendingStop

__all__ = [
    "Book",
    "Cut",
    "accepted",
    "land",
    "preempt_issued",
    "preempt_landed",
    "report",
    "tool_marks",
]

_PREEMPTS_KEPT = 16  # preempts remembered per turn, to date the one a ToolKilled reports


@dataclass(slots=True)
class Cut:
    """A tool call a stop found open (or that opened before the stop took effect)."""

    name: str
    call: str | None
    fate: ToolFateName | None = None  # None while it is open
    late: bool = False  # opened after the stop took effect: listed only if it was cut


@dataclass(slots=True)
class Book:
    """What a turn's report is made of, gathered as the turn runs."""

    # the tool calls open now: number -> (name, call)
    tools: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    cut: dict[int, Cut] = field(default_factory=dict)  # those the stop found open
    # the preempts issued and not yet seen to land, each with when it was accepted
    preempts: list[tuple[Stop, float]] = field(default_factory=list)
    # the calls a preempt cut, for its ToolKilled
    preempted: list[ToolFate] = field(default_factory=list)
    preempt_report: StopReport | None = None


def _book(t: Turn) -> Book:
    if t.book is None:
        t.book = Book()
    return t.book


def report(session: str, turn: str, stop: Stop, at: float, **more: Any) -> StopReport:
    """The report of ``stop`` on ``turn`` (requested at ``at``): the one place a stop
    becomes its report's fields."""
    return StopReport(
        turn=turn,
        session=session,
        kind=stop.kind,
        origin=stop.origin,
        by=stop.by,
        reason=stop.reason,
        requested_at=at,
        **more,
    )


def tool_marks(t: Turn, marks: list[ToolMark]) -> None:
    """The worker's tool calls opening and closing: which ones a stop finds open."""
    b = _book(t)
    p = t.stop
    for m in marks:
        if m.name is not None:
            b.tools[m.id] = (m.name, m.call)
            if p is not None:  # opened while a stop is pending, or after it
                late = p.kind == "cancel" and p.delivered
                b.cut[m.id] = Cut(m.name, m.call, late=late)
        elif m.fate is not None:
            opened = b.tools.pop(m.id, None)
            cut = b.cut.get(m.id)
            if cut is not None:
                cut.fate = m.fate
            if m.fate == "preempted" and opened is not None:
                b.preempted.append(ToolFate(name=opened[0], fate="preempted", call=opened[1]))


def accepted(s: Session, t: Turn, p: PendingStop) -> None:
    """A cancel or abort bound to ``t``: note the tool calls it finds open and write the
    first version of its report (completed when the turn ends)."""
    b = _book(t)
    for number, (name, call) in b.tools.items():
        b.cut.setdefault(number, Cut(name, call))
    s.services.store.put_stop_report(report(s.id, t.id, p.stop, p.at))


def preempt_issued(t: Turn, stop: Stop, at: float) -> None:
    """A preempt was issued at ``at``: its report is dated from then when it lands."""
    pending = _book(t).preempts
    pending.append((stop, at))
    del pending[:-_PREEMPTS_KEPT]  # those that found no command stay no-ops


def preempt_landed(s: Session, t: Turn, frame: ToolKilled) -> None:
    """A preempt landed: its report, unless the turn's own stop has one (a turn has one
    report, and the stop that ends it is the one that matters)."""
    b = _book(t)
    tools, b.preempted = b.preempted, []
    now = s.services.clock.now()
    at = now
    pending = b.preempts
    for n, (issued, when) in enumerate(pending):
        if issued == frame.stop:
            at = when
            del pending[: n + 1]  # the ones before it were no-ops, or the same tool's
            break
    if t.stop is not None:
        return
    b.preempt_report = report(
        s.id,
        t.id,
        frame.stop,
        at,
        effective_at=now,
        latency_ms=_ms(now - at),
        via=frame.via,
        processes=list(frame.processes),
        tools=tools,
    )
    s.services.store.put_stop_report(b.preempt_report)


def land(
    s: Session,
    t: Turn,
    over: TurnOver,
    decided: TurnOutcome,
    partial: str | None,
    seen: float,
) -> StopReport | None:
    """The turn has ended (``seen``: when its end was observed): the stop's report
    completed (and returned), or a preempt's given the turn's outcome. ``partial`` is
    None, never "", when there is no assistant text."""
    if t.stop is not None:
        return _final(s, t, t.stop, over, decided, partial, seen)
    if t.book is not None and t.book.preempt_report is not None:
        done = msgspec.structs.replace(
            t.book.preempt_report, outcome=decided.outcome, partial=partial
        )
        s.services.store.put_stop_report(done)
    return None


def _final(
    s: Session,
    t: Turn,
    p: PendingStop,
    over: TurnOver,
    decided: TurnOutcome,
    partial: str | None,
    seen: float,
) -> StopReport:
    """Complete the stop's report: when and how it took effect, what it killed, what
    became of each tool call it found open."""
    now = seen
    killed = over.end is None  # the worker did not report an end: its tree was killed
    forced, escalated = decided.forced, decided.escalated
    effective: float
    via: str | None
    if p.kind == "cancel" and p.delivered_at is not None and not (forced or escalated):
        effective, via = p.delivered_at, p.delivered_via  # the driver took it
    elif killed:
        # The kill, confirmed by the executor: a forced or escalated cancel took effect
        # only then, whatever reached the driver before (a shield held it, or the
        # driver ignored it).
        effective, via = now, over.via
    else:  # the driver ended the turn on its own once the stop had reached it
        effective, via = now, "boundary"
    tools: list[ToolFate] = []
    cuts = t.book.cut.values() if t.book is not None else ()
    for cut in cuts:
        fate: ToolFateName = cut.fate or ("killed" if killed else "abandoned")
        if cut.late and fate == "returned":
            continue  # a wrap-up call the stop did not touch
        tools.append(ToolFate(name=cut.name, fate=fate, call=cut.call))
    done = report(
        s.id,
        t.id,
        p.stop,
        p.at,
        effective_at=effective,
        latency_ms=_ms(effective - p.at),
        outcome=decided.outcome,
        forced=forced,
        escalated=escalated,
        via=via,
        processes=list(over.processes) if killed else [],
        tools=tools,
        partial=partial,
    )
    s.services.store.put_stop_report(done)
    return done


def _ms(seconds: float) -> float:
    return round(max(seconds, 0.0) * 1000.0, 3)
