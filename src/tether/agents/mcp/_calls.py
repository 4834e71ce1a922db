"""``McpTools``: one per worker; a task per connection and per call, and every stop of a
call carried to its server (docs/design.md, section 12.2)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Literal, cast

import mcp_types
import structlog
from mcp import Client
from mcp.shared.exceptions import MCPError

from tether.agents.mcp._config import (
    PREFIX,
    SEP,
    Spec,
    Stdio,
    ToolPolicy,
    parse_policy,
    parse_server,
    resolve_policy,
)
from tether.agents.mcp._results import McpResult, McpTimeout, McpUnavailable
from tether.agents.mcp._transport import (
    CURRENT_CALL,
    CallState,
    Conn,
    RunClock,
    http_transport,
    kill_conn,
    stdio_transport,
    tapped,
)
from tether.driver.calls import CALL_META, current_call_id
from tether.telemetry import spans
from tether.wire.errors import InvalidParams

__all__ = ["McpTools"]

log = structlog.get_logger("tether.agents.mcp")

Fate = Literal["cancelled", "abandoned", "killed"]

_CLOSE_WAIT = 5.0  # a connection's owner task unwinds within this, or is cancelled
_LIST_PAGES = 100  # a paginator that never ends cannot hang list_tools
_ERROR_CAP = 500


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
        self._specs: dict[str, Spec] = {n: parse_server(n, c) for n, c in servers.items()}
        if policies is not None and not isinstance(policies, dict):
            raise InvalidParams("tool policies: must be an object of name -> policy")
        self._policies = dict(parse_policy(k, v) for k, v in (policies or {}).items())
        self._grace = float(grace)
        self._conns: dict[str, Conn] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.last_fate: str | None = None

    # -- policies

    def policy(self, tool: str) -> ToolPolicy:
        """The policy of ``tool`` (``mcp__<server>__<tool>`` or ``run_command``): every
        matching entry applies, a more specific one's fields over a less specific one's
        (an exact name over any glob, then the glob with more literal characters)."""
        return resolve_policy(self._policies, tool, self._grace)

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

    async def _conn(self, server: str) -> Conn:
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

    async def _open(self, server: str) -> Conn:
        spec = self._specs[server]
        conn = Conn(server)
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

    async def _own(self, spec: Spec, conn: Conn, ready: asyncio.Future[Client]) -> None:
        """The connection's owner task: enters the SDK client, holds it until told to stop
        (or the server is gone), then leaves it (the transport stops the server)."""
        transport = stdio_transport(spec, conn) if isinstance(spec, Stdio) else http_transport(spec)
        client = Client(
            cast(Any, tapped(transport)),
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

    async def _retire(self, conn: Conn) -> None:
        """Stop a connection: kill a stdio server's tree, leave the SDK client, bounded."""
        if self._conns.get(conn.server) is conn:
            del self._conns[conn.server]
        if conn.proc is not None and conn.proc.returncode is None:
            await kill_conn(conn)
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
                                    "name": f"{PREFIX}{server}{SEP}{tool.name}",
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
        server, sep, tool = name[len(PREFIX) :].partition(SEP)
        if not name.startswith(PREFIX) or not sep or not tool:
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
        clock = RunClock(loop)
        state = CallState(last_progress=clock.now())

        async def progressed(progress: float, total: float | None, message: str | None) -> None:
            state.last_progress = clock.now()
            of = f"/{total:g}" if total is not None else ""
            state.partial = f"progress {progress:g}{of}" + (f": {message}" if message else "")
            if on_progress is not None:
                on_progress()

        token = CURRENT_CALL.set(state)
        # The call's trace context rides in the request (semantics §16.3): a server that
        # traces joins the caller's trace.
        traceparent = spans.traceparent()
        meta: dict[str, str] = {} if traceparent is None else {"traceparent": traceparent}
        key = current_call_id()
        if key is not None:  # the call's key, for a server that makes itself idempotent
            meta[CALL_META] = key
        try:
            inner = asyncio.create_task(
                conn.client.call_tool(
                    tool, arguments, progress_callback=progressed, meta=cast(Any, meta or None)
                )
            )
        finally:
            CURRENT_CALL.reset(token)
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
        self, fate: Fate, state: CallState, on_stop: Callable[[Fate, str], None] | None
    ) -> None:
        self.last_fate = fate
        if on_stop is not None:
            on_stop(fate, state.partial)

    def _ended(self, conn: Conn, inner: asyncio.Task[Any], state: CallState) -> McpResult:
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
        self, conn: Conn, inner: asyncio.Task[Any], state: CallState, policy: ToolPolicy, why: str
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
        self, conn: Conn, inner: asyncio.Task[Any], state: CallState, policy: ToolPolicy, why: str
    ) -> Fate:
        loop = asyncio.get_running_loop()
        grace = policy.grace if policy.grace is not None else self._grace
        deadline = loop.time() + grace
        fate: Fate
        if inner.done():
            fate = "cancelled"  # it ended as the stop came: its result is dropped
        elif policy.preempt == "kill" and conn.proc is not None:
            await kill_conn(conn)
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
                await kill_conn(conn)
        log.info(
            "mcp.call_stopped",
            server=conn.server,
            request_id=state.request_id,
            why=why,
            preempt=policy.preempt,
            fate=fate,
        )
        return fate

    async def _answers(self, conn: Conn, timeout: float) -> bool:
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
