"""OpenTelemetry traces (semantics §16.3), extra ``tether-runtime[otel]``: a room of its own.

The engine calls the thin hooks here; with telemetry off they are no-ops and nothing of
``opentelemetry`` is imported, no exporter thread runs, nothing is exported. With it on
(``Runtime(telemetry=True | {...})`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), the SDK is
imported lazily by the modules that need it:

    settings    what turns telemetry on, and how the spans are exported
    hooks       the host's hooks (no-ops when off): turn spans, control spans
    _provider   the SDK's tracer provider, OTLP exporter and span processor, per process
    _host       the host's hooks over the SDK: ``tether.control``, a killed turn's span
    _turn       the turn's span (``invoke_agent``), as either of its makers makes it
    spans       the worker's spans: ``invoke_agent``, ``chat`` and ``execute_tool``

Who makes which span: the worker makes the turn's span (``invoke_agent``) and the spans
of what only it sees, model requests and tool calls, below it, and exports them itself;
the host only picks the turn span's ids at dispatch (they ride in ``RunTurn.trace``), so
a turn costs the host no SDK work. When the worker cannot end the span (an abort, a
crash, a kill after grace), the host makes it, with the same ids, once the tree is dead.
Pauses and resumes reach the worker's span as events in ``SpanEvent`` frames. The
control spans (``tether.control``) are the host's: it decides whether a stop landed.
"""

from tether.telemetry.hooks import NOOP, ControlSpan, Telemetry, TurnSpan, error_type
from tether.telemetry.settings import Settings, resolve

__all__ = [
    "NOOP",
    "WORKER_MODULES",
    "ControlSpan",
    "Settings",
    "Telemetry",
    "TurnSpan",
    "error_type",
    "make",
    "resolve",
]


# What a traced worker imports to make and export its spans (its HTTP client included,
# which the exporter loads only when made). A runtime with telemetry on has its workers'
# launcher import them before it forks: each worker shares them, rather than loading its
# own copy on its first traced turn (~0.4 s), and a killed worker has less of its own
# memory to free before it is dead (a traced worker's SIGKILL-to-reaped p50 6.6 ms with
# its own copy, 3.6 ms shared, 1.7 ms untraced, under load 8).
WORKER_MODULES = (
    "tether.telemetry._spans",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "requests",
    "opentelemetry.exporter.http.transport._requests",
)


def make(settings: Settings | None) -> Telemetry:
    """The host's hooks: the no-op ones when ``settings`` is None (telemetry off)."""
    if settings is None:
        return NOOP
    from tether.telemetry._host import OtelTelemetry

    return OtelTelemetry(settings)
