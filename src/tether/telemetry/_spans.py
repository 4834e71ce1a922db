"""The worker's spans over the SDK (see ``spans``). Imported only with telemetry on."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tether.telemetry._host import context_of, traceparent_of
from tether.telemetry._provider import SCOPE, make_provider
from tether.telemetry.hooks import error_type
from tether.telemetry.settings import Settings
from tether.telemetry.spans import Span
from tether.wire.errors import Preempted, TetherError
from tether.wire.frames import Cancel, Trace

__all__ = ["annotate", "begin", "chat", "end", "flush", "shutdown", "tool", "traceparent"]

# The SDK's force_flush blocks for the whole export, retries included (seconds, with a
# receiver that is down), whatever timeout it is given: it runs on a thread of its own,
# and a turn's end waits for it this long at most, the worker's exit a little longer.
_FLUSH_WAIT = 0.25
_EXIT_WAIT = 2.0
_DESCRIPTION_CAP = 300

_provider: Any = None
_key: tuple[str | None, bool] | None = None
_tracer: Any = None
_content = False


def _no_stop() -> Cancel | None:
    return None


_stop: Callable[[], Cancel | None] = _no_stop
_turn: otel_context.Context | None = None  # the turn span's context, for other threads


def _setup(trace: Trace) -> None:
    """This worker's provider, made on its first traced turn (never inherited)."""
    global _provider, _key, _tracer
    key = (trace.endpoint, trace.content)
    if _provider is not None and _key == key:
        return
    if _provider is not None:  # another runtime's settings: a fresh exporter
        _provider.shutdown()
    _provider = make_provider(Settings(endpoint=trace.endpoint, content=trace.content), "worker")
    _key = key
    _tracer = _provider.get_tracer(SCOPE)


def begin(trace: Trace, stop: Callable[[], Cancel | None]) -> object:
    global _content, _stop, _turn
    _setup(trace)
    _content, _stop = trace.content, stop
    _turn = context_of(trace.parent)
    assert _turn is not None
    return otel_context.attach(_turn)


def end(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]


class _Flusher:
    """One thread that exports on request; the requester waits a bounded time."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tether-otel-flush", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.asked.wait()
            self.asked.clear()
            provider = _provider
            if provider is not None:
                provider.force_flush()
            self.done.set()

    def flush(self, wait: float) -> None:
        self.done.clear()
        self.asked.set()
        self.done.wait(wait)


_flusher: _Flusher | None = None


def flush(wait: float = _FLUSH_WAIT) -> None:
    global _flusher
    if _provider is None:
        return
    if _flusher is None:
        _flusher = _Flusher()
    _flusher.flush(wait)


def shutdown() -> None:
    # Every turn's spans were flushed at its end: what is left is at most the last
    # export still in flight. The SDK's own threads are daemons: they go with us.
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
    """A span that an exception ended: a stop reads as a stop (SPEC §16.3)."""
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
