"""One connection to one server (a task that owns it), and what a call's task shares with it.

How each wait is bounded and how a server's tree is killed: docs/design.md, section 12.2.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import httpx2
import mcp_types
import psutil
import structlog
from mcp import Client
from mcp.client._transport import TransportStreams
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._stream_protocols import WriteStream
from mcp.shared.message import SessionMessage

from tether.agents.mcp._config import Http, Stdio
from tether.contain.procs import TREE_ENV, alive, kill_tree, reap
from tether.driver.toolenv import spawn_options, tool_env

__all__ = [
    "CURRENT_CALL",
    "CallState",
    "Conn",
    "RunClock",
    "http_transport",
    "kill_conn",
    "stdio_transport",
    "tapped",
]

log = structlog.get_logger("tether.agents.mcp")

_KILL_WAIT = 2.0  # a SIGKILLed tree is gone within this; only an unkillable one runs it out
_EXIT_WAIT = 1.0  # a server that closed its stdout, to exit on its own (for its code)


# ---- transports ----------------------------------------------------------------------


@dataclass
class CallState:
    """One call's bookkeeping, shared with the write tap and the progress callback."""

    request_id: str | int | None = None
    last_progress: float = 0.0
    partial: str = ""


class RunClock:
    """Seconds of this process's running time: ``loop.time()`` less the time it stood
    stopped (a pause SIGSTOPs the worker and its servers; a call's limits must not fire
    the moment it resumes). A wait sliced to ``_TICK`` that woke ``_STOPPED`` or more
    late was a stop (or a starvation as long, which no limit should be charged either)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stopped = 0.0

    def now(self) -> float:
        return self._loop.time() - self._stopped

    async def wait(self, task: asyncio.Task[Any], timeout: float | None) -> None:
        """Wait for ``task`` up to ``timeout`` running seconds."""
        if timeout is None:  # no limit to keep: nothing to measure
            await asyncio.wait({task})
            return
        left = timeout
        while not task.done() and left > 0:
            tick = min(_TICK, left)
            began = self._loop.time()
            await asyncio.wait({task}, timeout=tick)
            took = self._loop.time() - began
            late = took - tick
            if late >= _STOPPED:
                self._stopped += late
                took = tick
            left -= took


_TICK = 0.25
_STOPPED = 1.0


# The call whose tools/call the current task is writing: the tap reads it to learn the
# request id the SDK chose (it has no public way to say), which a stop and a test need.
CURRENT_CALL: contextvars.ContextVar[CallState | None] = contextvars.ContextVar(
    "mcp_call", default=None
)


class _TapWrite:
    """A write stream that notes each ``tools/call`` request's id on the calling task's
    ``CallState``, then passes the message on unchanged."""

    def __init__(self, inner: WriteStream[SessionMessage]) -> None:
        self._inner = inner

    async def send(self, item: SessionMessage, /) -> None:
        msg = item.message
        if isinstance(msg, mcp_types.JSONRPCRequest) and msg.method == "tools/call":
            state = CURRENT_CALL.get()
            if state is not None:
                state.request_id = msg.id
        await self._inner.send(item)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _TapWrite:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        await self.aclose()


@asynccontextmanager
async def tapped(
    transport: AbstractAsyncContextManager[TransportStreams],
) -> AsyncIterator[TransportStreams]:
    async with transport as (read, write):
        yield read, _TapWrite(write)


def _kill_tree(pid: int) -> list[psutil.Process]:
    """Kill ``pid``'s tree deepest first (the abort's kill, ``tether.contain.procs``)."""
    with contextlib.suppress(OSError):  # out of descriptors: the caller's wait sees survivors
        return kill_tree([pid])
    return []


async def _wait_dead(procs: list[psutil.Process], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        procs = [p for p in procs if alive(p)]
        if not procs:
            return True
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.005)


async def _exited(conn: Conn, timeout: float) -> None:
    """Wait (bounded) for a stdio server to exit on its own."""
    deadline = asyncio.get_running_loop().time() + timeout
    while conn.proc is not None and conn.proc.returncode is None:
        if asyncio.get_running_loop().time() >= deadline:
            return
        await asyncio.sleep(0.01)


@dataclass(eq=False)
class Conn:
    server: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    client: Client | None = None
    owner: asyncio.Task[None] | None = None
    proc: anyio.abc.Process | None = None  # stdio only
    dead: bool = False  # died or killed: replaced at the next use
    killed: bool = False
    holding: bool = False  # the owner holds the client and waits on ``stop``

    def alive(self) -> bool:
        return not self.dead and (self.proc is None or self.proc.returncode is None)


async def kill_conn(conn: Conn) -> None:
    """Kill a stdio server's tree now and wait (bounded) for it to be gone. ``killed``
    says that we ended it: a server that had already exited keeps its own exit code."""
    conn.dead = True
    conn.stop.set()  # first: a cancel of the wait below must not leave the owner waiting
    if conn.proc is not None and not conn.killed:
        pid = conn.proc.pid
        with contextlib.suppress(psutil.NoSuchProcess):
            conn.killed = alive(psutil.Process(pid))
        procs = _kill_tree(pid)
        if not await _wait_dead(procs, _KILL_WAIT):
            log.warning("mcp.kill_survivors", server=conn.server, pid=pid)
        # tools re-parented to us (a subreaper) are ours to collect; the server itself is
        # asyncio's child and is reaped by its watcher
        reap(p.pid for p in procs if p.pid != pid)
        if conn.killed:
            log.info("mcp.server_killed", server=conn.server, pid=pid, processes=len(procs))


@asynccontextmanager
async def stdio_transport(spec: Stdio, conn: Conn) -> AsyncIterator[TransportStreams]:
    """Run the server as our child, in our process group (so a pause's group stop and an
    abort's walk both reach it, as they reach ``run_command``), with the SDK's safe
    environment, the tree tag and the configured variables, as the tool user where one
    is set (semantics §17.4)."""
    env = tool_env(get_default_environment())  # as the tool user names it, if one is set
    if TREE_ENV in os.environ:
        env[TREE_ENV] = os.environ[TREE_ENV]
    env.update(spec.env)
    proc = await anyio.open_process(
        list(spec.command), env=env, cwd=spec.cwd, stderr=None, **spawn_options()
    )
    conn.proc = proc
    log.info("mcp.server_started", server=conn.server, pid=proc.pid)
    read_in, read_out = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_in, write_out = anyio.create_memory_object_stream[SessionMessage](0)

    closed_stdout = False

    async def reader() -> None:
        nonlocal closed_stdout
        assert proc.stdout is not None
        buffer = b""
        async with read_in:
            with contextlib.suppress(
                anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream
            ):
                async for chunk in proc.stdout:
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for line in lines:
                        if not line.strip():
                            continue
                        item: SessionMessage | Exception
                        try:
                            item = SessionMessage(
                                mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                            )
                        except ValueError as exc:
                            item = exc  # the session reports it; the connection goes on
                        await read_in.send(item)
                closed_stdout = True

    async def writer() -> None:
        assert proc.stdin is not None
        async with write_out:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                async for message in write_out:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await proc.stdin.send(data.encode() + b"\n")
        # the server cannot be written to any more: end the session's reads too
        await read_in.aclose()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(writer)
            try:
                yield read_out, write_in
            finally:
                with anyio.CancelScope(shield=True):
                    if closed_stdout:  # it is most often exiting: let it, for its code
                        await _exited(conn, _EXIT_WAIT)
                    if proc.returncode is None:
                        await kill_conn(conn)
                    with anyio.move_on_after(_KILL_WAIT):
                        await proc.wait()
                tg.cancel_scope.cancel()
    finally:
        conn.dead = True
        for stream in (read_in, read_out, write_in, write_out):
            stream.close()
        # close the pipes and the asyncio transport now, not at garbage collection
        with contextlib.suppress(Exception), anyio.move_on_after(_KILL_WAIT, shield=True):
            await proc.aclose()


@asynccontextmanager
async def http_transport(spec: Http) -> AsyncIterator[TransportStreams]:
    timeout = httpx2.Timeout(spec.connect_timeout, read=300.0)
    async with (
        httpx2.AsyncClient(headers=spec.headers, timeout=timeout) as http,
        streamable_http_client(spec.url, http_client=http) as streams,
    ):
        yield streams
