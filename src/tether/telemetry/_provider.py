"""The SDK's tracer provider for one process: OTLP exporter, span processor, resource.

The host makes one per runtime (the SDK's batch processor: its spans are few, control
actions and killed turns); a worker makes its own on its first traced turn, after it
started (never one inherited through a fork: the launcher that forks workers never
turns telemetry on), with ``Exports`` as its processor. The protocol is HTTP/protobuf
unless ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or ``..._TRACES_PROTOCOL``) says ``grpc``, which
needs the SDK's gRPC exporter.
"""

from __future__ import annotations

import os
import random
import threading
from collections import deque
from typing import Any

import structlog
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator

from tether.telemetry.settings import Settings
from tether.wire.errors import InvalidParams

__all__ = ["SCOPE", "Exports", "PresetIds", "make_provider", "make_worker_provider"]

SCOPE = "tether"  # the instrumentation scope of every span Tether makes
_TRACES = "/v1/traces"
# Exports after a requested one wait this long, so the ends of quick turns share one
# request (a lone turn's spans still go at once).
_FLUSH_GAP = 0.1
_CLOSE_WAIT = 2.0  # seconds a worker's provider shutdown waits for its last export
log = structlog.get_logger("tether.telemetry")


def make_provider(settings: Settings, role: str) -> Any:
    """The host's ``TracerProvider``, exporting in batches (the SDK's batch processor);
    ``role`` is the resource's ``tether.process``."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = _bare_provider(settings, role)
    provider.add_span_processor(BatchSpanProcessor(_exporter(settings)))
    return provider


def make_worker_provider(settings: Settings) -> tuple[Any, Exports]:
    """A worker's ``TracerProvider`` and its processor, which exports when asked."""
    provider = _bare_provider(settings, "worker")
    exports = Exports(_exporter(settings))
    provider.add_span_processor(exports)
    return provider, exports


def _bare_provider(settings: Settings, role: str) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    attrs: dict[str, Any] = {"tether.process": role, "process.pid": os.getpid()}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attrs[SERVICE_NAME] = settings.service
    return TracerProvider(resource=Resource.create(attrs), id_generator=PresetIds())


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


class Exports(SpanProcessor):
    """A worker's span processor: ended spans wait in memory, and one thread exports
    them when asked (a turn's end), when ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` wait, or
    ``OTEL_BSP_SCHEDULE_DELAY`` after the oldest unexported one ended; each export takes
    what was queued as it began, in requests of at most the batch size, and the next
    requested one comes ``_FLUSH_GAP`` later at the soonest. (The SDK's batch processor
    exports, when flushed, until its queue is empty: under a stream of quick turns, whose
    every end asks for a flush, that is one request of a few spans after another, about
    half a millisecond of the worker's CPU per turn on this machine.) Past
    ``OTEL_BSP_MAX_QUEUE_SIZE`` waiting spans, new ones are dropped. Nothing here is on
    a turn's or a stop's path: a requester waits a bounded time, if at all, and a killed
    worker loses only what was still queued."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter
        self._delay = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000.0
        self._batch = _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
        self._cap = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self._queue: deque[ReadableSpan] = deque()
        self._cond = threading.Condition()
        self._asked = 0  # export requests so far
        self._done = 0  # requests that a finished export covers
        self._closed = False
        # the gap after an export waits on this, not on the condition: the asks made in
        # the gap (a turn's end each) must not wake the thread, one switch per turn
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tether-otel-export", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        with self._cond:
            if self._closed or len(self._queue) >= self._cap:
                return
            self._queue.append(span)
            if len(self._queue) == 1 or len(self._queue) == self._batch:
                self._cond.notify_all()  # the first starts the schedule's clock

    def flush(self, wait: float) -> bool:
        """Ask for an export of what is queued; wait up to ``wait`` seconds for it."""
        with self._cond:
            self._asked += 1
            mine = self._asked
            self._cond.notify_all()
            if wait <= 0:
                return False
            return self._cond.wait_for(lambda: self._done >= mine, wait)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.flush(timeout_millis / 1000.0)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._asked += 1
            self._cond.notify_all()
        self._closing.set()
        self._thread.join(_CLOSE_WAIT)

    def _due(self) -> bool:
        return self._closed or self._asked > self._done or len(self._queue) >= self._batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._due():
                    if not self._queue:
                        self._cond.wait()
                    elif not self._cond.wait(self._delay) and self._queue:
                        break  # the oldest waited out the schedule's delay
                upto, closed = self._asked, self._closed
                spans = list(self._queue)
                self._queue.clear()
            for at in range(0, len(spans), self._batch):
                try:
                    self._exporter.export(spans[at : at + self._batch])
                except Exception:  # an exporter's bug must not end the worker's exports
                    log.exception("telemetry.export_failed")
            with self._cond:
                self._done = max(self._done, upto)
                self._cond.notify_all()
            if closed:
                break
            self._closing.wait(_FLUSH_GAP)
        self._exporter.shutdown()


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
