"""The host's hooks over the SDK: the turn spans (``invoke_agent``) and the control
spans (``tether.control``) of semantics §16.3. Imported only with telemetry on."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Unpack

from opentelemetry import context as otel_context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tether.telemetry._provider import SCOPE, PresetIds, make_provider
from tether.telemetry._turn import KIND, end_turn_span, start_turn_span
from tether.telemetry.hooks import ControlSpan, Telemetry, TurnEnding, TurnSpan
from tether.telemetry.settings import Settings
from tether.wire.frames import SpanEvent, Trace

__all__ = ["OtelTelemetry", "context_of", "traceparent_of"]

_propagator = TraceContextTextMapPropagator()
_CLOSE_WAIT = 5.0  # seconds a runtime's close waits for its last spans' export
# Sessions whose latest turn's span is remembered, for the controls that find no turn
# running (the least recently started are forgotten: their no-ops are not exported).
_LAST_TURNS = 4096


def context_of(traceparent: str | None) -> otel_context.Context | None:
    """The context a W3C traceparent names (None: none given)."""
    if not traceparent:
        return None
    return _propagator.extract({"traceparent": traceparent})


def traceparent_of(ctx: otel_context.Context | None = None) -> str | None:
    """The traceparent of ``ctx`` (default: the current context), None if it has no span."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier.get("traceparent")


class _TurnSpan(TurnSpan):
    """What the host keeps of a turn's span, which the worker makes: the ids it sent
    (in ``trace``), and the pauses and resumes, in case it has to make it itself."""

    __slots__ = ("events", "message", "session", "turn")

    def __init__(self, trace: Trace, session: str, turn: str, message: str) -> None:
        super().__init__(trace)
        self.session = session
        self.turn = turn
        self.message = message
        self.events: list[tuple[str, dict[str, str], int]] | None = None

    def context(self) -> otel_context.Context:
        ctx = context_of(self.trace.parent)
        assert ctx is not None
        return ctx


class _ControlSpan(ControlSpan):
    __slots__ = ("issued", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.issued = time.monotonic()


class OtelTelemetry(Telemetry):
    on = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.content = settings.content
        self._provider = make_provider(settings, "host")
        self._ids: PresetIds = self._provider.id_generator
        self._tracer = self._provider.get_tracer(SCOPE)
        # session id -> the traceparent of its latest turn's span
        self._last: OrderedDict[str, str] = OrderedDict()
        self._last_lock = threading.Lock()

    # ---- turns ------------------------------------------------------------------------

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
        # The worker makes the span: here only its ids are picked (the trace's from the
        # waking context), a few string operations, no SDK call on a turn's path.
        if parent is not None:
            trace_hex, flags = parent[3:35], parent[53:55]
        else:
            trace_hex, flags = f"{random.getrandbits(128) or 1:032x}", "01"
        here = f"00-{trace_hex}-{random.getrandbits(64) or 1:016x}-{flags}"
        with self._last_lock:
            self._last[session] = here
            self._last.move_to_end(session)
            if len(self._last) > _LAST_TURNS:
                self._last.popitem(last=False)
        trace = Trace(
            parent=here,
            endpoint=self.settings.endpoint,
            content=self.content,
            up=parent,
            name=name,
            root=root,
            start=time.time_ns(),
        )
        return _TurnSpan(trace, session, turn, message)

    def turn_ended(self, span: TurnSpan, *, reported: bool, **ending: Unpack[TurnEnding]) -> None:
        if reported:
            return  # the worker ended it, with what it saw, once it had reported the end
        # No end came (an abort, a crash, a kill after grace): the tree is dead, so the
        # span is the host's to make, with the ids the worker had.
        assert isinstance(span, _TurnSpan)
        s = start_turn_span(
            self._tracer,
            self._ids,
            span.trace,
            session=span.session,
            turn=span.turn,
            message=span.message,
            events=span.events,
        )
        end_turn_span(s, content=self.content, **ending)

    def turn_event(
        self, span: TurnSpan, name: str, origin: str, by: str, reason: str
    ) -> SpanEvent | None:
        assert isinstance(span, _TurnSpan)
        attrs = {"tether.control.origin": origin, "tether.control.by": by}
        if reason:
            attrs["tether.control.reason"] = reason
        at = time.time_ns()
        if span.events is None:
            span.events = []
        span.events.append((name, attrs, at))
        return SpanEvent(turn=span.turn, name=name, time=at, attrs=attrs)

    # ---- control actions --------------------------------------------------------------

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
        ctx = context_of(parent)
        here: otel_context.Context | None
        if isinstance(turn, _TurnSpan):
            here = turn.context()
        else:
            # No turn runs (a no-op, a refusal): it belongs to the target's latest turn's
            # trace, or to the caller's; with neither it would be a trace of one span.
            with self._last_lock:
                last = self._last.get(target)
            here = context_of(last)
            if here is None and ctx is None:
                return None
        attrs: dict[str, Any] = {
            KIND: "CHAIN",
            "tether.control.verb": verb,
            "tether.control.origin": origin,
            "tether.control.by": by,
            "tether.control.target": target,
        }
        if expected_turn is not None:
            attrs["tether.control.expected_turn"] = expected_turn
        links = []
        if here is not None:
            links.append(Link(get_current_span(here).get_span_context()))
            if ctx is None:  # no caller's context: it shows inside the turn it acts on
                ctx = here
        span = self._tracer.start_span(
            f"tether.control {verb}",
            context=ctx,
            kind=SpanKind.INTERNAL,
            attributes=attrs,
            links=links,
        )
        return _ControlSpan(span)

    def control_ended(
        self,
        span: ControlSpan,
        outcome: str,
        *,
        latency_ms: float | None = None,
        report: str | None = None,
        turn: str | None = None,
    ) -> None:
        assert isinstance(span, _ControlSpan)
        s = span.span
        s.set_attribute("tether.control.outcome", outcome)
        if turn is not None:
            s.set_attribute("tether.turn.id", turn)
        if outcome == "landed":
            if latency_ms is None:
                latency_ms = round((time.monotonic() - span.issued) * 1000.0, 3)
            s.set_attribute("tether.control.latency_ms", latency_ms)
        if report is not None:
            s.set_attribute("tether.control.report", report)
        if outcome == "refused":
            s.set_attribute("error.type", "refused")
            s.set_status(Status(StatusCode.ERROR, "refused"))
        s.end()

    # ---- context ----------------------------------------------------------------------

    def current(self) -> str | None:
        # On every send and spawn: read the span's ids and format them as the W3C
        # propagator does, without its carrier dict and context walk (most senders trace
        # nothing, and then this is one context lookup).
        ids = get_current_span().get_span_context()
        if not ids.is_valid:
            return None
        return f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}"

    @contextlib.contextmanager
    def attached(self, traceparent: str | None) -> Iterator[None]:
        ctx = context_of(traceparent)
        if ctx is None:
            yield
            return
        token = otel_context.attach(ctx)
        try:
            yield
        finally:
            otel_context.detach(token)

    def close(self) -> None:
        # The SDK's shutdown waits for the export, retries included: bounded here, so a
        # receiver that is down never holds a runtime's close for long.
        done = threading.Thread(
            target=self._provider.shutdown, name="tether-otel-close", daemon=True
        )
        done.start()
        done.join(_CLOSE_WAIT)
