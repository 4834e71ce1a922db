"""A turn's span (``invoke_agent``), one home for both of its makers: the worker, which
starts and ends it, and the host, which makes it only when the worker could not end it
(an abort, a crash, a kill after grace). Both use the ids the host picked at dispatch
(``Trace.parent``), so it is one span either way. Imported only with telemetry on."""

from __future__ import annotations

import json
from typing import Any, Unpack

from opentelemetry.trace import SpanKind, Status, StatusCode

from tether.telemetry._provider import PresetIds
from tether.telemetry.hooks import TurnEnding, error_type
from tether.wire.frames import Trace

__all__ = ["KIND", "end_turn_span", "ids_of", "messages", "start_turn_span"]

_DESCRIPTION_CAP = 300
# OpenInference's names beside the GenAI ones: Phoenix draws a span's icon from its kind
# and lists a trace's input and output from ``input.value`` and ``output.value``.
KIND = "openinference.span.kind"


def ids_of(traceparent: str) -> tuple[int, int]:
    """The trace id and span id a W3C traceparent names (``00-<trace>-<span>-<flags>``)."""
    return int(traceparent[3:35], 16), int(traceparent[36:52], 16)


def messages(role: str, text: str) -> str:
    """A message as the GenAI conventions record content (``gen_ai.*.messages``)."""
    return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}])


def start_turn_span(
    tracer: Any,
    ids: PresetIds,
    trace: Trace,
    *,
    session: str,
    turn: str,
    message: str,
    events: list[tuple[str, dict[str, str], int]] | None = None,
) -> Any:
    """The turn's span, started at the host's ``trace.start`` with the host's ids."""
    from tether.telemetry._host import context_of

    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": trace.name,
        "gen_ai.agent.id": session,
        "gen_ai.conversation.id": trace.root,
        "tether.turn.id": turn,
        KIND: "AGENT",
    }
    if trace.content:
        attrs["gen_ai.input.messages"] = messages("user", message)
        attrs["input.value"] = message
    ids.preset(*ids_of(trace.parent))
    span = tracer.start_span(
        f"invoke_agent {trace.name}",
        context=context_of(trace.up),
        kind=SpanKind.INTERNAL,
        attributes=attrs,
        start_time=trace.start or None,
    )
    for name, event, at in events or ():
        span.add_event(name, attributes=event, timestamp=at)
    return span


def end_turn_span(
    span: Any, *, content: bool, end: int | None = None, **ending: Unpack[TurnEnding]
) -> None:
    """End it with the turn's outcome: ERROR with ``error.type`` unless ``completed``."""
    outcome, cause, by = ending["outcome"], ending["cause"], ending["by"]
    usage, final = ending["usage"], ending["final"]
    span.set_attribute("tether.outcome", outcome)
    if cause is not None:
        span.set_attribute("tether.cause", cause)
    if by is not None:
        span.set_attribute("tether.by", by)
    if usage:
        if "prompt_tokens" in usage:
            span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
        if "completion_tokens" in usage:
            span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
    if content and final:
        span.set_attribute("gen_ai.output.messages", messages("assistant", final))
        span.set_attribute("output.value", final)
    if outcome != "completed":
        span.set_attribute("error.type", error_type(outcome, ending["origin"]))
        why = ending["reason"] or ending["error"] or outcome
        span.set_status(Status(StatusCode.ERROR, why[:_DESCRIPTION_CAP]))
    span.end(end_time=end)
