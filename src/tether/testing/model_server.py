"""A model server that replays a script, on two wires (OpenAI chat completions and Anthropic
Messages), for tests, demos and benchmarks: real HTTP on loopback, no key, no network, and
a record of every request and disconnect. The script's format, the HTTP controls and the
command line: docs/model-server.md.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REPLY_KEYS", "Disconnect", "ModelServer", "Request", "main"]

# Every key a script's reply may hold, and what it does: `--help` lists them, and so does
# docs/model-server.md (a test holds both to the keys the handlers read).
REPLY_KEYS: dict[str, str] = {
    "text": "the reply's text (streamed in chunks when the request asks for a stream)",
    "tool_calls": 'tool calls: [{"name": ..., "arguments": {...} or "<json>", "id": ...}]',
    "chunk": "characters per streamed chunk (default 8)",
    "pace": "seconds between streamed chunks (default 0)",
    "delay": "seconds to wait before answering (default 0)",
    "hang": "true: send what there is, then never end (until the client goes away)",
    "status": "answer with this HTTP error instead (429, 500, ...; default 200)",
    "message": "the error's message (default: the status's reason)",
    "count": "how many requests this reply answers before the next one (default 1)",
    "usage": "the token usage to report (either wire's names); default counted, null: none",
}

_DEFAULT = "default"
_POLL = 0.005  # how often a hung or paced response looks for the client's going away


@dataclass
class Request:
    """One chat-completions request as the server saw it."""

    id: str
    time: float  # time.time() when it arrived
    body: dict[str, Any]
    script: str
    authorization: str | None = None
    api_key: str | None = None  # the ``x-api-key`` header (the Anthropic wire's key)
    wire: str = "openai"  # openai | anthropic
    status: int = 200
    ended: float | None = None  # when the response ended (written, or the client left)
    outcome: str = "open"  # open | done | error | disconnected
    hanging: bool = False  # a ``hang`` reply sent all it will and now waits
    served_s: float = 0.0  # the server's own time on it: arrival to last byte written

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Disconnect:
    """A client that went away before its response ended."""

    request: str
    time: float


@dataclass
class _Script:
    replies: list[dict[str, Any]]
    position: int = 0
    repeats: int = 0  # how often the current error reply was used


@dataclass
class _Log:
    lock: threading.Condition = field(default_factory=threading.Condition)
    requests: list[Request] = field(default_factory=list)
    disconnects: list[Disconnect] = field(default_factory=list)
    scripts: dict[str, _Script] = field(default_factory=dict)
    seq: int = 0


class _Gone(Exception):
    """The client closed the connection."""


class ModelServer:
    """The server on a free loopback port, a context manager: in a thread of this process,
    or (``process=True``) in a process of its own, queried over HTTP.

    A process of its own sees a client's disconnect without waiting for this process's
    GIL: use it when a test compares the disconnect's time with other events recorded
    in this process (a busy host would otherwise delay the server's noticing). With
    ``realtime=True`` that process also asks for a real-time scheduling class (where it
    may: as root), so that on a loaded machine it runs the moment a client's FIN
    arrives; it only ever waits in ``select``, so it takes no CPU from anyone.
    """

    def __init__(
        self,
        replies: list[dict[str, Any]] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        process: bool = False,
        realtime: bool = False,
    ) -> None:
        self._log = _Log()
        self._stopping = threading.Event()
        self._host, self._port = host, port
        self._realtime = realtime
        self._httpd: _Server | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._remote: str | None = None  # the process's base URL
        self._thread: threading.Thread | None = None
        if replies is not None:
            self.script(_DEFAULT, replies)
        if not process:
            handler = _handler_class(self._log, self._stopping)
            self._httpd = _Server((host, port), handler)

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The ``base_url`` for an OpenAI client: ``http://127.0.0.1:<port>/v1``."""
        if self._httpd is None:
            if self._remote is None:
                raise RuntimeError("the model server process is not started")
            return self._remote
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    @property
    def root(self) -> str:
        """The server's root URL: the ``base_url`` for an Anthropic client."""
        return self.url.removesuffix("/v1")

    def start(self) -> ModelServer:
        if self._httpd is None:
            if self._proc is None:
                self._spawn()
        elif self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.05},
                name="model-server",
                daemon=True,
            )
            self._thread.start()
        return self

    def _spawn(self) -> None:
        argv = [sys.executable, "-m", "tether.testing.model_server"]
        argv += ["--host", self._host, "--port", str(self._port), "--empty"]
        if self._realtime:
            argv.append("--realtime")
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line.startswith("http://"):
            self.close()
            raise RuntimeError(f"the model server process did not start: {line!r}")
        self._remote = line
        with self._log.lock:
            scripts = {n: s.replies for n, s in self._log.scripts.items()}
        for name, replies in scripts.items():
            self._post("/_tether/script", {"name": name, "replies": replies})

    def close(self) -> None:
        self._stopping.set()  # hung responses end
        if self._thread is not None and self._httpd is not None:
            self._httpd.shutdown()
            self._thread.join(5.0)
            self._thread = None
        if self._httpd is not None:
            self._httpd.server_close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the process's HTTP face --------------------------------------------------------

    def _post(self, path: str, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        request = urllib.request.Request(
            self.root + path, data, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def _fetch(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.root + "/_tether/log", timeout=10) as response:
            log: dict[str, Any] = json.load(response)
        return log

    # ---- scripts and records ------------------------------------------------------------

    def script(self, name: str, replies: list[dict[str, Any]]) -> None:
        """Set the script ``name`` (``"default"``: for requests that name none)."""
        if not replies:
            raise ValueError("a script needs at least one reply")
        with self._log.lock:
            self._log.scripts[name] = _Script([dict(r) for r in replies])
        if self._remote is not None:
            self._post("/_tether/script", {"name": name, "replies": replies})

    @property
    def requests(self) -> list[Request]:
        if self._httpd is None:
            return [_request_of(r) for r in self._fetch()["requests"]]
        with self._log.lock:
            return list(self._log.requests)

    @property
    def disconnects(self) -> list[Disconnect]:
        if self._httpd is None:
            return [Disconnect(d["request"], d["time"]) for d in self._fetch()["disconnects"]]
        with self._log.lock:
            return list(self._log.disconnects)

    def requests_for(self, script: str) -> list[Request]:
        return [r for r in self.requests if r.script == script]

    def wait_for(
        self, predicate: Callable[[ModelServer], Any], *, timeout: float = 5.0, what: str = ""
    ) -> Any:
        """Wait until ``predicate(self)`` is truthy (woken by every request and response
        end; polled every few ms for a server process); its value. ``TimeoutError``
        after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._log.lock:
            while True:
                value = predicate(self)
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"model server: timed out waiting for {what or predicate}")
                self._log.lock.wait(left if self._httpd is not None else min(left, 0.003))

    def wait_requests(
        self, count: int, *, script: str | None = None, timeout: float = 5.0
    ) -> list[Request]:
        """The first ``count`` requests (of ``script``), once they arrived."""

        def enough(s: ModelServer) -> list[Request] | None:
            found = s.requests if script is None else s.requests_for(script)
            return found[:count] if len(found) >= count else None

        result: list[Request] = self.wait_for(enough, timeout=timeout, what=f"{count} requests")
        return result

    def wait_disconnect(self, request: str | None = None, *, timeout: float = 5.0) -> Disconnect:
        """The disconnect of ``request`` (or the first one), once it was seen."""

        def seen(s: ModelServer) -> Disconnect | None:
            return next((d for d in s.disconnects if request is None or d.request == request), None)

        result: Disconnect = self.wait_for(seen, timeout=timeout, what="a disconnect")
        return result

    def log(self) -> dict[str, Any]:
        """Everything recorded, JSON-ready (what ``GET /_tether/log`` returns)."""
        return self._fetch() if self._httpd is None else _log_json(self._log)


def _request_of(raw: dict[str, Any]) -> Request:
    return Request(
        id=raw["id"],
        time=raw["time"],
        body=raw["body"],
        script=raw["script"],
        authorization=raw.get("authorization"),
        api_key=raw.get("api_key"),
        wire=raw.get("wire", "openai"),
        status=raw["status"],
        ended=raw["ended"],
        outcome=raw["outcome"],
        served_s=raw["served_s"],
        hanging=raw["hanging"],
    )


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _log_json(log: _Log) -> dict[str, Any]:
    with log.lock:
        return {
            "requests": [
                {
                    "id": r.id,
                    "time": r.time,
                    "script": r.script,
                    "status": r.status,
                    "stream": r.stream,
                    "outcome": r.outcome,
                    "ended": r.ended,
                    "served_s": r.served_s,
                    "hanging": r.hanging,
                    "authorization": r.authorization,
                    "api_key": r.api_key,
                    "wire": r.wire,
                    "body": r.body,
                }
                for r in log.requests
            ],
            "disconnects": [{"request": d.request, "time": d.time} for d in log.disconnects],
        }


def _next_reply(log: _Log, name: str) -> dict[str, Any]:
    """The script's next reply (under the log's lock); an error reply with ``count`` is
    used that many times before the script moves on."""
    script = log.scripts.get(name) or log.scripts.get(_DEFAULT)
    if script is None:
        return {"status": 404, "message": f"no script named {name!r} (and no default)"}
    reply = script.replies[min(script.position, len(script.replies) - 1)]
    script.repeats += 1
    if script.repeats >= int(reply.get("count", 1)):
        script.repeats = 0
        script.position += 1
    return reply


def _handler_class(
    log: _Log, stopping: threading.Event
) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.log_ = log
    Handler.stopping = stopping
    return Handler


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    log_: _Log
    stopping: threading.Event

    def setup(self) -> None:
        super().setup()
        # Small writes (each event a chunk) go out at once: with Nagle's algorithm, a
        # second small write waits for the client's delayed ACK (40 ms on Linux).
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the log is what the tests query

    # ---- routes ------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        if path in ("/v1/models", "/models"):
            names = sorted(self.log_.scripts) or [_DEFAULT]
            self._json(200, {"object": "list", "data": [_model(n) for n in names]})
        elif path == "/_tether/log":
            self._json(200, _log_json(self.log_))
        else:
            self._json(404, _error_body(404, f"no route {self.path}"))

    def do_POST(self) -> None:
        arrived = time.time()
        started = time.monotonic()
        # The Claude Code CLI asks for ``/v1/messages?beta=true``: routes ignore a query.
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        wire = "anthropic" if path.startswith(("/v1/messages", "/messages")) else "openai"
        try:
            body = self._body()
        except ValueError as exc:
            self._json(400, _error_body(400, f"invalid JSON body: {exc}", wire))
            return
        if path == "/_tether/script":
            replies = body.get("replies")
            if not isinstance(replies, list) or not replies:
                self._json(400, _error_body(400, "replies must be a non-empty list"))
                return
            with self.log_.lock:
                self.log_.scripts[str(body.get("name", _DEFAULT))] = _Script(replies)
            self._json(200, {"ok": True})
            return
        if path in ("/v1/messages/count_tokens", "/messages/count_tokens"):
            self._json(200, {"input_tokens": _prompt_tokens(body)})
            return
        if path not in ("/v1/chat/completions", "/chat/completions", "/v1/messages", "/messages"):
            self._json(404, _error_body(404, f"no route {self.path}", wire))
            return
        name = self.headers.get("X-Tether-Script") or str(body.get("model") or _DEFAULT)
        with self.log_.lock:
            self.log_.seq += 1
            record = Request(
                id=f"req_{self.log_.seq}",
                time=arrived,
                body=body,
                script=name,
                authorization=self.headers.get("Authorization"),
                api_key=self.headers.get("x-api-key"),
                wire=wire,
            )
            reply = _next_reply(self.log_, name)
            self.log_.requests.append(record)
            self.log_.lock.notify_all()
        try:
            if wire == "anthropic":
                self._reply_anthropic(record, reply, started)
            else:
                self._reply(record, reply, started)
        except (_Gone, BrokenPipeError, ConnectionResetError):
            self._end(record, "disconnected", started, gone=True)
            self.close_connection = True

    # ---- replies -----------------------------------------------------------------------

    def _error_reply(self, record: Request, reply: dict[str, Any], started: float) -> bool:
        """Answer with the reply's HTTP error, if it has one; whether it did."""
        status = int(reply.get("status", 200))
        if status == 200:
            return False
        record.status = status
        message = str(reply.get("message") or _REASONS.get(status, "error"))
        self._json(status, _error_body(status, message, record.wire), request_id=record.id)
        self._end(record, "error", started)
        return True

    def _reply(self, record: Request, reply: dict[str, Any], started: float) -> None:
        self._pause(float(reply.get("delay", 0.0)))
        if self._error_reply(record, reply, started):
            return
        text = str(reply.get("text") or "")
        calls = [_tool_call(c, i, record.id) for i, c in enumerate(reply.get("tool_calls") or [])]
        model = str(record.body.get("model") or _DEFAULT)
        usage = _usage(reply, record.body, text, calls, "openai")
        if record.stream:
            self._stream_openai(record, reply, started, _Answer(model, text, calls, usage))
            return
        if reply.get("hang"):
            self._hang(record)
        answer: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            answer["tool_calls"] = calls
        payload = {
            "id": f"chatcmpl-{record.id}",
            "object": "chat.completion",
            "created": int(record.time),
            "model": model,
            "choices": [{"index": 0, "message": answer, "finish_reason": _finish(calls)}],
        }
        if usage is not None:
            payload["usage"] = usage
        self._json(200, payload, request_id=record.id)
        self._end(record, "done", started)

    def _stream_openai(
        self, record: Request, reply: dict[str, Any], started: float, a: _Answer
    ) -> None:
        self._start_stream(record)
        chunk = max(1, int(reply.get("chunk", 8)))
        pace = float(reply.get("pace", 0.0))

        def event(delta: dict[str, Any] | None, finish: str | None = None) -> None:
            self._event(
                {
                    "id": f"chatcmpl-{record.id}",
                    "object": "chat.completion.chunk",
                    "created": int(record.time),
                    "model": a.model,
                    "choices": []
                    if delta is None
                    else [{"index": 0, "delta": delta, "finish_reason": finish}],
                }
                | ({"usage": a.usage} if delta is None else {})
            )

        event({"role": "assistant", "content": ""})
        for piece in self._paced(a.text, chunk, pace):
            event({"content": piece})
        for index, call in enumerate(a.calls):
            self._pause(pace)
            head = {"index": index, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            event({"tool_calls": [head]})
            for piece in self._paced(call["function"]["arguments"], chunk, pace):
                event({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        if reply.get("hang"):
            self._hang(record)
        event({}, _finish(a.calls))
        if a.usage is not None and (record.body.get("stream_options") or {}).get("include_usage"):
            event(None)  # the usage chunk: no choices
        self._write(b"data: [DONE]\n\n")
        # The reply is whole once [DONE] is out: a client may close without reading the
        # terminating chunk (the openai client does), which is not a disconnect.
        self._finish_stream(record, started)

    def _reply_anthropic(self, record: Request, reply: dict[str, Any], started: float) -> None:
        """The Anthropic Messages wire: content blocks, streamed as named SSE events."""
        self._pause(float(reply.get("delay", 0.0)))
        if self._error_reply(record, reply, started):
            return
        text = str(reply.get("text") or "")
        calls = [_tool_use(c, i, record.id) for i, c in enumerate(reply.get("tool_calls") or [])]
        model = str(record.body.get("model") or _DEFAULT)
        usage = _usage(reply, record.body, text, calls, "anthropic") or {
            "input_tokens": 0,
            "output_tokens": 0,
        }
        message: dict[str, Any] = {
            "id": f"msg_{record.id}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
        }
        if record.stream:
            self._stream_anthropic(
                record, reply, started, message, _Answer(model, text, calls, usage)
            )
            return
        if reply.get("hang"):
            self._hang(record)
        blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        blocks += calls
        message |= {"content": blocks, "stop_reason": _stop_reason(calls), "usage": usage}
        self._json(200, message, request_id=record.id)
        self._end(record, "done", started)

    def _stream_anthropic(
        self,
        record: Request,
        reply: dict[str, Any],
        started: float,
        message: dict[str, Any],
        a: _Answer,
    ) -> None:
        assert a.usage is not None
        self._start_stream(record)
        chunk = max(1, int(reply.get("chunk", 8)))
        pace = float(reply.get("pace", 0.0))
        opening = {"input_tokens": a.usage["input_tokens"], "output_tokens": 0}
        self._named("message_start", {"message": message | {"content": [], "usage": opening}})
        index = 0
        with_text = bool(a.text or not a.calls)  # a reply with neither is one empty block
        if with_text:
            start = {"index": 0, "content_block": {"type": "text", "text": ""}}
            self._named("content_block_start", start)
            for piece in self._paced(a.text, chunk, pace):
                delta = {"type": "text_delta", "text": piece}
                self._named("content_block_delta", {"index": 0, "delta": delta})
            if reply.get("hang"):
                self._hang(record)
            self._named("content_block_stop", {"index": 0})
            index = 1
        for offset, call in enumerate(a.calls):
            self._pause(pace)
            head = {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}
            self._named("content_block_start", {"index": index + offset, "content_block": head})
            for piece in self._paced(json.dumps(call["input"]), chunk, pace):
                delta = {"type": "input_json_delta", "partial_json": piece}
                self._named("content_block_delta", {"index": index + offset, "delta": delta})
            self._named("content_block_stop", {"index": index + offset})
        if reply.get("hang") and not with_text:
            self._hang(record)
        self._named(
            "message_delta",
            {
                "delta": {"stop_reason": _stop_reason(a.calls), "stop_sequence": None},
                "usage": {"output_tokens": a.usage["output_tokens"]},
            },
        )
        self._named("message_stop", {})
        self._finish_stream(record, started)

    def _start_stream(self, record: Request) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-request-id", record.id)
        self.end_headers()

    def _finish_stream(self, record: Request, started: float) -> None:
        """The reply is whole: record it, then the terminating chunk, which a client may
        never read."""
        self._end(record, "done", started)
        try:
            self._write(b"", last=True)
        except (_Gone, OSError):
            self.close_connection = True

    def _paced(self, text: str, chunk: int, pace: float) -> Iterator[str]:
        for i in range(0, len(text), chunk):
            self._pause(pace)
            yield text[i : i + chunk]

    def _end(self, record: Request, outcome: str, started: float, *, gone: bool = False) -> None:
        now = time.time()
        with self.log_.lock:
            if record.outcome != "open":
                return
            record.outcome = outcome
            record.ended = now
            record.served_s = time.monotonic() - started
            if gone:
                self.log_.disconnects.append(Disconnect(record.id, now))
            self.log_.lock.notify_all()

    # ---- the wire ----------------------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        body = json.loads(raw or b"{}")
        if not isinstance(body, dict):
            raise ValueError("the body is not a JSON object")
        return body

    def _json(self, status: int, payload: dict[str, Any], *, request_id: str | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if request_id is not None:
            self.send_header("x-request-id", request_id)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
        self._write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _named(self, kind: str, payload: dict[str, Any]) -> None:
        """An Anthropic stream event: its ``event:`` line names the ``type`` of its data."""
        data = json.dumps({"type": kind, **payload}).encode()
        self._write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    def _write(self, data: bytes, *, last: bool = False) -> None:
        """One HTTP chunk (``last``: the terminating empty one)."""
        if self._gone():
            raise _Gone
        frame = b"0\r\n\r\n" if last else b"%x\r\n%s\r\n" % (len(data), data)
        self.wfile.write(frame)
        self.wfile.flush()

    def _gone(self) -> bool:
        """The client closed its end: the socket reads as EOF (or errors). A client never
        sends anything while its response is still coming, so readable means gone."""
        sock: socket.socket = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, watching for the client's going away (``_Gone``)."""
        if seconds <= 0:
            return
        deadline = time.monotonic() + seconds
        while True:
            if self._gone():
                raise _Gone
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wait_readable(min(left, 0.25))

    def _hang(self, record: Request) -> None:
        """No end until the client goes away (or the server stops)."""
        with self.log_.lock:
            record.hanging = True
            self.log_.lock.notify_all()
        while not self.stopping.is_set():
            if self._gone():
                raise _Gone
            self._wait_readable(0.25)
        raise _Gone

    def _wait_readable(self, timeout: float) -> None:
        with contextlib.suppress(OSError, ValueError):
            select.select([self.connection], [], [], timeout)


_REASONS = {
    400: "bad request",
    401: "unauthorized",
    404: "not found",
    429: "rate limited",
    500: "internal server error",
    503: "service unavailable",
}


def _error_body(status: int, message: str, wire: str = "openai") -> dict[str, Any]:
    if wire == "anthropic":
        kind = _ANTHROPIC_ERRORS.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = {429: "rate_limit_error", 400: "invalid_request_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "code": status}}


_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tether"}


def _tool_call(call: dict[str, Any], index: int, request: str) -> dict[str, Any]:
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": str(call.get("id") or f"call_{request}_{index}"),
        "type": "function",
        "function": {"name": str(call["name"]), "arguments": arguments},
    }


def _tool_use(call: dict[str, Any], index: int, request: str) -> dict[str, Any]:
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    return {
        "type": "tool_use",
        "id": str(call.get("id") or f"toolu_{request}_{index}"),
        "name": str(call["name"]),
        "input": arguments,
    }


def _finish(calls: list[dict[str, Any]]) -> str:
    return "tool_calls" if calls else "stop"


def _prompt_tokens(body: dict[str, Any]) -> int:
    """A deterministic count: about four characters a token (the system prompt and the
    tools count on the Anthropic wire, where they are fields of their own)."""
    sent = [body.get("messages", []), body.get("system") or "", body.get("tools") or []]
    return max(1, len(json.dumps(sent)) // 4)


@dataclass(frozen=True)
class _Answer:
    """One scripted reply as a wire sends it: its model, text, tool calls and usage."""

    model: str
    text: str
    calls: list[dict[str, Any]]
    usage: dict[str, Any] | None


def _stop_reason(calls: list[dict[str, Any]]) -> str:
    return "tool_use" if calls else "end_turn"


def _usage(
    reply: dict[str, Any],
    body: dict[str, Any],
    text: str,
    calls: list[dict[str, Any]],
    wire: str,
) -> dict[str, int] | None:
    """The reply's usage in ``wire``'s words: the script's own (either wire's keys), or
    counted; None where the script says ``usage: null``."""
    given = reply.get("usage", _MISSING)
    if given is None:
        return None
    if isinstance(given, dict):
        openai_words = "prompt_tokens" in given or "completion_tokens" in given
        if wire == "openai" and openai_words:
            return given  # as the script wrote it
        prompt = int(given.get("prompt_tokens") or given.get("input_tokens") or 0)
        completion = int(given.get("completion_tokens") or given.get("output_tokens") or 0)
    else:
        prompt = _prompt_tokens(body)
        completion = max(1, (len(text) + sum(len(json.dumps(c)) for c in calls)) // 4)
    if wire == "anthropic":
        return {"input_tokens": prompt, "output_tokens": completion}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


_MISSING = object()


def _prioritize() -> None:
    """SCHED_FIFO where allowed, else a lower nice value, else nothing."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return
    except (AttributeError, OSError):
        pass
    with contextlib.suppress(OSError):
        os.nice(-10)


def main(argv: list[str] | None = None) -> int:
    width = max(len(k) for k in REPLY_KEYS)
    keys = "\n".join(f"  {k:<{width}}  {what}" for k, what in REPLY_KEYS.items())
    parser = argparse.ArgumentParser(
        prog="python -m tether.testing.model_server",
        description=textwrap.fill(
            "A model server that replays a script, for agents with no key and no network: "
            "OpenAI chat completions at the URL it prints first (/chat/completions below "
            "it) and Anthropic Messages at that URL's root (/v1/messages)."
        ),
        epilog="\n\n".join(
            [
                textwrap.fill(
                    "A script is a list of replies, used in order (the last one repeats). "
                    "Named scripts ({name: [replies]} in --script) answer the requests "
                    "whose model (or X-Tether-Script header) names them; the others get "
                    "the script 'default'."
                ),
                f"reply keys:\n{keys}",
                textwrap.fill(
                    "POST /_tether/script {name, replies} sets a script; GET /_tether/log "
                    "shows every request and disconnect. More: docs/model-server.md."
                ),
            ]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument(
        "--empty", action="store_true", help="no default script (set scripts over HTTP)"
    )
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="ask for SCHED_FIFO (else a higher priority), to notice disconnects at once",
    )
    parser.add_argument(
        "--script",
        help='a JSON file: a list of replies, or {"name": [replies], ...} for named scripts',
    )
    args = parser.parse_args(argv)
    if args.realtime:
        _prioritize()  # before any thread starts: they inherit it
    server = ModelServer(host=args.host, port=args.port)
    loaded: Any = None
    if args.script:
        with open(args.script) as f:
            loaded = json.load(f)
    if isinstance(loaded, dict):
        for name, script in loaded.items():
            server.script(str(name), script)
    elif isinstance(loaded, list):
        server.script(_DEFAULT, loaded)
    if not args.empty and (not isinstance(loaded, dict) or _DEFAULT not in loaded):
        with server._log.lock:
            known = _DEFAULT in server._log.scripts
        if not known:
            server.script(_DEFAULT, [{"text": "Hello from the Tether model server."}])
    print(server.url, flush=True)
    server.start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
