"""The host's hooks over the SDK: the turn spans (``invoke_agent``) and the control
spans (``tether.control``) of SPEC §16.3. Imported only with telemetry on."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tether.telemetry._provider import SCOPE, make_provider
from tether.telemetry.hooks import ControlSpan, Telemetry, TurnSpan, error_type
from tether.telemetry.settings import Settings
from tether.wire.frames import Trace

__all__ = ["OtelTelemetry", "context_of", "traceparent_of"]

_propagator = TraceContextTextMapPropagator()
_CLOSE_WAIT = 5.0  # seconds a runtime's close waits for its last spans' export


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
    __slots__ = ("span",)

    def __init__(self, trace: Trace, span: Any) -> None:
        super().__init__(trace)
        self.span = span


class _ControlSpan(ControlSpan):
    __slots__ = ("issued", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.issued = time.monotonic()


def _messages(role: str, text: str) -> str:
    """A message as the GenAI conventions record content (``gen_ai.*.messages``)."""
    return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}])


class OtelTelemetry(Telemetry):
    on = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.content = settings.content
        self._provider = make_provider(settings, "host")
        self._tracer = self._provider.get_tracer(SCOPE)

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
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": name,
            "gen_ai.agent.id": session,
            "gen_ai.conversation.id": root,
            "tether.turn.id": turn,
        }
        if self.content:
            attrs["gen_ai.input.messages"] = _messages("user", message)
        span = self._tracer.start_span(
            f"invoke_agent {name}",
            context=context_of(parent),
            kind=SpanKind.INTERNAL,
            attributes=attrs,
        )
        here = traceparent_of(set_span_in_context(span))
        if here is None:  # not sampled by the SDK's sampler: nothing below it either
            return None
        trace = Trace(parent=here, endpoint=self.settings.endpoint, content=self.content)
        return _TurnSpan(trace, span)

    def turn_ended(
        self,
        span: TurnSpan,
        *,
        outcome: str,
        cause: str | None,
        by: str | None,
        origin: str | None,
        reason: str | None,
        error: str | None,
        final: str | None,
        usage: dict[str, int] | None,
    ) -> None:
        assert isinstance(span, _TurnSpan)
        s = span.span
        s.set_attribute("tether.outcome", outcome)
        if cause is not None:
            s.set_attribute("tether.cause", cause)
        if by is not None:
            s.set_attribute("tether.by", by)
        if usage:
            if "prompt_tokens" in usage:
                s.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
            if "completion_tokens" in usage:
                s.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
        if self.content and final:
            s.set_attribute("gen_ai.output.messages", _messages("assistant", final))
        if outcome != "completed":
            s.set_attribute("error.type", error_type(outcome, origin))
            s.set_status(Status(StatusCode.ERROR, reason or error or outcome))
        s.end()

    def turn_event(self, span: TurnSpan, name: str, origin: str, by: str, reason: str) -> None:
        assert isinstance(span, _TurnSpan)
        attrs = {"tether.control.origin": origin, "tether.control.by": by}
        if reason:
            attrs["tether.control.reason"] = reason
        span.span.add_event(name, attributes=attrs)

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
        attrs: dict[str, Any] = {
            "tether.control.verb": verb,
            "tether.control.origin": origin,
            "tether.control.by": by,
            "tether.control.target": target,
        }
        if expected_turn is not None:
            attrs["tether.control.expected_turn"] = expected_turn
        links = []
        ctx = context_of(parent)
        if isinstance(turn, _TurnSpan):
            links.append(Link(turn.span.get_span_context()))
            if ctx is None:  # no caller's context: it shows inside the turn it acts on
                ctx = set_span_in_context(turn.span)
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
        return traceparent_of()

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
