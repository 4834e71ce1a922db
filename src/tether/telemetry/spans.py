"""The worker's spans (semantics §16.3): ``invoke_agent {name}`` per turn, with the ids the
host picked, and below it ``chat {model}`` per model request and ``execute_tool {tool}``
per tool call.

Off (the turn's ``RunTurn.trace`` is None), every call here returns a shared no-op and
nothing of ``opentelemetry`` is imported. On, ``_spans`` does the work: the worker's own
tracer provider, made on its first traced turn and flushed at each turn's end.

A stopped span reads as a stop: ERROR, with ``error.type`` ``preempted`` (the call got
``Preempted``), ``cancelled`` (the turn's cancel cut it) or ``budget`` (a stop of origin
``budget``), or ``failed`` for any other error, and the reason as the description.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Unpack

from tether.telemetry.hooks import TurnEnding
from tether.wire.frames import Cancel, RunTurn, SpanEvent

__all__ = [
    "Span",
    "annotate",
    "chat",
    "content",
    "event",
    "flush",
    "on",
    "open_chat",
    "said",
    "shutdown",
    "tool",
    "traceparent",
    "turn",
    "turn_ended",
]

_on = False
_content = False
# Set while an ``execute_tool`` span is current: the context's own bracket of a host
# call (``outer_only``) is then the same call, not another.
_in_tool: contextvars.ContextVar[bool] = contextvars.ContextVar("tether_in_tool", default=False)


class Span:
    """A span as a driver sees it; the no-op one when telemetry is off."""

    __slots__ = ()

    def set(self, key: str, value: Any) -> None:
        """An attribute (str, bool, int, float, or a list of one of them)."""

    def usage(self, input_tokens: int | None, output_tokens: int | None) -> None:
        """``gen_ai.usage.input_tokens`` / ``output_tokens``."""

    def finish(self, reasons: list[str]) -> None:
        """``gen_ai.response.finish_reasons``."""

    def content(self, key: str, value: Any) -> None:
        """A content attribute (prompts, replies, tool arguments and results), recorded
        only with ``telemetry={"content": True}``; ``value`` is JSON-encoded unless a str."""

    def fail(self, error_type: str, description: str) -> None:
        """A stop the span's code caught itself (a preempted result given to the model)."""

    def end(self, exc: BaseException | None = None) -> None:
        """End a span from ``open_chat`` (``exc``: what stopped it)."""


NOOP_SPAN = Span()


@contextlib.contextmanager
def _noop() -> Iterator[Span]:
    yield NOOP_SPAN


def on() -> bool:
    """Telemetry is on for the turn this worker runs."""
    return _on


def content() -> bool:
    """Content is recorded (``telemetry={"content": True}``)."""
    return _on and _content


@contextlib.contextmanager
def turn(run: RunTurn, stop: Callable[[], Cancel | None]) -> Iterator[None]:
    """The worker runs a turn: with ``run.trace``, it starts the turn's span with the ids
    the host picked, and the turn's other spans are its children; ``turn_ended`` ends it
    once the end is reported (then the worker flushes them). ``stop`` says the turn's
    cancel, if one reached it (a span it cut says so)."""
    global _on, _content
    trace = run.trace
    if trace is None:
        _on = False
        yield
        return
    from tether.telemetry import _spans

    token = _spans.begin(run, trace, stop)
    _on, _content = True, trace.content
    try:
        yield
    finally:
        _on = False
        _spans.end(token)


def turn_ended(**ending: Unpack[TurnEnding]) -> None:
    """End the turn's span with the outcome the worker saw (after it sent ``TurnEnd``:
    the span's work never delays the end). A no-op unless the turn was traced."""
    if _spans_loaded():
        from tether.telemetry import _spans

        _spans.turn_ended(**ending)


def said(text: str) -> None:
    """The turn's latest assistant text (content on): its span's reply, unless the
    driver returns one."""
    from tether.telemetry import _spans

    _spans.said(text)


def event(frame: SpanEvent) -> None:
    """An event the host sent for the turn's span (a pause, a resume): sent only with
    telemetry on, maybe before this worker's first traced turn began."""
    from tether.telemetry import _spans

    _spans.event(frame)


def flush() -> None:
    """Export what is buffered now (the turn ended; bounded, never a stop's path)."""
    if _spans_loaded():
        from tether.telemetry import _spans

        _spans.flush()


def shutdown() -> None:
    """Export what is left: the worker exits."""
    if _spans_loaded():
        from tether.telemetry import _spans

        _spans.shutdown()


def _spans_loaded() -> bool:
    import sys

    return "tether.telemetry._spans" in sys.modules


def chat(provider: str, model: str, **attrs: Any) -> contextlib.AbstractContextManager[Span]:
    """One model request's span, ``chat {model}``."""
    if not _on:
        return _noop()
    from tether.telemetry import _spans

    return _spans.chat(provider, model, attrs)


def open_chat(provider: str, model: str, **attrs: Any) -> Span:
    """A model request's span, ended by ``.end()``: for a request seen only as events
    (a framework's stream), where no block brackets it."""
    if not _on:
        return NOOP_SPAN
    from tether.telemetry import _spans

    return _spans.open_chat(provider, model, attrs)


def tool(
    name: str, *, call_id: str | None = None, outer_only: bool = False, **attrs: Any
) -> contextlib.AbstractContextManager[Span]:
    """One tool call's span, ``execute_tool {name}``; ``outer_only``: none if a tool call's
    span is current already (a model's call reaching the context's host call)."""
    if not _on or (outer_only and _in_tool.get()):
        return _noop()
    from tether.telemetry import _spans

    return _spans.tool(name, call_id, attrs, _in_tool)


def annotate(**attrs: Any) -> None:
    """Add attributes to the current span (an MCP call's ``mcp.*``)."""
    if _on:
        from tether.telemetry import _spans

        _spans.annotate(attrs)


def traceparent() -> str | None:
    """The current span's W3C traceparent (for a request's ``_meta``, a host call)."""
    if not _on:
        return None
    from tether.telemetry import _spans

    return _spans.traceparent()
