"""A real OTLP/HTTP trace receiver on loopback, for the telemetry tests (semantics §16.3).

It takes ``POST /v1/traces`` as the SDK's exporter sends it (protobuf, gzip or not),
decodes each ``ExportTraceServiceRequest`` with the official protobuf definitions
(``opentelemetry-proto``) and keeps every span, with its resource, as a plain ``Span``.
Waits are on a condition the handler notifies, each with a deadline.
"""

from __future__ import annotations

import gzip
import http.server
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if kind is None else getattr(v, kind)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str  # "" for a trace's root
    attrs: dict[str, Any]
    status: int
    description: str
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    resource: dict[str, Any]
    start: int
    end: int

    @property
    def error(self) -> bool:
        return self.status == STATUS_ERROR


@dataclass
class Receiver:
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)
    url: str = ""

    def take(self, body: bytes) -> None:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        got: list[Span] = []
        for rs in req.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            attrs={kv.key: _value(kv.value) for kv in s.attributes},
                            status=s.status.code,
                            description=s.status.message,
                            events=[
                                (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in s.events
                            ],
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                            resource=resource,
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                        )
                    )
        with self.cond:
            self.requests += 1
            self.spans.extend(got)
            self.cond.notify_all()

    def wait(
        self, pred: Callable[[list[Span]], Any], *, timeout: float = 20.0, what: str = "spans"
    ) -> Any:
        """Wait until ``pred(spans)`` is truthy; its value. AssertionError at the deadline,
        with the span names seen."""
        with self.cond:
            found = self.cond.wait_for(lambda: pred(list(self.spans)), timeout)
            if not found:
                names = sorted({s.name for s in self.spans})
                raise AssertionError(f"no {what} within {timeout} s; spans seen: {names}")
            return found

    def named(self, prefix: str) -> list[Span]:
        with self.cond:
            return [s for s in self.spans if s.name.startswith(prefix)]

    def by_id(self) -> dict[str, Span]:
        with self.cond:
            return {s.span_id: s for s in self.spans}

    def turn(self, turn: str) -> Span:
        """The ``invoke_agent`` span of ``turn``, once it arrives."""
        found: Span = self.wait(
            lambda spans: next(
                (
                    s
                    for s in spans
                    if s.name.startswith("invoke_agent") and s.attrs.get("tether.turn.id") == turn
                ),
                None,
            ),
            what=f"the span of turn {turn}",
        )
        return found

    def chats_under(self, turn: str, model: str, count: int) -> tuple[Span, list[Span]]:
        """The span of ``turn`` and its ``count`` (at least) ``chat {model}`` children, once
        they arrive: each with the request's model and its usage (an adapter's spans)."""
        top = self.turn(turn)
        name = f"chat {model}"
        chats: list[Span] = self.wait(
            lambda spans: (
                found
                if len(found := [s for s in spans if s.name == name and s.parent == top.span_id])
                >= count
                else None
            ),
            what=f"{count} {name} spans under turn {turn}",
        )
        for chat in chats:
            assert chat.trace_id == top.trace_id
            assert chat.attrs["gen_ai.operation.name"] == "chat"
            assert chat.attrs["gen_ai.request.model"] == model
            assert chat.attrs["gen_ai.usage.input_tokens"] > 0
            assert chat.attrs["gen_ai.usage.output_tokens"] > 0
            assert chat.resource["tether.process"] == "worker"
        return top, chats

    def ancestors(self, span: Span) -> list[Span]:
        """``span``'s parent, its parent's, … as far as they were received."""
        ids = self.by_id()
        out: list[Span] = []
        cur = ids.get(span.parent)
        while cur is not None:
            out.append(cur)
            cur = ids.get(cur.parent)
        return out


class _Handler(http.server.BaseHTTPRequestHandler):
    receiver: Receiver

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n)
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        if self.path != "/v1/traces":
            self.send_response(404)
            self.end_headers()
            return
        self.receiver.take(body)
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` a receiver on a free loopback port; ``r.url`` is
    the base URL (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``telemetry={"endpoint": …}``)."""

    def __enter__(self) -> Receiver:
        receiver = Receiver()
        handler = type("Handler", (_Handler,), {"receiver": receiver})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        port = self._server.server_address[1]
        receiver.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return receiver

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
