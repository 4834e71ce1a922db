"""``tether serve``: the runtime behind JSON-RPC 2.0 (``POST /rpc``) and SSE (``GET /events``),
with the web console and the protocol faces behind the same guard.

The caller acts as ``User(parent=address.parent)``. The request path, the lanes that keep
stops from waiting, and the descriptor reserve: docs/design.md, section 13.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import os
import re
import resource
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tether import Event, Runtime, User
from tether.runtime._log import configure_logging
from tether.serve.faces import Face, FaceOptions, build_faces
from tether.serve.sse import EventHub
from tether.serve.web import console_routes, is_console_path
from tether.wire.errors import NotFound, TetherError
from tether.wire.rpc import (
    APPLICATION_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    MAX_DEPTH,
    METHOD_NOT_FOUND,
    METHODS,
    PARSE_ERROR,
    RPC_ERROR_CODES,
    Accepted,
    AgentList,
    BudgetParams,
    BudgetResult,
    DisposeParams,
    ErrorData,
    ErrorObject,
    FailParams,
    Inbox,
    InboxParams,
    InterruptParams,
    InterruptResult,
    ListParams,
    MessageAccepted,
    OpenParams,
    PauseParams,
    PauseResult,
    PromptParams,
    ReleaseParams,
    ResumeParams,
    SendParams,
    SessionResult,
    SetBudgetParams,
    SpawnParams,
    StatusParams,
    StopReportParams,
    StopReportResult,
    SubtreeStopResult,
    Transcript,
    TranscriptParams,
    Turns,
    TurnsParams,
    json_problem,
)
from tether.wire.rpc import (
    Response as RpcResponse,
)

__all__ = [
    "DEFAULT_FD_RESERVE",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_STREAMS",
    "DEFAULT_PATH",
    "DEFAULT_PORT",
    "FAULT_INJECTION_ENV",
    "RpcDispatcher",
    "build_app",
    "free_descriptors",
    "is_loopback",
    "raise_descriptor_limit",
    "serve",
]

DEFAULT_PATH: Final = Path(".tether") / "state.db"
DEFAULT_PORT: Final = 7777
DEFAULT_MAX_BODY: Final = 1 << 20
MAX_BATCH: Final = 100
DEFAULT_MAX_STREAMS: Final = 64  # concurrent GET /events streams
# Descriptors kept free for the runtime (worker pipes and sockets, respawns, the store,
# tool subprocesses). A new request is refused (503) when fewer are free; a new event
# stream, which holds its descriptor for long, when fewer than twice as many are.
DEFAULT_FD_RESERVE: Final = 64
# ``serve`` raises the soft RLIMIT_NOFILE toward the hard limit, up to this.
NOFILE_TARGET: Final = 1 << 16
LISTEN_QUEUE: Final = 2048  # the kernel's queue of connections not yet accepted
# With this set to 1 the server also answers ``debug.fail``, which raises an unexpected
# exception: the only way to exercise the ``internal`` error path from outside.
FAULT_INJECTION_ENV: Final = "TETHER_RPC_FAULT_INJECTION"

log = structlog.get_logger("tether.rpc")

_Handler = Callable[[Any], msgspec.Struct]


def _handlers(rt: Runtime) -> dict[str, _Handler]:
    def open_(p: OpenParams) -> SessionResult:
        sid = rt.open_session(
            p.driver,
            config=p.config,
            slug=p.slug,
            permissions=p.permissions,
            stall=p.stall,
            limits=p.limits,
            budget=p.budget,
        )
        return SessionResult(sid)

    def prompt(p: PromptParams) -> MessageAccepted:
        return MessageAccepted(message=rt.prompt(p.session, p.content, data=p.data))

    def release(p: ReleaseParams) -> Accepted:
        rt.release(p.session)
        return Accepted()

    def spawn(p: SpawnParams) -> SessionResult:
        child = rt.spawn(
            p.parent,
            p.driver,
            mode=p.mode,
            prompt=p.prompt,
            data=p.data,
            slug=p.slug,
            config=p.config,
            permissions=p.permissions,
            stall=p.stall,
            limits=p.limits,
            budget=p.budget,
        )
        return SessionResult(child if isinstance(child, str) else child.id)

    def send(p: SendParams) -> MessageAccepted:
        a = p.address
        message = rt.send(
            a.session, p.content, authority=User(parent=a.parent), data=p.data, wake=p.wake
        )
        return MessageAccepted(message=message)

    def interrupt(p: InterruptParams) -> InterruptResult | SubtreeStopResult:
        # The core primitive alone decides: User(parent) is compared with the target's
        # durable parent, and the turn is bound there, so nothing here looks anything up.
        auth = User(parent=p.address.parent)
        if p.scope == "subtree":
            turns = rt.interrupt(
                p.address.session,
                authority=auth,
                kind=p.kind,
                reason=p.reason,
                grace=p.grace,
                deadline=p.deadline,
                turn=p.turn,
                scope="subtree",
            )
            return SubtreeStopResult(turns=turns)
        turn = rt.interrupt(
            p.address.session,
            authority=auth,
            kind=p.kind,
            reason=p.reason,
            grace=p.grace,
            deadline=p.deadline,
            turn=p.turn,
        )
        return InterruptResult(turn=turn)

    def pause(p: PauseParams) -> PauseResult:
        # Authority as for an interrupt: the runtime compares User(parent) with the
        # target's durable parent (and, for a subtree, authorizes at its top).
        a = p.address
        turns = rt.pause(
            a.session, authority=User(parent=a.parent), scope=p.scope, reason=p.reason, turn=p.turn
        )
        return PauseResult(turns=turns)

    def resume(p: ResumeParams) -> PauseResult:
        a = p.address
        return PauseResult(
            turns=rt.resume(a.session, authority=User(parent=a.parent), scope=p.scope)
        )

    def list_(p: ListParams) -> AgentList:
        return AgentList(rt.list_agents(p.root, scope=p.scope))

    def status(p: StatusParams) -> msgspec.Struct:
        return rt.status(p.session)

    def transcript(p: TranscriptParams) -> Transcript:
        # One entry past the page says whether there is more; the store reads no further.
        entries = rt.transcript(p.session, after=p.after, limit=p.limit + 1)
        return Transcript(entries[: p.limit], more=len(entries) > p.limit)

    def turns(p: TurnsParams) -> Turns:
        return Turns(rt.turns(p.session))

    def inbox(p: InboxParams) -> Inbox:
        return Inbox(rt.inbox(p.session))

    def stop_report(p: StopReportParams) -> StopReportResult:
        return StopReportResult(rt.stop_report(p.turn))

    def budget(p: BudgetParams) -> BudgetResult:
        return BudgetResult(rt.budget(p.session))

    def set_budget(p: SetBudgetParams) -> Accepted:
        a = p.address
        rt.set_budget(a.session, p.budget, authority=User(parent=a.parent))
        return Accepted()

    def dispose(p: DisposeParams) -> Accepted:
        # Accepted once the supervisor has checked the authority and marked the subtree
        # disposing; the sessions' hosts carry the disposal on by themselves (cancel,
        # grace, escalation). Waiting for every session to settle (up to 2·grace+10 s)
        # would hold a thread for nothing.
        rt.dispose(p.address.session, authority=User(parent=p.address.parent), wait=False)
        return Accepted()

    return {
        "session.open": open_,
        "session.prompt": prompt,
        "session.release": release,
        "subagent.spawn": spawn,
        "subagent.send": send,
        "subagent.interrupt": interrupt,
        "subagent.pause": pause,
        "subagent.resume": resume,
        "subagent.list": list_,
        "subagent.status": status,
        "subagent.transcript": transcript,
        "subagent.turns": turns,
        "subagent.inbox": inbox,
        "subagent.dispose": dispose,
        "subagent.stopReport": stop_report,
        "subagent.budget": budget,
        "subagent.setBudget": set_budget,
    }


def _fail(_: FailParams) -> msgspec.Struct:
    raise RuntimeError("debug.fail: injected fault (this text must never reach the wire)")


def _error(
    rid: Any, code: int, message: str, data_code: str, error_id: str | None = None
) -> RpcResponse:
    return RpcResponse(rid, error=ErrorObject(code, message, ErrorData(data_code, error_id)))


def _refusal(rid: Any, exc: TetherError) -> RpcResponse | None:
    """A TetherError as the wire shows it; None for codes the wire does not publish."""
    code = "invalid-params" if exc.code == "driver-not-found" else exc.code
    if code not in RPC_ERROR_CODES or code == "internal":
        return None
    number = INVALID_PARAMS if code == "invalid-params" else APPLICATION_ERROR
    return _error(rid, number, exc.message, code)


def _valid_id(value: Any) -> bool:
    return value is None or (isinstance(value, str | int | float) and not isinstance(value, bool))


class _Lanes:
    """The threads the blocking runtime calls run on.

    ``subagent.interrupt`` and ``subagent.pause`` have a lane of their own and
    ``subagent.status`` another: nothing else runs there, so a stop (and the look that
    checks it landed) never waits behind other calls, however many of those are slow or
    stuck. Everything else shares ``work``, bounded so a flood of calls cannot grow
    threads without limit.
    """

    STOP: Final = frozenset({"subagent.interrupt", "subagent.pause"})
    LOOK: Final = frozenset({"subagent.status"})

    def __init__(self, work: int = 32) -> None:
        self.stop = ThreadPoolExecutor(4, thread_name_prefix="rpc-stop")
        self.look = ThreadPoolExecutor(4, thread_name_prefix="rpc-look")
        self.work = ThreadPoolExecutor(work, thread_name_prefix="rpc-work")

    def for_method(self, method: str) -> ThreadPoolExecutor:
        if method in self.STOP:
            return self.stop
        return self.look if method in self.LOOK else self.work

    async def run(self, lane: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)

    def close(self) -> None:
        for lane in (self.stop, self.look, self.work):
            lane.shutdown(wait=False, cancel_futures=True)


def _too_deep(rid: Any) -> RpcResponse:
    message = f"JSON nested deeper than {MAX_DEPTH} levels"
    return _error(rid, INVALID_REQUEST, message, "invalid-params")


class RpcDispatcher:
    """Decodes one request body (a call or a batch), runs it, encodes the answer."""

    def __init__(
        self, rt: Runtime, *, fault_injection: bool = False, lanes: _Lanes | None = None
    ) -> None:
        self._methods: dict[str, tuple[type[msgspec.Struct], _Handler]] = {
            name: (METHODS[name], fn) for name, fn in _handlers(rt).items()
        }
        if fault_injection:
            self._methods["debug.fail"] = (FailParams, _fail)
        self.lanes = lanes or _Lanes()

    async def handle(self, body: bytes) -> bytes | None:
        """The response body, or None when every call was a notification."""
        try:
            doc = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            return msgspec.json.encode(
                _error(None, PARSE_ERROR, f"parse error: {exc}", "invalid-params")
            )
        except RecursionError:  # the decoder's own guard, near 1,000 levels
            return msgspec.json.encode(_too_deep(None))
        if not isinstance(doc, list):
            one = await self._call(doc)
            return None if one is None else msgspec.json.encode(one)
        if not doc or len(doc) > MAX_BATCH:
            message = f"a batch holds 1 to {MAX_BATCH} requests"
            return msgspec.json.encode(_error(None, INVALID_REQUEST, message, "invalid-params"))
        # In order, one at a time: a batch reads like the script its client wrote.
        answers = [a for a in [await self._call(req) for req in doc] if a is not None]
        return msgspec.json.encode(answers) if answers else None

    async def _call(self, req: Any) -> RpcResponse | None:
        rid = req.get("id") if isinstance(req, dict) else None
        if not isinstance(req, dict) or req.get("jsonrpc") != "2.0" or not _valid_id(rid):
            bad = "not a JSON-RPC 2.0 request object"
            return _error(rid if _valid_id(rid) else None, INVALID_REQUEST, bad, "invalid-params")
        if json_problem(req) == "depth":  # answered even for a notification: nothing ran
            return _too_deep(rid)
        method = req.get("method")
        if not isinstance(method, str):
            return _error(rid, INVALID_REQUEST, "method must be a string", "invalid-params")
        answer = await self._run(rid, method, req.get("params"))
        return answer if "id" in req else None  # a notification gets no answer

    async def _run(self, rid: Any, method: str, params: Any) -> RpcResponse:
        entry = self._methods.get(method)
        if entry is None:
            return _error(rid, METHOD_NOT_FOUND, f"unknown method {method!r}", "not-found")
        params_type, handler = entry
        if json_problem(params) == "integer":
            bad = "invalid params: an integer outside the 64-bit signed range"
            return _error(rid, INVALID_PARAMS, bad, "invalid-params")
        try:
            parsed = msgspec.convert({} if params is None else params, params_type)
        except msgspec.ValidationError as exc:
            return _error(rid, INVALID_PARAMS, f"invalid params: {exc}", "invalid-params")
        try:
            result = await self.lanes.run(self.lanes.for_method(method), handler, parsed)
            return RpcResponse(rid, result=result)
        except TetherError as exc:
            refusal = _refusal(rid, exc)
            if refusal is not None:
                return refusal
            return self._internal(rid, method, exc)
        except Exception as exc:
            return self._internal(rid, method, exc)

    @staticmethod
    def _internal(rid: Any, method: str, exc: BaseException) -> RpcResponse:
        # The exception text may hold paths or data: it goes to the log only, and the
        # client gets the id that finds it there.
        error_id = "err_" + uuid.uuid4().hex[:16]
        log.error("rpc.internal_error", error_id=error_id, method=method, exc_info=exc)
        return _error(
            rid, APPLICATION_ERROR, f"internal error (id {error_id})", "internal", error_id
        )


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost``: the only binds that need no token."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class _Guard:
    """Access control for every route.

    With a token, a request needs ``Authorization: Bearer <token>`` (compared in constant
    time), except the web console's own static files, which hold no secret: the page asks
    for the token and sends it with each request it makes. Without one the server is
    loopback-only, and it refuses what a web page in a local browser could send: a foreign
    ``Host`` (DNS rebinding) or a foreign ``Origin`` (the console's files included).
    """

    def __init__(self, app: ASGIApp, *, token: str | None) -> None:
        self._app = app
        self._token = None if token is None else _digest(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            public = is_console_path(scope["method"], scope["path"])
            denied = self._check(Headers(scope=scope), public=public)
            if denied is not None:
                await denied(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _check(self, headers: Headers, *, public: bool = False) -> Response | None:
        host = _host_header(headers.get("host", ""))
        if host is None:
            return _http_error(400, "bad request: malformed Host header")
        if self._token is not None and public:
            return None
        if self._token is not None:
            scheme, _, credential = headers.get("authorization", "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                _digest(credential.strip()), self._token
            ):
                return None
            return _http_error(401, "unauthorized", {"WWW-Authenticate": "Bearer"})
        origin = headers.get("origin")
        origin_host = "localhost" if origin is None else _hostname(origin)
        if origin_host is not None and is_loopback(host) and is_loopback(origin_host):
            return None
        return _http_error(403, "forbidden: foreign Host or Origin on a loopback server")


_HOST: Final = re.compile(r"(\[[^\[\]]*\]|[^\[\]/@:?#\s]*)(?::[0-9]{1,5})?")


def _host_header(value: str) -> str | None:
    """The host a ``Host`` header names, or None if it is not ``host[:port]`` (with an
    IPv6 address in brackets)."""
    found = _HOST.fullmatch(value)
    if found is None:
        return None
    name = found.group(1)
    if name.startswith("["):
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    return name


def _hostname(url: str) -> str | None:
    """The host part of ``url`` ("" if none), or None when it cannot be parsed: a header
    like ``[::1`` or ``http://[evil]`` is the client's error, never a server fault."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return None


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


class _Limits:
    """Refuses, with 503 and a JSON body, what would take what the runtime needs.

    With R = ``fd_reserve``: a new ``GET /events`` stream is refused when fewer than 3R
    descriptors are free or ``max_streams`` are already open, any request when fewer
    than 2R are free. Refusals close their connection, so they hold nothing. New
    connections themselves are gated below 2R too (``_gated``), and accepted in small
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
        await _http_error(503, why, headers)(scope, receive, send)


def _gated(protocol: Any, floor: int) -> Any:
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


def _http_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    body = msgspec.json.encode({"error": message})
    return Response(body, status, headers=headers, media_type="application/json")


_EVENT_ID: Final = re.compile(r"[0-9]{1,19}")  # ASCII digits only: int() takes more


async def _read_capped(request: Request, cap: int) -> bytes | None:
    """The body, or None if it exceeds ``cap``.

    An oversized body is still read to its end (up to 16 times the cap, then the
    connection is dropped) and discarded, so an ordinary client that writes its whole
    body before reading gets the 413 instead of a reset connection.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 16 * cap:
        return None
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > 16 * cap:
            return None
        if size <= cap:
            parts.append(chunk)
    return b"".join(parts) if size <= cap else None


def build_app(
    rt: Runtime,
    hub: EventHub,
    *,
    token: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    fault_injection: bool = False,
    max_streams: int = DEFAULT_MAX_STREAMS,
    fd_reserve: int = DEFAULT_FD_RESERVE,
    faces: Sequence[Face] = (),
) -> ASGIApp:
    """The ASGI app over ``rt``: ``POST /rpc``, ``GET /events``, ``GET /health``, the
    web console (``GET /``), and the routes of ``faces`` (MCP, A2A), all behind the
    same guard."""
    dispatcher = RpcDispatcher(rt, fault_injection=fault_injection)
    lanes = dispatcher.lanes

    async def rpc(request: Request) -> Response:
        body = await _read_capped(request, max_body)
        if body is None:
            return _http_error(413, f"request body over {max_body} bytes")
        answer = await dispatcher.handle(body)
        if answer is None:
            return Response(status_code=204)
        return Response(answer, media_type="application/json")

    async def events(request: Request) -> Response:
        session = request.query_params.get("session") or None
        raw_id = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        if raw_id is not None and not _EVENT_ID.fullmatch(raw_id):
            return _http_error(400, "Last-Event-ID must be an event id (decimal digits)")
        last_id = None if raw_id is None else int(raw_id)
        if session is not None:
            try:
                await lanes.run(lanes.look, rt.status, session)
            except NotFound:
                return _http_error(404, f"no session {session!r}")
            except TetherError as exc:  # a malformed id
                return _http_error(400, exc.message)
        sub = hub.subscribe(session, last_id)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in sub.stream():
                    yield chunk
            finally:
                hub.unsubscribe(sub)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    async def health(_: Request) -> Response:
        return Response(b'{"ok":true}', media_type="application/json")

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def publish(ev: Event) -> None:
            hub.publish(ev.name, ev.session, ev.lineage, ev.data, ev.ts)

        def deliver(ev: Event) -> None:
            # Runs on a runtime thread: hand over, never wait.
            with contextlib.suppress(RuntimeError):  # the loop is gone: so is every client
                loop.call_soon_threadsafe(publish, ev)

        unsubscribe = rt.subscribe(deliver)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for face in faces:
                    await stack.enter_async_context(face.lifespan())
                yield
        finally:
            unsubscribe()
            hub.close()
            lanes.close()

    routes = [
        Route("/rpc", rpc, methods=["POST"]),
        Route("/events", events, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        *console_routes(),
        *[route for face in faces for route in face.routes],
    ]
    app = _Guard(Starlette(routes=routes, lifespan=lifespan), token=token)
    return _Limits(app, max_streams=max_streams, fd_reserve=fd_reserve)


class _Server(uvicorn.Server):
    """uvicorn, with the event streams ended at shutdown and signals left to us."""

    def __init__(
        self,
        config: uvicorn.Config,
        hub: EventHub,
        announce: Callable[[int], None],
        fd_reserve: int = DEFAULT_FD_RESERVE,
    ):
        super().__init__(config)
        self._hub = hub
        self._announce = announce
        self._fd_reserve = fd_reserve

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal once it has stopped, which would kill the process
        # before the runtime drains. These handlers stay installed during the drain, so a
        # second Ctrl-C cannot cut it short either.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle_exit)
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        config.http_protocol_class = _gated(config.http_protocol_class, 2 * self._fd_reserve)
        await super().startup(sockets)
        if self.started:
            # asyncio accepts up to ``backlog`` connections per wakeup, before any of
            # them is looked at: kept small (config), so a burst cannot reach the
            # reserve. The kernel's queue need not be small, so it is set back.
            for server in self.servers:
                for listener in server.sockets:
                    with socket.socket(fileno=os.dup(listener.fileno())) as sock:
                        sock.listen(LISTEN_QUEUE)
            self._announce(self.servers[0].sockets[0].getsockname()[1])

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Event streams never end by themselves; uvicorn waits for open connections.
        self._hub.close()
        await super().shutdown(sockets)


def serve(
    *,
    path: Path = DEFAULT_PATH,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    workers: int = 2,
    grace: float = 5.0,
    backend: str = "local",
    ray_address: str | None = None,
    containment: str = "auto",
    max_body: int = DEFAULT_MAX_BODY,
    max_streams: int = DEFAULT_MAX_STREAMS,
    fd_reserve: int = DEFAULT_FD_RESERVE,
    faces: FaceOptions | None = None,
    otlp: str | None = None,
) -> int:
    """Run the server until SIGINT/SIGTERM, then drain the runtime. Returns the exit code.

    ``faces``: the driver and config of the roots that MCP and A2A clients open.
    ``otlp``: export traces to this OTLP/HTTP base URL (semantics §16.3); None leaves it to
    the ``OTEL_*`` variables.
    """
    if token is None and not is_loopback(host):
        raise ValueError(f"binding {host} (not loopback) requires a token")
    # The host's log is for machines first: one JSON object a line, unless asked otherwise.
    os.environ.setdefault("TETHER_LOG_FORMAT", "json")
    configure_logging()
    soft, hard = raise_descriptor_limit()
    log.info("serve.descriptors", soft=soft, hard=hard, reserve=fd_reserve)
    path.parent.mkdir(parents=True, exist_ok=True)
    rt = Runtime(
        str(path),
        workers=workers,
        grace=grace,
        subreaper=True,
        backend=backend,
        ray_address=ray_address,
        containment=containment,
        telemetry=None if otlp is None else {"endpoint": otlp},
    )
    log.info("serve.containment", containment=rt.containment)
    try:
        hub = EventHub()
        fault_injection = os.environ.get(FAULT_INJECTION_ENV) == "1"
        app = build_app(
            rt,
            hub,
            token=token,
            max_body=max_body,
            fault_injection=fault_injection,
            max_streams=max_streams,
            fd_reserve=fd_reserve,
            faces=build_faces(rt, dataclasses.replace(faces or FaceOptions(), bearer=bool(token))),
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="on",
            log_level="warning",
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=5,
            backlog=max(4, fd_reserve // 4),
        )

        def announce(bound: int) -> None:
            where = f"[{host}]" if ":" in host else host
            log.info("serve.listening", url=f"http://{where}:{bound}", store=str(path))
            print(f"tether: serving http://{where}:{bound} (store {path})", flush=True)

        _Server(config, hub, announce, fd_reserve).run()
    finally:
        log.info("serve.draining")
        rt.close()
        log.info("serve.stopped")
    return 0
