"""A real MCP tool server for tests and demos, built with the official SDK's server side.

``python -m tether.testing.mcp_server`` (stdio) or ``--http 0`` (Streamable HTTP on a free
loopback port; prints its URL). Its tools, ``--hang-handshake`` and ``TETHER_MCP_LOG``:
docs/design.md, section 12.4.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["LOG_ENV", "build_server", "main", "read_log"]

LOG_ENV = "TETHER_MCP_LOG"

_children: list[subprocess.Popen[bytes]] = []  # kept so that they are not reaped early
_log_lock = threading.Lock()


def _log(path: str | None, **record: Any) -> None:
    if path is None:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n"
    with _log_lock, open(path, "a", encoding="utf-8") as f:
        f.write(line)


def read_log(path: str) -> list[dict[str, Any]]:
    """The records the server(s) appended to ``path`` so far, in order."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _params(ctx: ServerRequestContext[Any, Any]) -> Mapping[str, Any]:
    return ctx.params if isinstance(ctx.params, Mapping) else {}


def build_server(log_path: str | None = None) -> MCPServer:
    """The test server; ``log_path`` is where it records what it receives (None: nowhere)."""

    async def record(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        params = _params(ctx)
        extra: dict[str, Any] = {}
        if ctx.method == "notifications/cancelled":
            extra["requestId"] = params.get("requestId")
        if ctx.method == "tools/call":
            extra["tool"] = params.get("name")
        kind = "request" if ctx.request_id is not None else "notification"
        _log(log_path, event=kind, method=ctx.method, id=ctx.request_id, **extra)
        try:
            result = await call_next(ctx)
        except anyio.get_cancelled_exc_class():
            if ctx.request_id is not None:
                _log(log_path, event="handler_cancelled", method=ctx.method, id=ctx.request_id)
            raise
        if ctx.method == "tools/call":
            _log(log_path, event="returned", method=ctx.method, id=ctx.request_id)
        return result

    server = MCPServer("tether-test", middleware=[record])

    @server.tool()
    async def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    async def hang(seconds: float) -> str:
        """Wait this long (an await: a cancel ends it at once), then say so."""
        await anyio.sleep(seconds)
        return f"hung {seconds} s"

    @server.tool()
    async def stubborn(seconds: float) -> str:
        """Block the whole server this long: no cancel or ping is read until it ends."""
        time.sleep(seconds)  # on purpose: work the SDK's cancel cannot interrupt
        return f"stubborn {seconds} s"

    @server.tool()
    async def progress(steps: int, every: float, ctx: Context) -> str:
        """Report progress ``steps`` times, ``every`` seconds apart."""
        for i in range(steps):
            await anyio.sleep(every)
            await ctx.report_progress(i + 1, steps, f"step {i + 1}")
            _log(log_path, event="progress_sent", step=i + 1)
        return f"{steps} steps"

    @server.tool()
    async def spawn_child() -> int:
        """Start a child process that sleeps; return its pid."""
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        _children.append(child)
        return child.pid

    return server


def _record_disconnects(app: ASGIApp, log_path: str | None) -> ASGIApp:
    """The HTTP app, also logging ``http_disconnect`` (with the JSON-RPC id of the POST)
    when a client closes a request's stream before its response ended."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or log_path is None:
            await app(scope, receive, send)
            return
        state: dict[str, Any] = {"done": False, "id": None}

        async def recv() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                with contextlib.suppress(ValueError, AttributeError):
                    state["id"] = json.loads(message.get("body") or b"{}").get("id")
            if message["type"] == "http.disconnect" and not state["done"]:
                _log(log_path, event="http_disconnect", id=state["id"])
            return message

        async def snd(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        await app(scope, recv, snd)

    return wrapped


_HANDSHAKE = ("initialize", "server/discover")  # the 2025 and the 2026-07-28 wire's


def _hang_handshake(app: ASGIApp, log_path: str | None) -> ASGIApp:
    """The HTTP app, except that a handshake request is read and never answered."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await app(scope, receive, send)
            return
        first = await receive()
        body = first.get("body") or b""
        with contextlib.suppress(ValueError, AttributeError):
            method = json.loads(body).get("method")
            if method in _HANDSHAKE:
                _log(log_path, event="handshake_held", method=method)
                await anyio.sleep_forever()
        replayed = False

        async def recv() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        await app(scope, recv, send)

    return wrapped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tether.testing.mcp_server")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve Streamable HTTP")
    parser.add_argument(
        "--hang-handshake", action="store_true", help="never answer the handshake (HTTP only)"
    )
    args = parser.parse_args(argv)
    server = build_server(os.environ.get(LOG_ENV))
    if args.http is None:
        server.run("stdio")
        return
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.http))
    sock.listen(128)  # before the URL is printed: a client that connects at once waits
    port = sock.getsockname()[1]
    app = _record_disconnects(server.streamable_http_app(), os.environ.get(LOG_ENV))
    if args.hang_handshake:
        app = _hang_handshake(app, os.environ.get(LOG_ENV))
    config = uvicorn.Config(app, log_level="warning")
    print(f"http://127.0.0.1:{port}/mcp", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
