"""A small client for ``tether serve``, on the standard library only (urllib).

``Client.call`` makes one JSON-RPC call and raises ``RpcError`` (with the wire's
``error.data.code``) on a refusal; ``Client.events`` opens ``GET /events`` and yields
the server-sent events, reconnecting from the last id when the server drops it as a
slow consumer.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException, HTTPResponse
from typing import Any, Final
from urllib.parse import urlencode

__all__ = ["DEFAULT_URL", "Client", "RpcError", "ServerEvent", "in_background"]

DEFAULT_URL: Final = "http://127.0.0.1:7777"
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
        error = answer.get("error")
        if error is not None:
            data = error.get("data") or {}
            raise RpcError(
                data.get("code", "internal"),
                error.get("message", ""),
                error_id=data.get("error_id"),
            )
        return answer["result"]

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
