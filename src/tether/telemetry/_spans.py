"""The worker's spans over the SDK (see ``spans``). Imported only with telemetry on."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Unpack

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tether.telemetry._host import traceparent_of
from tether.telemetry._provider import SCOPE, Exports, make_worker_provider
from tether.telemetry._turn import KIND, end_turn_span, start_turn_span
from tether.telemetry.hooks import TurnEnding, error_type
from tether.telemetry.settings import Settings
from tether.telemetry.spans import Span
from tether.wire.errors import Preempted, TetherError
from tether.wire.frames import Cancel, RunTurn, SpanEvent, Trace

__all__ = [
    "annotate",
    "begin",
    "chat",
    "end",
    "event",
    "flush",
    "said",
    "shutdown",
    "tool",
    "traceparent",
    "turn_ended",
]

# A turn's end only asks for an export, never waits (``_provider.Exports``: requests
# share one export within its gap); the worker's exit waits this long at most.
_FLUSH_WAIT = 0.0
_EXIT_WAIT = 2.0
_DESCRIPTION_CAP = 300

_provider: Any = None
_exports: Exports | None = None
_key: tuple[str | None, bool] | None = None
_tracer: Any = None
_ids: Any = None
_content = False


def _no_stop() -> Cancel | None:
    return None


_stop: Callable[[], Cancel | None] = _no_stop
_turn: otel_context.Context | None = None  # the turn span's context, for other threads
# The turn's span (``invoke_agent``), which this worker makes with the host's ids; its
# turn id, and when the driver returned (the span ends there, once the end is sent).
_turn_span: Any = None
_turn_id: str | None = None
_returned: int | None = None
_said: str | None = None  # the turn's latest assistant text (content on)
# Events the reader thread got before the main thread started their turn's span (a
# pause before the worker took the turn: its frame follows RunTurn).
_early: list[SpanEvent] = []
_events_lock = threading.Lock()


def _setup(trace: Trace) -> None:
    """This worker's provider, made on its first traced turn (never inherited)."""
    global _provider, _exports, _key, _tracer, _ids
    key = (trace.endpoint, trace.content)
    if _provider is not None and _key == key:
        return
    if _provider is not None:  # another runtime's settings: a fresh exporter
        _provider.shutdown()
    settings = Settings(endpoint=trace.endpoint, content=trace.content)
    _provider, _exports = make_worker_provider(settings)
    _key = key
    _tracer = _provider.get_tracer(SCOPE)
    _ids = _provider.id_generator


def begin(run: RunTurn, trace: Trace, stop: Callable[[], Cancel | None]) -> object:
    global _content, _stop, _turn, _turn_span, _turn_id, _returned, _said
    _setup(trace)
    _content, _stop = trace.content, stop
    span = start_turn_span(
        _tracer, _ids, trace, session=run.session, turn=run.turn, message=run.message.content
    )
    with _events_lock:
        _turn_span, _turn_id, _returned, _said = span, run.turn, None, None
        early = [e for e in _early if e.turn == run.turn]
        _early.clear()
    for e in early:
        span.add_event(e.name, attributes=e.attrs, timestamp=e.time)
    _turn = otel_trace.set_span_in_context(span)
    return otel_context.attach(_turn)


def end(token: object) -> None:
    global _returned
    _returned = time.time_ns()
    otel_context.detach(token)  # type: ignore[arg-type]


def turn_ended(**ending: Unpack[TurnEnding]) -> None:
    global _turn_span, _turn_id
    with _events_lock:
        span, _turn_span, _turn_id = _turn_span, None, None
    if span is None:
        return
    if ending["final"] is None:
        ending["final"] = _said
    end_turn_span(span, content=_content, end=_returned, **ending)


def said(text: str) -> None:
    global _said
    _said = text


def event(frame: SpanEvent) -> None:
    # The reader thread: the span may not have started yet, or have ended just now (a
    # pause as the turn ended: that one is lost).
    with _events_lock:
        span = _turn_span if _turn_id == frame.turn else None
        if span is None:
            _early.append(frame)
            return
    span.add_event(frame.name, attributes=frame.attrs, timestamp=frame.time)


