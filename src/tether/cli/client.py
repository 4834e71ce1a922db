"""A small client for ``tether serve``, on the standard library only (urllib).

``Client.call`` makes one JSON-RPC call and raises ``RpcError`` (with the wire's
``error.data.code``) on a refusal; ``Client.batch`` makes several in one request;
``Client.events`` opens ``GET /events`` and yields the server-sent events, reconnecting
from the last id when the server drops it as a slow consumer; ``Client.stream`` opens one
connection of it that another thread may close (the terminal UI's, which reconnects by
itself).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException, HTTPResponse
from typing import Any, Final
from urllib.parse import urlencode

__all__ = [
    "BATCH",
    "DEFAULT_URL",
    "Client",
    "EventStream",
    "RpcError",
    "ServerEvent",
    "in_background",
]

DEFAULT_URL: Final = "http://127.0.0.1:7777"
BATCH: Final = 100  # calls in one request, the server's bound (serve.rpc.MAX_BATCH)
_STREAM_TIMEOUT: Final = 60.0  # the server sends a heartbeat every 15 s of silence

_HTTP_CODES: Final = {401: "unauthorized", 403: "forbidden", 404: "not-found", 413: "too-large"}


class RpcError(Exception):
    """A refused call: ``code`` is the wire's ``error.data.code`` (or a transport code)."""

    def __init__(self, code: str, message: str, *, error_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.error_id = error_id


@dataclass(frozen=True)
class ServerEvent:
    """One server-sent event; ``data`` is the decoded JSON payload."""

    event: str
    data: Any
    id: int | None = None


class Client:
    """JSON-RPC over ``POST /rpc`` and SSE over ``GET /events`` of one server."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self._token = token
        self._timeout = timeout
        self._ids = itertools.count(1)

    def _headers(self, **extra: str) -> dict[str, str]:
        headers = dict(extra)
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _open(self, request: urllib.request.Request, timeout: float) -> HTTPResponse:
        try:
            response: HTTPResponse = urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                detail = exc.read().decode("utf-8", "replace").strip()
            code = _HTTP_CODES.get(exc.code, f"http-{exc.code}")
            raise RpcError(code, f"HTTP {exc.code} from {self.url}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RpcError("unreachable", f"cannot reach {self.url}: {reason}") from None
        return response

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """One call; its ``result``, or ``RpcError``."""
        body = json.dumps(
            {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": params or {}}
        ).encode()
        request = urllib.request.Request(
            self.url + "/rpc",
            data=body,
            headers=self._headers(**{"Content-Type": "application/json"}),
            method="POST",
        )
        with self._open(request, self._timeout) as response:
            answer = json.loads(response.read())
        return _result(answer)

    def batch(self, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        """Several calls, in requests of at most ``BATCH`` (the server runs each request's
        calls in order): each call's ``result``, or the ``RpcError`` that refused it, in the
        order given. A failure of a request itself raises."""
        out: list[Any] = []
        for start in range(0, len(calls), BATCH):
            out += self._batch(calls[start : start + BATCH])
        return out

    def _batch(self, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
        # Ids need only tell the calls of this one request apart.
        body = [
            {"jsonrpc": "2.0", "id": i, "method": method, "params": params}
            for i, (method, params) in enumerate(calls)
        ]
        request = urllib.request.Request(
            self.url + "/rpc",
            data=json.dumps(body).encode(),
            headers=self._headers(**{"Content-Type": "application/json"}),
            method="POST",
        )
        with self._open(request, self._timeout) as response:
            answers = json.loads(response.read())
        if not isinstance(answers, list):  # the request as a whole was refused
            _result(answers)
            raise RpcError("internal", "the server answered a batch with one answer")
        by_id = {a.get("id"): a for a in answers if isinstance(a, dict)}
        out: list[Any] = []
        for i in range(len(calls)):
            try:
                out.append(_result(by_id.get(i, {})))
            except RpcError as exc:
                out.append(exc)
        return out

    def stream(self, session: str | None = None, last_id: int | None = None) -> EventStream:
        """One ``GET /events`` connection, open now (``RpcError`` if it cannot be), with
        ``Last-Event-ID`` when ``last_id`` is given; no reconnection of its own."""
        return EventStream(self._connect(session, last_id), self.url)

    def events(
        self, session: str | None = None, last_id: int | None = None
    ) -> Iterator[ServerEvent]:
        """Connect now, then yield events until the server ends the stream.

        A drop for falling behind is followed by a reconnect from the last event
        received (the server replays what it still holds; ``gap`` says if that was not
        enough). The final ``closed`` event for any other reason is yielded, then the
        iteration ends.
        """
        response = self._connect(session, last_id)

        def iterate(response: HTTPResponse, last_id: int | None) -> Iterator[ServerEvent]:
            while True:
                try:
                    with response:
                        for ev in _parse(response):
                            last_id = ev.id if ev.id is not None else last_id
                            if ev.event == "closed" and ev.data.get("reason") == "slow-consumer":
                                break
                            yield ev
                        else:
                            return
                except (OSError, HTTPException) as exc:
                    raise RpcError(
                        "unreachable", f"event stream from {self.url} lost: {exc}"
                    ) from None
                response = self._connect(session, last_id)

        return iterate(response, last_id)

    def _connect(self, session: str | None, last_id: int | None) -> HTTPResponse:
        query = urlencode({"session": session}) if session else ""
        extra = {"Accept": "text/event-stream"}
        if last_id is not None:
            extra["Last-Event-ID"] = str(last_id)
        request = urllib.request.Request(
            self.url + "/events" + ("?" + query if query else ""), headers=self._headers(**extra)
        )
        return self._open(request, _STREAM_TIMEOUT)


def _result(answer: dict[str, Any]) -> Any:
    """One JSON-RPC answer's ``result``, or its error as ``RpcError``."""
    error = answer.get("error")
    if error is not None:
        data = error.get("data") or {}
        raise RpcError(
            data.get("code", "internal"),
            error.get("message", ""),
            error_id=data.get("error_id"),
        )
    if "result" not in answer:
        raise RpcError("internal", "the server's answer holds neither a result nor an error")
    return answer["result"]


class EventStream:
    """One open ``GET /events`` response: iterate it for its events (it ends when the
    server ends the stream, or raises ``RpcError`` ``unreachable`` when the connection is
    lost); ``close`` from any thread ends a reader blocked in it."""

    def __init__(self, response: HTTPResponse, url: str) -> None:
        self._response = response
        self._url = url
        self._lock = threading.Lock()  # the descriptor is not closed while close() uses it
        self._closed = False

    def __iter__(self) -> Iterator[ServerEvent]:
        try:
            yield from _parse(self._response)
        except (OSError, HTTPException, ValueError) as exc:
            if self._closed:
                return
            raise RpcError("unreachable", f"event stream from {self._url} lost: {exc}") from None
        finally:
            with self._lock:
                self._closed = True
                self._response.close()

    def close(self) -> None:
        """Shut the connection down (a blocked read returns at once), then close it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                # A duplicate of the descriptor: shutting it down shuts the connection.
                dup = socket.fromfd(self._response.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            except (OSError, ValueError):  # already gone
                return
            with dup, contextlib.suppress(OSError):
                dup.shutdown(socket.SHUT_RDWR)


def _parse(stream: HTTPResponse) -> Iterator[ServerEvent]:
    """The SSE wire format: ``field: value`` lines, a blank line ends an event."""
    event_id: int | None = None
    name = "message"
    data: list[str] = []
    for raw in stream:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield ServerEvent(name, json.loads("\n".join(data)), event_id)
            event_id, name, data = None, "message", []
        elif not line.startswith(":"):  # a ":" line is a comment (heartbeat)
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "id":
                event_id = int(value)
            elif field == "event":
                name = value
            elif field == "data":
                data.append(value)


def in_background(events: Iterator[ServerEvent]) -> queue.Queue[ServerEvent | None]:
    """Read ``events`` on a daemon thread into a queue; None marks the stream's end."""
    into: queue.Queue[ServerEvent | None] = queue.Queue()

    def pump() -> None:
        try:
            for ev in events:
                into.put(ev)
        except RpcError:
            pass  # the stream is gone: the None below says so
        finally:
            into.put(None)

    threading.Thread(target=pump, name="tether-events", daemon=True).start()
    return into
