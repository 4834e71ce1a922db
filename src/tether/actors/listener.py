"""What a session tells of what happened to its turns and its control actions, and the
one place in the actors that makes telemetry's spans of it (semantics §16.3).

A session tells its ``Listener`` as things happen: a turn started, a control action was
issued (and changed nothing, landed at once, or waits for its turn: a steer lands at a
boundary, a preempt when its tool is stopped, a stop when the turn ends), a pause or a
resume, a turn ended. ``listener_for`` gives the quiet ``Listener`` when telemetry is off
(every method returns at once, so a turn pays a few calls), else a ``SpanListener``,
which keeps the spans that have not landed yet on the turn (``Turn.controls``). A
control action refused at the door, or with no running turn, never reaches a turn
(``unbound``). Everything here runs on the session's host's thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tether.actors.ports import Executor
from tether.telemetry.hooks import ControlSpan, Telemetry
from tether.wire.frames import Steer, TurnEnd
from tether.wire.records import SessionHeader, Stop, StopReport

if TYPE_CHECKING:
    from tether.actors.outcomes import TurnOutcome
    from tether.actors.turn import Turn

__all__ = ["Controls", "Listener", "SpanListener", "listener_for"]


def listener_for(telemetry: Telemetry, executor: Executor) -> Listener:
    """The quiet listener with telemetry off, else one that makes its spans."""
    return SpanListener(telemetry, executor) if telemetry.on else Listener()


class Listener:
    """Told what happened; telemetry off, so nothing is done with it. ``on``: whether
    anything is done (a caller may skip building what it would tell)."""

    __slots__ = ()
    on = False

    def turn_started(self, t: Turn, header: SessionHeader, lineage: tuple[str, ...]) -> None:
        """``t`` was claimed (its span starts; the session hands its trace on)."""

    def control(
        self,
        session: str,
        t: Turn,
        verb: str,
        origin: str,
        by: str,
        guard: str | None,
        trace: str | None,
    ) -> ControlSpan | None:
        """A control action reached the running turn ``t`` (``guard``: the turn it
        named, if any; ``trace``: its caller's context). What comes of it is told next,
        with what this returns: ``unchanged``, ``landed`` or ``pending``."""
        return None

    def unchanged(self, t: Turn, ctl: ControlSpan | None) -> None:
        """The control action changed nothing (an accepted no-op)."""

    def landed(self, t: Turn, ctl: ControlSpan | None) -> None:
        """It took effect at once (a pause, a resume)."""

    def pending(self, t: Turn, ctl: ControlSpan | None, issued: Steer | Stop) -> None:
        """It was issued and lands later: a steer at a boundary (``steers_landed``), a
        preempt when its tool is stopped (``preempt_landed``), a cancel or an abort (the
        turn's stop, which overrides what stood) at the turn's end."""

    def unbound(
        self,
        outcome: str,
        verb: str,
        origin: str,
        by: str,
        target: str,
        guard: str | None,
        trace: str | None,
    ) -> None:
        """A control action that reached no running turn: ``refused`` at the door, or a
        ``no-op``."""

    def steers_landed(self, t: Turn, n: int) -> None:
        """The worker handed ``n`` steers to the driver, in the order they were issued."""

    def preempt_landed(self, t: Turn, stop: Stop) -> None:
        """The preempt ``stop`` stopped a tool (those issued before it found none)."""

    def paused(self, t: Turn, origin: str, by: str, reason: str) -> None:
        """``t`` was frozen in place."""

    def resumed(self, t: Turn, origin: str, by: str) -> None:
        """``t`` was thawed."""

    def turn_ended(
        self,
        t: Turn,
        decided: TurnOutcome,
        final: str | None,
        end: TurnEnd | None,
        landed: StopReport | None,
    ) -> None:
        """``t`` ended as ``decided`` (``end``: its worker's report, None when it died;
        ``landed``: its stop's completed report)."""


@dataclass(slots=True)
class Controls:
    """A turn's control spans that have not landed yet."""

    steers: deque[ControlSpan] = field(default_factory=deque)  # in the order issued
    preempts: list[tuple[Stop, ControlSpan]] = field(default_factory=list)
    stop: ControlSpan | None = None  # the stop that stands


class SpanListener(Listener):
    """Telemetry on: the turn's span (which its worker makes), and a span for each
    control action, linked to the turn's, ended when it lands or when it is clear it
    never will."""

    __slots__ = ("_executor", "_tel")
    on = True

    def __init__(self, telemetry: Telemetry, executor: Executor) -> None:
        self._tel = telemetry
        self._executor = executor  # a pause's or a resume's event goes to the worker

    def turn_started(self, t: Turn, header: SessionHeader, lineage: tuple[str, ...]) -> None:
        t.span = self._tel.turn_started(
            name=header.slug or header.driver.rpartition(":")[2],
            session=header.id,
            root=lineage[0] if lineage else header.id,
            turn=t.id,
            parent=t.message.trace,
            message=t.message.content,
        )

    def control(
        self,
        session: str,
        t: Turn,
        verb: str,
        origin: str,
        by: str,
        guard: str | None,
        trace: str | None,
    ) -> ControlSpan | None:
        return self._tel.control(
            verb=verb,
            origin=origin,
            by=by,
            target=session,
            expected_turn=guard if guard is not None else t.id,
            turn=t.span,
            parent=trace,
        )

    def unchanged(self, t: Turn, ctl: ControlSpan | None) -> None:
        self._ended(ctl, "no-op", t)

    def landed(self, t: Turn, ctl: ControlSpan | None) -> None:
        self._ended(ctl, "landed", t)

    def pending(self, t: Turn, ctl: ControlSpan | None, issued: Steer | Stop) -> None:
        if ctl is None:
            return
        c = _controls(t)
        if isinstance(issued, Steer):
            c.steers.append(ctl)
        elif issued.kind == "preempt":
            c.preempts.append((issued, ctl))
        else:
            # The turn's stop now: the steers it discards never land; a cancel an abort
            # overrides lands no more (the abort's effect is the turn's end).
            while c.steers:
                self._ended(c.steers.popleft(), "no-op", t)
            if c.stop is not None:
                self._ended(c.stop, "no-op", t)
            c.stop = ctl

    def unbound(
        self,
        outcome: str,
        verb: str,
        origin: str,
        by: str,
        target: str,
        guard: str | None,
        trace: str | None,
    ) -> None:
        span = self._tel.control(
            verb=verb,
            origin=origin,
            by=by,
            target=target,
            expected_turn=guard,
            turn=None,
            parent=trace,
        )
        if span is not None:
            self._tel.control_ended(span, outcome)

    def steers_landed(self, t: Turn, n: int) -> None:
        c = t.controls
        if c is None:
            return
        for _ in range(n):
            if c.steers:
                self._ended(c.steers.popleft(), "landed", t)

    def preempt_landed(self, t: Turn, stop: Stop) -> None:
        c = t.controls
        if c is None:
            return
        for n, (named, span) in enumerate(c.preempts):
            if named == stop:  # the first issued with its origin, by and reason
                for _, missed in c.preempts[:n]:  # found no command: no-ops
                    self._ended(missed, "no-op", t)
                del c.preempts[: n + 1]
                # the turn has a report now: this preempt's, or its own stop's
                self._ended(span, "landed", t, report=t.id)
                return

    def paused(self, t: Turn, origin: str, by: str, reason: str) -> None:
        self._event(t, "paused", origin, by, reason)

    def resumed(self, t: Turn, origin: str, by: str) -> None:
        self._event(t, "resumed", origin, by, "")

    def turn_ended(
        self,
        t: Turn,
        decided: TurnOutcome,
        final: str | None,
        end: TurnEnd | None,
        landed: StopReport | None,
    ) -> None:
        """The turn's span ends with its outcome; its stop's span lands with the stop
        report's latency; what had not landed by now never will."""
        if t.span is None:
            return
        c = t.controls
        if c is not None:
            if c.stop is not None:
                latency = landed.latency_ms if landed is not None else None
                self._ended(c.stop, "landed", t, latency, report=t.id)
            for span in c.steers:
                self._ended(span, "no-op", t)
            for _, span in c.preempts:
                self._ended(span, "no-op", t)
            t.controls = None
        self._tel.turn_ended(
            t.span,
            reported=end is not None,
            outcome=decided.outcome,
            cause=decided.cause,
            by=decided.by,
            origin=t.stop.stop.origin if t.stop is not None else None,
            reason=decided.reason,
            error=decided.error,
            final=final if final is not None else t.last_say,
            usage=end.usage if end is not None else None,
        )

    def _event(self, t: Turn, name: str, origin: str, by: str, reason: str) -> None:
        """A pause or a resume on the turn's span, which its worker makes: sent to it."""
        if t.span is None:
            return
        frame = self._tel.turn_event(t.span, name, origin, by, reason)
        if frame is not None:
            self._executor.signal(t.id, frame)

    def _ended(
        self,
        span: ControlSpan | None,
        outcome: str,
        t: Turn,
        latency_ms: float | None = None,
        report: str | None = None,
    ) -> None:
        if span is not None:
            self._tel.control_ended(span, outcome, latency_ms=latency_ms, report=report, turn=t.id)


def _controls(t: Turn) -> Controls:
    if t.controls is None:
        t.controls = Controls()
    return t.controls