def flush(wait: float = _FLUSH_WAIT) -> None:
    if _exports is not None:
        _exports.flush(wait)


def shutdown() -> None:
    # Every turn's end asked for an export: what is left is at most the last one's
    # spans, still waiting out the gap or in flight. The export thread is a daemon.
    flush(_EXIT_WAIT)


class _Span(Span):
    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def set(self, key: str, value: Any) -> None:
        if value is not None:
            self._span.set_attribute(key, value)

    def usage(self, input_tokens: int | None, output_tokens: int | None) -> None:
        self.set("gen_ai.usage.input_tokens", input_tokens)
        self.set("gen_ai.usage.output_tokens", output_tokens)

    def finish(self, reasons: list[str]) -> None:
        if reasons:
            self._span.set_attribute("gen_ai.response.finish_reasons", list(reasons))

    def content(self, key: str, value: Any) -> None:
        if _content and value is not None:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            self._span.set_attribute(key, text)

    def fail(self, error_type: str, description: str) -> None:
        self._span.set_attribute("error.type", error_type)
        self._span.set_status(Status(StatusCode.ERROR, description[:_DESCRIPTION_CAP]))

    def end(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            _stopped(self._span, exc)
        self._span.end()


def _stopped(span: Any, exc: BaseException) -> None:
    """A span that an exception ended: a stop reads as a stop (semantics §16.3)."""
    kind: str
    why: str
    if isinstance(exc, Preempted):
        kind, why = error_type("preempt", exc.origin), exc.reason or exc.message
    elif isinstance(exc, asyncio.CancelledError):
        stop = _stop()
        if stop is None:
            kind, why = "cancelled", "cancelled"
        else:
            kind, why = error_type("cancel", stop.origin), stop.reason or "cancelled"
    elif isinstance(exc, TetherError):
        kind, why = "failed", exc.message
    elif isinstance(exc, Exception):
        kind, why = "failed", f"{type(exc).__name__}: {exc}"
    else:
        return  # the worker is going (SystemExit, a generator closed): no verdict
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, why[:_DESCRIPTION_CAP]))


def _here() -> otel_context.Context | None:
    # A driver's own thread has no context of its turn: its calls still join the turn.
    return None if otel_trace.get_current_span().get_span_context().is_valid else _turn


@contextlib.contextmanager
def _run(name: str, kind: SpanKind, attrs: dict[str, Any]) -> Iterator[Any]:
    clean = {k: v for k, v in attrs.items() if v is not None}
    here = _here()
    with _tracer.start_as_current_span(
        name,
        context=here,
        kind=kind,
        attributes=clean,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _stopped(span, exc)
            raise


def open_chat(provider: str, model: str, attrs: dict[str, Any]) -> Span:
    # Never the current span (nothing is below a model request): it may end in another
    # context than it began in (a framework's async generator).
    base = {
        KIND: "LLM",
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": model,
        **{k: v for k, v in attrs.items() if v is not None},
    }
    span = _tracer.start_span(
        f"chat {model}", context=_here(), kind=SpanKind.CLIENT, attributes=base
    )
    return _Span(span)


@contextlib.contextmanager
def chat(provider: str, model: str, attrs: dict[str, Any]) -> Iterator[Span]:
    span = open_chat(provider, model, attrs)
    try:
        yield span
    except BaseException as exc:
        span.end(exc)
        raise
    span.end()


@contextlib.contextmanager
def tool(
    name: str,
    call_id: str | None,
    attrs: dict[str, Any],
    flag: contextvars.ContextVar[bool],
) -> Iterator[Span]:
    base = {
        KIND: "TOOL",
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
        **attrs,
    }
    token = flag.set(True)
    try:
        with _run(f"execute_tool {name}", SpanKind.INTERNAL, base) as span:
            yield _Span(span)
    finally:
        flag.reset(token)


def annotate(attrs: dict[str, Any]) -> None:
    span = otel_trace.get_current_span()
    for key, value in attrs.items():
        if value is not None:
            span.set_attribute(key, value)


def traceparent() -> str | None:
    return traceparent_of()
