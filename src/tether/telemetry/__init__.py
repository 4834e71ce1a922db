"""OpenTelemetry traces (SPEC §16.3), extra ``tether[otel]``: a room of its own.

The engine calls the thin hooks here; with telemetry off they are no-ops and nothing of
``opentelemetry`` is imported, no exporter thread runs, nothing is exported. With it on
(``Runtime(telemetry=True | {...})`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), the SDK is
imported lazily by the modules that need it:

    settings    what turns telemetry on, and how the spans are exported
    hooks       the host's hooks (no-ops when off): turn spans, control spans
    _provider   the SDK's tracer provider, OTLP exporter and batch processor, per process
    _host       the host's hooks over the SDK: ``invoke_agent``, ``tether.control``
    spans       the worker's spans: ``chat`` and ``execute_tool``, under its turn span

Who makes which span: the host makes the turn span (``invoke_agent``), since it knows the
outcome, the stop and its cause, pauses and resumes, even when the worker was killed; the
control spans (``tether.control``) too, since it decides whether a stop landed. A worker
makes the spans of what only it sees, model requests and tool calls, as children of the
turn span whose traceparent rides in ``RunTurn``; it exports them itself.
"""

from tether.telemetry.hooks import NOOP, ControlSpan, Telemetry, TurnSpan, error_type
from tether.telemetry.settings import Settings, resolve

__all__ = [
    "NOOP",
    "ControlSpan",
    "Settings",
    "Telemetry",
    "TurnSpan",
    "error_type",
    "make",
    "resolve",
]


def make(settings: Settings | None) -> Telemetry:
    """The host's hooks: the no-op ones when ``settings`` is None (telemetry off)."""
    if settings is None:
        return NOOP
    from tether.telemetry._host import OtelTelemetry

    return OtelTelemetry(settings)
