"""MCP tools for agents: servers' tools offered as ``mcp__<server>__<tool>``, and every stop
of a call carried to the server.

One ``McpTools`` per worker, a task per connection and per call. How a call is stopped,
and what each wait is bounded by: docs/design.md, section 12.2.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fnmatch
import json
import os
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, cast

import anyio
import anyio.abc
import httpx2
import mcp_types
import msgspec
import psutil
import structlog
from mcp import Client
from mcp.client._transport import TransportStreams
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._stream_protocols import WriteStream
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from tether.runtime import _procs
from tether.telemetry import spans
from tether.wire.errors import InvalidParams, TetherError

__all__ = ["McpResult", "McpTimeout", "McpTools", "McpUnavailable", "ToolPolicy"]

log = structlog.get_logger("tether.agents.mcp")

Preempt = Literal["cooperative", "kill", "never"]
Fate = Literal["cancelled", "abandoned", "killed"]

_PREFIX = "mcp__"
_SEP = "__"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_POLICY_KEY = re.compile(r"^mcp:[^/]+/.+$")
_CONNECT_TIMEOUT = 30.0  # start (or reach) a server and finish the handshake
_KILL_WAIT = 2.0  # a SIGKILLed tree is gone within this; only an unkillable one runs it out
_CLOSE_WAIT = 5.0  # a connection's owner task unwinds within this, or is cancelled
_EXIT_WAIT = 1.0  # a server that closed its stdout, to exit on its own (for its code)
_LIST_PAGES = 100  # a paginator that never ends cannot hang list_tools
_ERROR_CAP = 500


class ToolPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one tool's calls are bounded and stopped (semantics §15.3)."""

    max_duration: float | None = None  # seconds; exceeded: stopped, McpTimeout
    idle_timeout: float | None = None  # seconds without notifications/progress: the same
    grace: float | None = None  # how long a stopped call may take to end
    preempt: Preempt = "cooperative"


class McpResult(msgspec.Struct, frozen=True):
    """What a call returned: the tool's text, or a one-line error."""

    text: str
    is_error: bool = False
    request_id: str | None = None


class McpTimeout(TetherError):
    """A call exceeded its ``max_duration`` or ``idle_timeout`` and was stopped."""

    code = "mcp-timeout"

    def __init__(self, kind: Literal["max_duration", "idle_timeout"], partial: str) -> None:
        super().__init__(f"mcp call exceeded its {kind}")
        self.kind = kind
        self.partial = partial


class McpUnavailable(TetherError):
    """A server could not be started or reached (the message says which, and why)."""

    code = "mcp-unavailable"


# ---- configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class _Stdio:
    command: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None
    connect_timeout: float


@dataclass(frozen=True)
class _Http:
    url: str
    headers: dict[str, str]
    connect_timeout: float


_Spec = _Stdio | _Http


def _str_map(server: str, key: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidParams(f"mcp server {server!r}: {key!r} must map strings to strings")
    return dict(value)


def _timeout(server: str, conf: dict[str, Any]) -> float:
    value = conf.get("connect_timeout", _CONNECT_TIMEOUT)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidParams(f"mcp server {server!r}: 'connect_timeout' must be a positive number")
    return float(value)


def _parse_server(name: object, conf: object) -> _Spec:
    if not isinstance(name, str) or not _NAME.match(name) or _SEP in name:
        raise InvalidParams(
            f"mcp server name {name!r}: letters, digits, '-' and '_' only, and no '__'"
        )
    if not isinstance(conf, dict):
        raise InvalidParams(f"mcp server {name!r}: its config must be an object")
    if ("command" in conf) == ("url" in conf):
        raise InvalidParams(f"mcp server {name!r}: give exactly one of 'command' or 'url'")
    return _parse_stdio(name, conf) if "command" in conf else _parse_http(name, conf)


def _known_fields(name: str, conf: dict[str, Any], fields: set[str]) -> None:
    unknown = set(conf) - fields
    if unknown:
        raise InvalidParams(f"mcp server {name!r}: unknown field {sorted(unknown)[0]!r}")


def _parse_stdio(name: str, conf: dict[str, Any]) -> _Stdio:
    _known_fields(name, conf, {"command", "env", "cwd", "connect_timeout"})
    command = conf["command"]
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(a, str) and a for a in command)
    ):
        raise InvalidParams(
            f"mcp server {name!r}: 'command' must be a non-empty list of non-empty strings"
        )
    cwd = conf.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise InvalidParams(f"mcp server {name!r}: 'cwd' must be a string")
    env = _str_map(name, "env", conf.get("env", {}))
    return _Stdio(tuple(command), env, cwd, _timeout(name, conf))


