"""The host's telemetry hooks, as the engine calls them: no-ops unless telemetry is on.

The session state machine tells its listener (``actors.listener``) what happened, and
the listener calls these at a turn's start and end, at a pause and a resume, and for
each control action; the runtime asks it for the caller's trace context. Off, every
hook returns at once and ``on`` is False, so the engine can skip even building their
arguments. On, a turn costs the host only the choice of its span's ids: the worker
makes the span.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypedDict, Unpack

from tether.wire.frames import SpanEvent, Trace

__all__ = ["NOOP", "ControlSpan", "Telemetry", "TurnEnding", "TurnSpan", "error_type"]

# A stop's kind or a turn's outcome, as ``error.type`` says it; any stop of origin
# ``budget`` is ``budget`` (semantics §16.3).
_ERROR_TYPES = {
    "cancel": "cancelled",
    "cancelled": "cancelled",
    "abort": "aborted",
    "aborted": "aborted",
    "preempt": "preempted",
    "preempted": "preempted",
    "crashed": "crashed",
    "failed": "failed",
}


def error_type(what: str, origin: str | None = None) -> str:
    """``error.type`` of a stopped span: a stop's kind or a turn's outcome."""
    if origin == "budget":
        return "budget"
    return _ERROR_TYPES.get(what, "failed")


class TurnEnding(TypedDict):
    """How a turn ended, as its span records it: the keywords of the host's
    ``Telemetry.turn_ended``, the worker's ``spans.turn_ended`` and ``_turn.end_turn_span``,
    named once here so that the hooks that pass them on cannot drift apart."""

    outcome: str
    cause: str | None
    by: str | None
    origin: str | None
    reason: str | None
    error: str | None
    final: str | None
    usage: dict[str, int] | None


class TurnSpan:
    """A turn's span (``invoke_agent``), opaque to the engine. ``trace`` is what the
    worker gets in ``RunTurn``; ``parent`` the traceparent that a message sent from the
    turn's own end (its parent's notice) carries."""

    __slots__ = ("parent", "trace")

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.parent = trace.parent


class ControlSpan:
    """One control action's span (``tether.control``), opaque to the engine."""

    __slots__ = ()


class Telemetry:
    """The hooks, as no-ops (telemetry off). ``_host.OtelTelemetry`` implements them."""

    on = False
    content = False

    def turn_started(
        self,
        *,
        name: str,
        session: str,
        root: str,
        turn: str,
        parent: str | None,
        message: str,
    ) -> TurnSpan | None:
        """A turn was claimed: its span starts, a child of ``parent`` (the traceparent
        its message was sent under), else a new trace's root."""
        return None

    def turn_ended(self, span: TurnSpan, *, reported: bool, **ending: Unpack[TurnEnding]) -> None:
        """The turn ended. ``reported``: its worker reported the end, and ends the span
        itself; else (killed, crashed) the host makes it: ERROR with ``error.type``."""

    def turn_event(
        self, span: TurnSpan, name: str, origin: str, by: str, reason: str
    ) -> SpanEvent | None:
        """A pause or a resume, as an event on the turn's span: the frame that takes it
        to the worker, which owns the span."""
        return None

    def control(
        self,
        *,
        verb: str,
        origin: str,
        by: str,
        target: str,
        expected_turn: str | None,
        turn: TurnSpan | None,
        parent: str | None,
    ) -> ControlSpan | None:
        """A control action was issued: its span starts, linked to the turn's span
        (``turn``; with none running, the target's latest turn's), a child of the
        caller's context (``parent``) or else of that turn. None: no trace to join."""
        return None

    def control_ended(
        self,
        span: ControlSpan,
        outcome: str,
        *,
        latency_ms: float | None = None,
        report: str | None = None,
        turn: str | None = None,
    ) -> None:
        """It landed (``latency_ms`` after it was issued), was a no-op, or was refused."""

    def current(self) -> str | None:
        """The caller's current trace context (its traceparent), if it has one."""
        return None

    @contextlib.contextmanager
    def attached(self, traceparent: str | None) -> Iterator[None]:
        """Run the block with ``traceparent`` as the current context (a worker's tool
        call handled on a host thread: what it sends or stops is the call's child)."""
        yield

    def close(self) -> None:
        """Export what is left (the runtime closes)."""


NOOP = Telemetry()
