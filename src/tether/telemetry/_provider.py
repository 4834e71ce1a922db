"""The SDK's tracer provider for one process: OTLP exporter, batch processor, resource.

The host makes one per runtime; a worker makes its own on its first traced turn, after
it started (never one inherited through a fork: the launcher that forks workers never
turns telemetry on). The protocol is HTTP/protobuf unless ``OTEL_EXPORTER_OTLP_PROTOCOL``
(or ``..._TRACES_PROTOCOL``) says ``grpc``, which needs the SDK's gRPC exporter.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any

from opentelemetry.sdk.trace.id_generator import IdGenerator

from tether.telemetry.settings import Settings
from tether.wire.errors import InvalidParams

__all__ = ["SCOPE", "PresetIds", "make_provider"]

SCOPE = "tether"  # the instrumentation scope of every span Tether makes
_TRACES = "/v1/traces"


def make_provider(settings: Settings, role: str) -> Any:
    """A ``TracerProvider`` exporting in batches; ``role`` (``host``, ``worker``) is the
    resource's ``tether.process``."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs: dict[str, Any] = {"tether.process": role, "process.pid": os.getpid()}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attrs[SERVICE_NAME] = settings.service
    provider = TracerProvider(resource=Resource.create(attrs), id_generator=PresetIds())
    provider.add_span_processor(BatchSpanProcessor(_exporter(settings)))
    return provider


class PresetIds(IdGenerator):
    """The SDK's id generator: random ids
    except for the one span ``preset`` names next on this thread: a turn's span, whose
    ids the host picked at dispatch, so the worker's span and the host's (when the
    worker could not end it) are the same span, and its children's parent id is right."""

    def __init__(self) -> None:
        self._next = threading.local()

    def preset(self, trace_id: int, span_id: int) -> None:
        self._next.ids = (trace_id, span_id)

    def generate_trace_id(self) -> int:  # asked first, and only for a trace's root
        ids: tuple[int, int] | None = getattr(self._next, "ids", None)
        return ids[0] if ids is not None else random.getrandbits(128) or 1

    def generate_span_id(self) -> int:
        ids: tuple[int, int] | None = getattr(self._next, "ids", None)
        if ids is None:
            return random.getrandbits(64) or 1
        self._next.ids = None
        return ids[1]

    def is_trace_id_random(self) -> bool:
        return True


def _exporter(settings: Settings) -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    endpoint = settings.endpoint
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise InvalidParams(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc"
            ) from None
        return GrpcExporter(endpoint=endpoint) if endpoint else GrpcExporter()
    if protocol != "http/protobuf":
        raise InvalidParams(f"OTLP protocol {protocol!r}: tether exports http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if endpoint is None:
        return OTLPSpanExporter()  # the OTEL_* variables, or http://localhost:4318
    # A base URL, as OTEL_EXPORTER_OTLP_ENDPOINT is: the signal's path is added.
    url = endpoint.rstrip("/")
    return OTLPSpanExporter(endpoint=url if url.endswith(_TRACES) else url + _TRACES)
