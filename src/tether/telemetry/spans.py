"""The worker's spans (SPEC §16.3): ``chat {model}`` per model request and
``execute_tool {tool}`` per tool call, children of the turn's span.

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
from typing import Any

from tether.wire.frames import Cancel, Trace

__all__ = [
    "Span",
    "annotate",
    "chat",
    "content",
    "flush",
    "on",
    "open_chat",
    "shutdown",
    "tool",
    "traceparent",
    "turn",
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
def turn(trace: Trace | None, stop: Callable[[], Cancel | None]) -> Iterator[None]:
    """The worker runs a turn: with ``trace``, its spans are children of the host's turn
    span (the worker flushes them once it has reported the turn's end). ``stop`` says
    the turn's cancel, if one reached it (a span it cut says so)."""
    global _on, _content
    if trace is None:
        _on = False
        yield
        return
    from tether.telemetry import _spans

    token = _spans.begin(trace, stop)
    _on, _content = True, trace.content
    try:
        yield
    finally:
        _on = False
        _spans.end(token)


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