def _parse_http(name: str, conf: dict[str, Any]) -> _Http:
    _known_fields(name, conf, {"url", "headers", "connect_timeout"})
    url = conf["url"]
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidParams(f"mcp server {name!r}: 'url' must be an http:// or https:// URL")
    return _Http(url, _str_map(name, "headers", conf.get("headers", {})), _timeout(name, conf))


def _parse_policy(key: object, value: object) -> tuple[str, dict[str, Any]]:
    if not isinstance(key, str) or not (key == "run_command" or _POLICY_KEY.match(key)):
        raise InvalidParams(
            f"tool policy {key!r}: the key must be 'run_command' or 'mcp:<server>/<tool>' "
            "(either part may be a glob)"
        )
    if not isinstance(value, dict):
        raise InvalidParams(f"tool policy {key!r}: must be an object")
    try:
        msgspec.convert(value, ToolPolicy)
    except msgspec.ValidationError as exc:
        raise InvalidParams(f"tool policy {key!r}: {exc}") from None
    for name in ("max_duration", "idle_timeout", "grace"):
        v = value.get(name)
        if v is not None and (v < 0 or (v == 0 and name != "grace")):
            raise InvalidParams(f"tool policy {key!r}: {name!r} must be positive")
    return key, dict(value)


def _policy_key(tool: str) -> str:
    """The name policies are matched against: ``mcp__s__t`` -> ``mcp:s/t``."""
    if tool.startswith(_PREFIX):
        server, sep, name = tool[len(_PREFIX) :].partition(_SEP)
        if sep:
            return f"mcp:{server}/{name}"
    return tool


def _specificity(pattern: str, name: str) -> tuple[int, int]:
    exact = pattern == name
    literal = sum(1 for c in pattern if c not in "*?[]")
    return (int(exact), literal)


# ---- transports ----------------------------------------------------------------------


@dataclass
class _CallState:
    """One call's bookkeeping, shared with the write tap and the progress callback."""

    request_id: str | int | None = None
    last_progress: float = 0.0
    partial: str = ""


class _RunClock:
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
_CALL: contextvars.ContextVar[_CallState | None] = contextvars.ContextVar("mcp_call", default=None)


class _TapWrite:
    """A write stream that notes each ``tools/call`` request's id on the calling task's
    ``_CallState``, then passes the message on unchanged."""

    def __init__(self, inner: WriteStream[SessionMessage]) -> None:
        self._inner = inner

    async def send(self, item: SessionMessage, /) -> None:
        msg = item.message
        if isinstance(msg, mcp_types.JSONRPCRequest) and msg.method == "tools/call":
            state = _CALL.get()
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
async def _tapped(
    transport: AbstractAsyncContextManager[TransportStreams],
) -> AsyncIterator[TransportStreams]:
    async with transport as (read, write):
        yield read, _TapWrite(write)


def _kill_tree(pid: int) -> list[psutil.Process]:
    """Kill ``pid``'s tree deepest first (the abort's kill, ``_procs``)."""
    with contextlib.suppress(OSError):  # out of descriptors: the caller's wait sees survivors
        return _procs.kill_tree([pid])
    return []


async def _wait_dead(procs: list[psutil.Process], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        procs = [p for p in procs if _procs.alive(p)]
        if not procs:
            return True
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.005)


async def _exited(conn: _Conn, timeout: float) -> None:
    """Wait (bounded) for a stdio server to exit on its own."""
    deadline = asyncio.get_running_loop().time() + timeout
    while conn.proc is not None and conn.proc.returncode is None:
        if asyncio.get_running_loop().time() >= deadline:
            return
        await asyncio.sleep(0.01)


@dataclass(eq=False)
class _Conn:
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


