"""``tether serve``: the runtime behind JSON-RPC 2.0 (``POST /rpc``) and SSE (``GET /events``),
with the web console and the protocol faces behind the same guard.

The caller acts as ``User(parent=address.parent)``. The request path, the lanes that keep
stops from waiting, and the descriptor reserve: docs/design.md, section 13.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from tether import Event, Runtime
from tether.runtime._log import configure_logging
from tether.serve.face_kit import FaceOptions
from tether.serve.faces import Face, build_faces
from tether.serve.guard import Guard, is_loopback
from tether.serve.limits import (
    DEFAULT_FD_RESERVE,
    Limits,
    free_descriptors,
    gated,
    limit_route,
    raise_descriptor_limit,
    read_capped,
)
from tether.serve.refusals import http_error
from tether.serve.rpc import FAULT_INJECTION_ENV, RpcDispatcher
from tether.serve.sse import EventHub
from tether.serve.token import TOKEN_FILE, blank_is_none, forget_server, note_server, server_token
from tether.serve.web import console_routes
from tether.wire.errors import NotFound, TetherError

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
DEFAULT_MAX_STREAMS: Final = 64  # concurrent GET /events streams
LISTEN_QUEUE: Final = 2048  # the kernel's queue of connections not yet accepted

log = structlog.get_logger("tether.rpc")


_EVENT_ID: Final = re.compile(r"[0-9]{1,19}")  # ASCII digits only: int() takes more


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
        body = await read_capped(request, max_body)
        if body is None:
            return http_error(413, f"request body over {max_body} bytes")
        answer = await dispatcher.handle(body)
        if answer is None:
            return Response(status_code=204)
        return Response(answer, media_type="application/json")

    async def events(request: Request) -> Response:
        session = request.query_params.get("session") or None
        raw_id = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        if raw_id is not None and not _EVENT_ID.fullmatch(raw_id):
            return http_error(400, "Last-Event-ID must be an event id (decimal digits)")
        last_id = None if raw_id is None else int(raw_id)
        if session is not None:
            try:
                await lanes.run(lanes.look, rt.status, session)
            except NotFound:
                return http_error(404, f"no session {session!r}")
            except TetherError as exc:  # a malformed id
                return http_error(400, exc.message)
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
        # The faces keep /rpc's request limits (body size, nesting), from the same code.
        *[limit_route(route, max_body) for face in faces for route in face.routes],
    ]
    app = Guard(Starlette(routes=routes, lifespan=lifespan), token=token)
    return Limits(app, max_streams=max_streams, fd_reserve=fd_reserve)


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
        config.http_protocol_class = gated(config.http_protocol_class, 2 * self._fd_reserve)
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
    tool_user: str | None = None,
    secret_env: Sequence[str] = (),
    on_stop: str = "suspend",
) -> int:
    """Run the server until SIGINT/SIGTERM, then drain the runtime. Returns the exit code.

    ``token``: the bearer token every request needs (semantics §17.4); None, empty or
    blank: the one kept in the file ``token`` beside the store, made if there is none
    (binding beyond loopback needs a token given).
    ``faces``: the driver and config of the roots that MCP and A2A clients open.
    ``otlp``: export traces to this OTLP/HTTP base URL (semantics §16.3); None leaves it to
    the ``OTEL_*`` variables. ``tool_user``, ``secret_env``: the Runtime's. ``on_stop``:
    the close's ``turns`` (``"suspend"``: a recoverable turn recovers at the next start).
    """
    if on_stop not in ("suspend", "cancel"):
        raise ValueError(f"on_stop must be 'suspend' or 'cancel', not {on_stop!r}")
    token = blank_is_none(token)
    if token is None and not is_loopback(host):
        raise ValueError(f"binding {host} (not loopback) requires a token")
    # The host's log is for machines first: one JSON object a line, unless asked otherwise.
    os.environ.setdefault("TETHER_LOG_FORMAT", "json")
    configure_logging()
    soft, hard = raise_descriptor_limit()
    log.info("serve.descriptors", soft=soft, hard=hard, reserve=fd_reserve)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token_path = None
    if token is None:
        token_path = path.parent / TOKEN_FILE
        token = server_token(path.parent)
    rt = Runtime(
        str(path),
        workers=workers,
        grace=grace,
        subreaper=True,
        backend=backend,
        ray_address=ray_address,
        containment=containment,
        telemetry=None if otlp is None else {"endpoint": otlp},
        tool_user=tool_user,
        secret_env=secret_env,
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
            faces=build_faces(rt, dataclasses.replace(faces or FaceOptions(), bearer=True)),
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

        noted: list[int] = []

        def announce(bound: int) -> None:
            where = f"[{host}]" if ":" in host else host
            log.info("serve.listening", url=f"http://{where}:{bound}", store=str(path))
            kept = "" if token_path is None else f", token in {token_path}"
            print(f"tether: serving http://{where}:{bound} (store {path}{kept})", flush=True)
            if token_path is not None:
                note_server(bound, token_path)
                noted.append(bound)

        try:
            _Server(config, hub, announce, fd_reserve).run()
        finally:
            for bound in noted:
                assert token_path is not None
                forget_server(bound, token_path)
    finally:
        log.info("serve.draining", on_stop=on_stop)
        rt.close(turns=on_stop)
        log.info("serve.stopped")
    return 0
