"""What ``tether serve`` keeps in reserve: descriptors for the runtime, a cap on concurrent
event streams and bodies; and the request limits of ``/rpc`` (body size, nesting,
integers) that every protocol face keeps too (``limit_route``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from typing import Any, Final

import msgspec
import structlog
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether.serve.refusals import http_error
from tether.wire.rpc import INVALID_PARAMS, INVALID_REQUEST, MAX_DEPTH, PARSE_ERROR, json_problem

__all__ = [
    "DEFAULT_FD_RESERVE",
    "DRAIN_FACTOR",
    "NOFILE_TARGET",
    "Limits",
    "free_descriptors",
    "gated",
    "limit_route",
    "raise_descriptor_limit",
    "read_capped",
]

log = structlog.get_logger("tether.rpc")

# Descriptors kept free for the runtime (worker pipes and sockets, respawns, the store,
# tool subprocesses). A new request is refused (503) when fewer are free; a new event
# stream, which holds its descriptor for long, when fewer than twice as many are.
DEFAULT_FD_RESERVE: Final = 64
# ``serve`` raises the soft RLIMIT_NOFILE toward the hard limit, up to this.
NOFILE_TARGET: Final = 1 << 16
# An oversized body is read and dropped up to this many times the cap before the 413, so
# that a client that writes its whole body before it reads gets it; past that, the 413
# goes at once (the HTTP server discards or cuts the rest).
DRAIN_FACTOR: Final = 16


def free_descriptors() -> int | None:
    """File descriptors this process may still open (None: no limit, or not knowable)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd"))  # Linux; counts the listing's own fd too
    except FileNotFoundError:
        return None
    except OSError:  # EMFILE: not even the listing could be opened
        return 0
    return max(soft - used, 0)


def raise_descriptor_limit(target: int = NOFILE_TARGET) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE toward the hard limit (up to ``target``); the new
    (soft, hard). Never lowers it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class Limits:
    """Refuses, with 503 and a JSON body, what would take what the runtime needs.

    With R = ``fd_reserve``: a new ``GET /events`` stream is refused when fewer than 3R
    descriptors are free or ``max_streams`` are already open, any request when fewer
    than 2R are free. Refusals close their connection, so they hold nothing. New
    connections themselves are gated below 2R too (``gated``), and accepted in small
    batches, so a burst of them cannot take the last R.
    """

    _LOG_EVERY: Final = 5.0  # seconds between two refusal log lines

    def __init__(self, app: ASGIApp, *, max_streams: int, fd_reserve: int) -> None:
        self._app = app
        self._max_streams = max_streams
        self._reserve = fd_reserve
        self.streams = 0
        self._refused = 0
        self._logged = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        stream = scope["path"] == "/events"
        free = free_descriptors()
        if free is not None and free < self._reserve * (3 if stream else 2):
            why = f"server busy: {free} file descriptors free, {self._reserve} kept for the runtime"
            await self._refuse(why, scope, receive, send)
            return
        if not stream:
            await self._app(scope, receive, send)
            return
        if self.streams >= self._max_streams:
            why = f"too many event streams: {self.streams} open (--max-streams)"
            await self._refuse(why, scope, receive, send)
            return
        self.streams += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self.streams -= 1

    async def _refuse(self, why: str, scope: Scope, receive: Receive, send: Send) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._logged >= self._LOG_EVERY:
            log.warning("serve.refused", why=why, refused=self._refused, streams=self.streams)
            self._logged, self._refused = now, 0
        headers = {"Connection": "close", "Retry-After": "1"}
        await http_error(503, why, headers)(scope, receive, send)


def gated(protocol: Any, floor: int) -> Any:
    """uvicorn's HTTP protocol class, made to answer a bare 503 and close a connection
    that arrives while fewer than ``floor`` descriptors are free, before it reads a byte:
    a flood of connections that never send a request holds nothing for long."""
    body = msgspec.json.encode({"error": "server busy: too few file descriptors free"})
    busy = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nRetry-After: 1\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )

    class Gated(protocol):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            free = free_descriptors()
            if free is not None and free < floor:
                transport.write(busy)
                transport.close()

    return Gated


# ---- request limits: /rpc's, kept by every face ------------------------------------------


async def read_capped(request: Request, cap: int) -> bytes | None:
    """The body, or None if it exceeds ``cap``, never holding more than ``cap`` bytes.

    The bytes are counted as they come. A declared length over the cap is refused at once:
    nothing of it is kept. An oversized body is still read to its end (up to
    ``DRAIN_FACTOR`` times the cap) and discarded, so an ordinary client that writes its
    whole body before reading gets the 413 instead of a reset connection.
    """
    declared = request.headers.get("content-length", "")
    over = declared.isdigit() and int(declared) > cap
    if over and int(declared) > DRAIN_FACTOR * cap:
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN_FACTOR * cap:
            return None
        if size <= cap and not over:
            parts.append(chunk)
    return b"".join(parts) if size <= cap and not over else None


def _rpc_error(rid: Any, code: int, message: str) -> Response:
    # 400: the body is refused before any method runs (MCP's Streamable HTTP asks for an
    # HTTP error status there); the JSON-RPC error says why, as /rpc's would.
    doc = {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}
    return Response(msgspec.json.encode(doc), 400, media_type="application/json")


def _declares_json(headers: Headers) -> bool:
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    return not kind or kind == "application/json" or kind.endswith("+json")


def _refusal(body: bytes) -> Response | None:
    """What /rpc would refuse in a JSON-RPC body before reading it as a call: not JSON,
    nested deeper than ``MAX_DEPTH``, an integer outside 64 bits signed. The messages
    describe the body; no exception's text is in them."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:  # its text says where the body is malformed
        return _rpc_error(None, PARSE_ERROR, f"parse error: {exc}")
    except RecursionError:  # the decoder's own guard, near 1,000 levels
        return _rpc_error(None, INVALID_REQUEST, f"JSON nested deeper than {MAX_DEPTH} levels")
    rid = doc.get("id") if isinstance(doc, dict) else None
    if not (rid is None or (isinstance(rid, str | int) and not isinstance(rid, bool))):
        rid = None
    match json_problem(doc):
        case "depth":
            return _rpc_error(rid, INVALID_REQUEST, f"JSON nested deeper than {MAX_DEPTH} levels")
        case "integer":
            bad = "invalid params: an integer outside the 64-bit signed range"
            return _rpc_error(rid, INVALID_PARAMS, bad)
    return None


class _Capped:
    """A face's endpoint behind /rpc's request limits: a POST body is read with
    ``read_capped`` (413 over the cap), a JSON one checked by ``_refusal``, and only then
    handed on to the face, which reads it from memory. A body declared as another type
    goes on unparsed: the face refuses the type itself."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self._app = app
        self._max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            body = await read_capped(request, self._max_body)
        except ClientDisconnect:  # nobody is left to answer
            return
        if body is None:
            await http_error(413, f"request body over {self._max_body} bytes")(scope, receive, send)
            return
        refusal = _refusal(body) if _declares_json(request.headers) else None
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        given = False

        async def replay() -> Message:
            # The body once, then the connection's own messages (a disconnect, which a
            # waiting call watches for).
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._app(scope, replay, send)


def limit_route(route: BaseRoute, max_body: int) -> BaseRoute:
    """``route`` (a face's) with /rpc's request limits on what is posted to it."""
    if not isinstance(route, Route):
        return route
    methods = list(route.methods or ())
    return Route(route.path, _Capped(route.app, max_body), methods=methods, name=route.name)