async def _kill(conn: _Conn) -> None:
    """Kill a stdio server's tree now and wait (bounded) for it to be gone. ``killed``
    says that we ended it: a server that had already exited keeps its own exit code."""
    conn.dead = True
    conn.stop.set()  # first: a cancel of the wait below must not leave the owner waiting
    if conn.proc is not None and not conn.killed:
        pid = conn.proc.pid
        with contextlib.suppress(psutil.NoSuchProcess):
            conn.killed = _procs.alive(psutil.Process(pid))
        procs = _kill_tree(pid)
        if not await _wait_dead(procs, _KILL_WAIT):
            log.warning("mcp.kill_survivors", server=conn.server, pid=pid)
        # tools re-parented to us (a subreaper) are ours to collect; the server itself is
        # asyncio's child and is reaped by its watcher
        _procs.reap(p.pid for p in procs if p.pid != pid)
        if conn.killed:
            log.info("mcp.server_killed", server=conn.server, pid=pid, processes=len(procs))


@asynccontextmanager
async def _stdio(spec: _Stdio, conn: _Conn) -> AsyncIterator[TransportStreams]:
    """Run the server as our child, in our process group (so a pause's group stop and an
    abort's walk both reach it, as they reach ``run_command``), with the SDK's safe
    environment, the tree tag and the configured variables."""
    env = get_default_environment()
    if _procs.TREE_ENV in os.environ:
        env[_procs.TREE_ENV] = os.environ[_procs.TREE_ENV]
    env.update(spec.env)
    proc = await anyio.open_process(list(spec.command), env=env, cwd=spec.cwd, stderr=None)
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
                        await _kill(conn)
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
async def _http(spec: _Http) -> AsyncIterator[TransportStreams]:
    timeout = httpx2.Timeout(spec.connect_timeout, read=300.0)
    async with (
        httpx2.AsyncClient(headers=spec.headers, timeout=timeout) as http,
        streamable_http_client(spec.url, http_client=http) as streams,
    ):
        yield streams


# ---- the tools -----------------------------------------------------------------------


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _ERROR_CAP else line[: _ERROR_CAP - 1] + "…"


def _reason(exc: BaseException) -> str:
    """One line saying why: the first real error inside the SDK's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, TimeoutError):
        return "timed out"
    return _one_line(str(exc) or type(exc).__name__)


def _result_text(result: mcp_types.CallToolResult) -> str:
    parts = []
    for item in result.content:
        if isinstance(item, mcp_types.TextContent):
            parts.append(item.text)
        else:
            parts.append(f"[{item.type} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def _retrieve(task: asyncio.Task[Any]) -> None:
    # an abandoned call's late end (its result or error) is dropped here, never shown
    if not task.cancelled():
        task.exception()


class McpTools:
    """The MCP servers of one worker, their tools, and the stop of every call."""

    def __init__(
        self,
        servers: dict[str, dict[str, Any]],
        *,
        policies: dict[str, dict[str, Any]] | None = None,
        grace: float = 5.0,
    ) -> None:
        if not isinstance(servers, dict):
            raise InvalidParams("mcp servers: must be an object of name -> config")
        if isinstance(grace, bool) or not isinstance(grace, int | float) or grace < 0:
            raise InvalidParams("mcp grace: must be a number of seconds >= 0")
        self._specs: dict[str, _Spec] = {n: _parse_server(n, c) for n, c in servers.items()}
        if policies is not None and not isinstance(policies, dict):
            raise InvalidParams("tool policies: must be an object of name -> policy")
        self._policies = dict(_parse_policy(k, v) for k, v in (policies or {}).items())
        self._grace = float(grace)
        self._conns: dict[str, _Conn] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.last_fate: str | None = None

    # -- policies

    def policy(self, tool: str) -> ToolPolicy:
        """The policy of ``tool`` (``mcp__<server>__<tool>`` or ``run_command``): every
        matching entry applies, a more specific one's fields over a less specific one's
        (an exact name over any glob, then the glob with more literal characters)."""
        name = _policy_key(tool)
        matches = sorted(
            (k for k in self._policies if k == name or fnmatch.fnmatchcase(name, k)),
            key=lambda k: _specificity(k, name),
        )
        fields: dict[str, Any] = {"grace": self._grace}
        for key in matches:
            fields.update(self._policies[key])
        return msgspec.convert(fields, ToolPolicy)

    # -- connections

    @property
    def servers(self) -> tuple[str, ...]:
        """The configured servers' names."""
        return tuple(sorted(self._specs))

    def server_pids(self) -> dict[str, int]:
        """The pids of the stdio servers running now."""
        return {
            name: conn.proc.pid
            for name, conn in self._conns.items()
            if conn.proc is not None and conn.alive()
        }

    async def _conn(self, server: str) -> _Conn:
        lock = self._locks.setdefault(server, asyncio.Lock())
        async with lock:
            conn = self._conns.get(server)
            if conn is not None and conn.alive():
                return conn
            if conn is not None:  # died or was killed: replace it
                await self._retire(conn)
            conn = await self._open(server)
            self._conns[server] = conn
            return conn

    async def _open(self, server: str) -> _Conn:
        spec = self._specs[server]
        conn = _Conn(server)
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        # an outcome that arrives after we stopped waiting (a timeout) is nobody's news
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        conn.owner = asyncio.create_task(self._own(spec, conn, ready), name=f"mcp:{server}")
        try:
            async with asyncio.timeout(spec.connect_timeout):
                conn.client = await asyncio.shield(ready)
        except BaseException as exc:
            await self._retire(conn)
            if isinstance(exc, Exception):
                code = conn.proc.returncode if conn.proc is not None else None
                how = (
                    f" (it exited with code {code})" if code is not None and not conn.killed else ""
                )
                raise McpUnavailable(
                    f"mcp server {server!r} could not start: {_reason(exc)}{how}"
                ) from exc
            raise
        return conn

    async def _own(self, spec: _Spec, conn: _Conn, ready: asyncio.Future[Client]) -> None:
        """The connection's owner task: enters the SDK client, holds it until told to stop
        (or the server is gone), then leaves it (the transport stops the server)."""
        transport = _stdio(spec, conn) if isinstance(spec, _Stdio) else _http(spec)
        client = Client(
            cast(Any, _tapped(transport)),
            mode="auto",
            cache=None,
            client_info=mcp_types.Implementation(name="tether", version="3"),
        )
        try:
            async with client:
                if not ready.done():
                    ready.set_result(client)
                conn.holding = True
                await conn.stop.wait()
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.info("mcp.connection_ended", server=conn.server, error=_one_line(repr(exc)))
        finally:
            conn.dead = True
            if not ready.done():
                ready.cancel()

    async def _retire(self, conn: _Conn) -> None:
        """Stop a connection: kill a stdio server's tree, leave the SDK client, bounded."""
        if self._conns.get(conn.server) is conn:
            del self._conns[conn.server]
        if conn.proc is not None and conn.proc.returncode is None:
            await _kill(conn)
        conn.dead = True
        conn.stop.set()
        if conn.owner is None:
            return
        if not conn.holding:
            # still connecting (a server slow to answer initialize): the owner is not
            # waiting on ``stop`` yet and would only see it once the handshake ends, so
            # waiting for it would stall a cancel for the whole close wait
            conn.owner.cancel()
        done, _ = await asyncio.wait({conn.owner}, timeout=_CLOSE_WAIT)
        if not done:
            conn.owner.cancel()
            await asyncio.wait({conn.owner}, timeout=_CLOSE_WAIT)

    async def aclose(self) -> None:
        """Stop every server (a stdio server's whole tree is killed) and close every
        connection. The tools can be used again afterwards: servers start on next use."""
        conns = list(self._conns.values())
        self._conns.clear()
        await asyncio.gather(*(self._retire(c) for c in conns))

    # -- tools

    async def list_tools(self) -> list[dict[str, Any]]:
        """Every server's tools as OpenAI function-tool specs, named
        ``mcp__<server>__<tool>``, with the tool's own input schema; the first server
        that cannot be reached raises ``McpUnavailable``."""
        specs, missing = await self.offered()
        if missing:
            raise McpUnavailable(next(iter(missing.values())))
        return specs

    async def offered(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """The tools of every server that answered (as ``list_tools``), and each server
        that did not, with its one-line reason: one server that will not start does not
        take the others' tools away."""
        specs: list[dict[str, Any]] = []
        missing: dict[str, str] = {}
        for server in sorted(self._specs):
            try:
                specs.extend(await self._server_tools(server))
            except McpUnavailable as exc:
                missing[server] = exc.message
        return specs, missing

    async def _server_tools(self, server: str) -> list[dict[str, Any]]:
        conn = await self._conn(server)
        assert conn.client is not None
        specs: list[dict[str, Any]] = []
        cursor: str | None = None
        try:
            async with asyncio.timeout(self._specs[server].connect_timeout):
                for _ in range(_LIST_PAGES):
                    page = await conn.client.session.list_tools(
                        params=mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
                    )
                    for tool in page.tools:
                        specs.append(
                            {
                                "type": "function",
                                "function": {
                                    "name": f"{_PREFIX}{server}{_SEP}{tool.name}",
                                    "description": tool.description or tool.title or "",
                                    "parameters": tool.input_schema,
                                },
                            }
                        )
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except (MCPError, TimeoutError) as exc:
            raise McpUnavailable(
                f"mcp server {server!r} did not list its tools: {_reason(exc)}"
            ) from exc
        return specs

    def _split(self, name: str) -> tuple[str, str]:
        server, sep, tool = name[len(_PREFIX) :].partition(_SEP)
        if not name.startswith(_PREFIX) or not sep or not tool:
            raise InvalidParams(f"{name!r} is not an MCP tool name (mcp__<server>__<tool>)")
        if server not in self._specs:
            raise InvalidParams(f"{name!r}: no MCP server named {server!r}")
        return server, tool

    async def call(
        self,
        name: str,
        arguments: dict[str, Any],
        *,
        on_progress: Callable[[], None] | None = None,
        on_stop: Callable[[Fate, str], None] | None = None,
    ) -> McpResult:
        """Call ``mcp__<server>__<tool>``. A tool's error, or a server that died under
        the call, is an ``McpResult`` with ``is_error``; a cancel of the awaiting task
        stops the call and re-raises; a policy limit stops it the same way and raises
        ``McpTimeout``. A stopped call's fate and its output so far (the last progress
        notice, or "") go to ``on_stop``: this call's own, whatever calls run alongside
        it, and never for a call that was not stopped. ``last_fate`` is the latest
        call's fate: an answer only for one call at a time."""
        server, tool = self._split(name)
        policy = self.policy(name)
        loop = asyncio.get_running_loop()
        self.last_fate = None
        try:
            conn = await self._conn(server)
        except McpUnavailable as exc:
            return McpResult(exc.message, is_error=True)
        assert conn.client is not None
        clock = _RunClock(loop)
        state = _CallState(last_progress=clock.now())

        async def progressed(progress: float, total: float | None, message: str | None) -> None:
            state.last_progress = clock.now()
            of = f"/{total:g}" if total is not None else ""
            state.partial = f"progress {progress:g}{of}" + (f": {message}" if message else "")
            if on_progress is not None:
                on_progress()

        token = _CALL.set(state)
        # The call's trace context rides in the request (semantics §16.3): a server that
        # traces joins the caller's trace.
        traceparent = spans.traceparent()
        meta = None if traceparent is None else {"traceparent": traceparent}
        try:
            inner = asyncio.create_task(
                conn.client.call_tool(
                    tool, arguments, progress_callback=progressed, meta=cast(Any, meta)
                )
            )
        finally:
            _CALL.reset(token)
        inner.add_done_callback(_retrieve)
        started = clock.now()
        kind: Literal["max_duration", "idle_timeout"]
        try:
            while True:
                now = clock.now()
                limits: list[tuple[float, Literal["max_duration", "idle_timeout"]]] = []
                if policy.max_duration is not None:
                    limits.append((started + policy.max_duration, "max_duration"))
                if policy.idle_timeout is not None:
                    limits.append((state.last_progress + policy.idle_timeout, "idle_timeout"))
                due = min(limits, default=None)
                if due is not None and due[0] <= now:
                    kind = due[1]
                    break
                await clock.wait(inner, None if due is None else due[0] - now)
                if inner.done():
                    return self._ended(conn, inner, state)
        except asyncio.CancelledError:
            fate, _ = await self._stop_bounded(conn, inner, state, policy, "cancel")
            self._stopped(fate, state, on_stop)
            raise
        fate, interrupted = await self._stop_bounded(conn, inner, state, policy, kind)
        self._stopped(fate, state, on_stop)
        if interrupted:
            raise asyncio.CancelledError
        raise McpTimeout(kind, state.partial)

    def _stopped(
        self, fate: Fate, state: _CallState, on_stop: Callable[[Fate, str], None] | None
    ) -> None:
        self.last_fate = fate
        if on_stop is not None:
            on_stop(fate, state.partial)

    def _ended(self, conn: _Conn, inner: asyncio.Task[Any], state: _CallState) -> McpResult:
        rid = None if state.request_id is None else str(state.request_id)
        exc = None if inner.cancelled() else inner.exception()
        if exc is None and not inner.cancelled():
            result = inner.result()
            return McpResult(_result_text(result), is_error=bool(result.is_error), request_id=rid)
        closed = isinstance(exc, MCPError) and exc.code == mcp_types.CONNECTION_CLOSED
        if inner.cancelled() or closed or not conn.alive():
            # the server died (or the connection dropped) under the call: a new one next time
            conn.dead = True
            code = conn.proc.returncode if conn.proc is not None else None
            how = f" (exit code {code})" if code is not None else ""
            log.warning("mcp.server_died", server=conn.server, request_id=rid, exit_code=code)
            return McpResult(
                f"mcp server {conn.server!r} ended during the call{how}",
                is_error=True,
                request_id=rid,
            )
        if isinstance(exc, MCPError):
            return McpResult(_one_line(exc.message), is_error=True, request_id=rid)
        return McpResult(_one_line(f"{type(exc).__name__}: {exc}"), is_error=True, request_id=rid)

    async def _stop_bounded(
        self, conn: _Conn, inner: asyncio.Task[Any], state: _CallState, policy: ToolPolicy, why: str
    ) -> tuple[Fate, bool]:
        """Run the stop to its end even if the caller is cancelled again meanwhile (it is
        bounded: grace, then a kill); say whether such a cancel arrived."""
        stopper = asyncio.ensure_future(self._stop(conn, inner, state, policy, why))
        interrupted = False
        while True:
            try:
                return await asyncio.shield(stopper), interrupted
            except asyncio.CancelledError:
                if stopper.done():
                    return stopper.result(), True
                interrupted = True

    async def _stop(
        self, conn: _Conn, inner: asyncio.Task[Any], state: _CallState, policy: ToolPolicy, why: str
    ) -> Fate:
        loop = asyncio.get_running_loop()
        grace = policy.grace if policy.grace is not None else self._grace
        deadline = loop.time() + grace
        fate: Fate
        if inner.done():
            fate = "cancelled"  # it ended as the stop came: its result is dropped
        elif policy.preempt == "kill" and conn.proc is not None:
            await _kill(conn)
            inner.cancel()
            fate = "killed"
        else:
            # the SDK sends notifications/cancelled (stdio) or closes the stream (HTTP)
            inner.cancel()
            ended = False
            if policy.preempt != "kill":
                await asyncio.wait({inner}, timeout=grace)
                ended = inner.done() and await self._answers(conn, deadline - loop.time())
            fate = "cancelled" if ended else "abandoned"
            if not ended and conn.proc is not None:
                await _kill(conn)
        log.info(
            "mcp.call_stopped",
            server=conn.server,
            request_id=state.request_id,
            why=why,
            preempt=policy.preempt,
            fate=fate,
        )
        return fate

    async def _answers(self, conn: _Conn, timeout: float) -> bool:
        """Whether the server answers a probe within ``timeout``: it read what we sent
        before it (the cancel) and is not stuck. Any answer counts, an error included."""
        if timeout <= 0 or conn.client is None or not conn.alive():
            return False
        try:
            async with asyncio.timeout(timeout):
                await conn.client.session.send_ping()
        except MCPError as exc:
            return exc.code not in (mcp_types.CONNECTION_CLOSED, mcp_types.REQUEST_TIMEOUT)
        except Exception:
            return False
        return True
