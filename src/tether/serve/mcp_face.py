"""The MCP face: Tether's subagents as tools of any MCP client (stdio and Streamable HTTP).

The client is a ``User`` holding the roots it opened; the runtime decides authority as on
``/rpc``. Who a client is, over each transport: docs/design.md, section 13.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Final, Literal

import anyio
import anyio.to_thread
import mcp_types as types
import msgspec
import structlog
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from msgspec import UNSET, Meta, UnsetType
from starlette.routing import BaseRoute, Route

from tether import OneShot, Runtime, User
from tether.driver.tools import (
    DecideApprovalArgs,
    InterruptAgentArgs,
    ListAgentsArgs,
    PauseAgentArgs,
    ResumeAgentArgs,
    SendMessageArgs,
    SpawnAgentArgs,
    parameters,
)
from tether.driver.tools import StopReportArgs as ToolStopReportArgs
from tether.serve.face_kit import FaceOptions, last_seq, turn_entries, turn_of_message
from tether.wire.errors import InvalidParams, NotFound, TetherError, Unauthorized

__all__ = ["OWNER_HEADER", "TOOLS", "McpFace", "McpHttp", "run_stdio"]

log = structlog.get_logger("tether.mcp")

_POLL: Final = 0.05  # seconds between two looks while a call waits
_PROGRESS_EVERY: Final = 1.0  # seconds between progress notifications while waiting
_MAX_DEPTH: Final = 64  # the lineage walk is bounded, as the runtime's (semantics §6)
_STDIO: Final = "stdio"
OWNER_HEADER: Final = "tether-owner"  # an HTTP client's owner id, kept across connections
_MAX_OWNER: Final = 256

# ---- arguments: the tether.tools Structs, extended --------------------------------------

_AgentId = Annotated[str, Meta(min_length=1, max_length=256, description="The agent's id.")]
_Wait = Annotated[
    bool,
    Meta(
        description="Wait for the turn this starts to end and return its outcome and final "
        "text (default false). Cancelling the call ends the wait, not the agent."
    ),
]
_Timeout = Annotated[
    float, Meta(gt=0, le=86400, description="Seconds to wait at most (default 600).")
]
_BudgetObject = Annotated[
    dict[str, Any],
    Meta(
        description='A budget for the agent and every agent below it, e.g. {"tokens": 200000, '
        '"cost_usd": 2.0, "turn_seconds": 600, "turns": 40, "soft": 0.8, "on_soft": "steer", '
        '"on_hard": "cancel"} (any of the four limits, at least one). Below a budgeted '
        "agent it must fit in what that tree has left."
    ),
]


class SpawnArgs(SpawnAgentArgs):
    """Start an agent and give it a task. Without parent: a new root agent that you own
    (the server's configured driver). With parent (an agent you own, or one below it):
    a child of that agent. Returns its id; it can then be messaged, steered, cancelled,
    paused and read."""

    parent: (
        Annotated[str, Meta(min_length=1, description="The agent to spawn it under.")] | UnsetType
    ) = UNSET
    # The budget of the agent and its subtree (semantics §16.2): a plain object, as in
    # tether.tools, checked as tether.Budget by the runtime.
    budget: _BudgetObject | UnsetType = UNSET
    wait: _Wait = False
    timeout: _Timeout = 600.0


class SendArgs(SendMessageArgs):
    """Send a message to an agent you own (or one below it); it starts a turn unless wake
    is false, or queues behind the running one."""

    to: _AgentId
    wait: _Wait = False
    timeout: _Timeout = 600.0


class InterruptArgs(InterruptAgentArgs):
    """Interrupt an agent you own (or one below it).

    steer: redirect it at its next step with your text as guidance; cancel: ask it to
    wrap up and stop (keeps partial work); abort: kill its turn now; preempt: kill only
    its current command and let it go on. Returns the turn it was bound to (null: no-op,
    e.g. nothing running, or turn given and no longer the running one); with scope
    subtree (cancel or abort), the turns of that agent and of every agent below it.
    """

    agent: _AgentId
    turn: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=256,
                description="Act only if this is still its running turn (else a no-op).",
            ),
        ]
        | UnsetType
    ) = UNSET
    grace: (
        Annotated[float, Meta(ge=0, description="Seconds a cancelled turn gets to wrap up.")]
        | UnsetType
    ) = UNSET
    deadline: (
        Annotated[
            float, Meta(ge=0, description="Abort a cancel that reaches no boundary this soon.")
        ]
        | UnsetType
    ) = UNSET


class PauseArgs(PauseAgentArgs):
    """Pause an agent you own (or one below it): freeze its running turn in place,
    keeping everything, until you resume it. Returns the turns paused."""

    agent: _AgentId


class ResumeArgs(ResumeAgentArgs):
    """Resume an agent you paused: its turn goes on where it was. Returns the turns resumed."""

    agent: _AgentId


class ListArgs(ListAgentsArgs):
    """List agents with their state (running, idle, parked, paused, ...), inbox size and
    running turn. Without agent: the roots you own (with their subtrees when scope is
    descendants); with agent: the agents below it."""

    agent: _AgentId | UnsetType = UNSET


class _Args(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ReadTranscriptArgs(_Args):
    """Read an agent's transcript, oldest first, one page at a time: user messages, its
    replies, tool calls and the markers of every steer, cancel, pause and stop."""

    agent: _AgentId
    after: Annotated[int, Meta(ge=0, description="Start after this entry seq (default 0).")] = 0
    limit: Annotated[int, Meta(ge=1, le=500, description="Entries at most (default 100).")] = 100


class StopReportArgs(ToolStopReportArgs):
    """What a stop (cancel, abort, preempt) did to one turn of an agent you own (or one
    below it): who asked and when, how long it took to land, how, every process it
    killed and whether it died, every tool call it cut and how that ended, and the
    partial reply. Returns {"report": null} if no stop reached that turn."""


class WaitAgentArgs(_Args):
    """Wait until an agent you own (or one below it) has no running turn; returns its
    status. Cancelling the call ends the wait, not the agent."""

    agent: _AgentId
    timeout: _Timeout = 600.0


class ReadBudgetArgs(_Args):
    """What an agent you own (or one below it) and its subtree have spent against budgets:
    limits and remaining (its own budget's), spent (tokens, cost_usd, turn_seconds, turns
    over its subtree), state (ok, soft, exhausted: the tightest of its own budget and its
    ancestors') and decided_by (the agent whose budget sets that state)."""

    agent: _AgentId


class SetBudgetArgs(_Args):
    """Set, raise or lower the budget of an agent you own (or one below it) and its
    subtree, or remove it (remove: true). An exhausted tree runs again only once its limit
    is raised and a waking message is sent (its parked messages run first)."""

    agent: _AgentId
    budget: _BudgetObject | UnsetType = UNSET
    remove: Annotated[
        bool, Meta(description="Remove the agent's own budget instead (default false).")
    ] = False


class ListApprovalsArgs(_Args):
    """List the tool calls that wait for your decision (approval) before they run: each
    one's id, agent, tool and arguments, oldest first. Without agent: those of every agent
    you own and of the agents below them; with agent: that agent's own (scope subtree:
    and those below it). Decide one with decide_approval."""

    agent: _AgentId | UnsetType = UNSET
    scope: Annotated[
        Literal["session", "subtree"],
        Meta(description="With agent: session (its own, default) or subtree (and below)."),
    ] = "session"


class DecideArgs(DecideApprovalArgs):
    """Decide a tool call of an agent you own (or one below it) that waits for approval:
    approve it (it runs, with your edited arguments if you give them, checked against the
    tool's schema) or deny it (it never runs; the agent is told why and goes on). The
    first decision stands: a later one is refused as already-decided."""


TOOLS: dict[str, tuple[type[msgspec.Struct], str]] = {
    "spawn_agent": (SpawnArgs, "_spawn"),
    "send_message": (SendArgs, "_send"),
    "interrupt_agent": (InterruptArgs, "_interrupt"),
    "pause_agent": (PauseArgs, "_pause"),
    "resume_agent": (ResumeArgs, "_resume"),
    "list_agents": (ListArgs, "_list"),
    "read_transcript": (ReadTranscriptArgs, "_transcript"),
    "stop_report": (StopReportArgs, "_stop_report"),
    "wait_agent": (WaitAgentArgs, "_wait_agent"),
    "read_budget": (ReadBudgetArgs, "_read_budget"),
    "set_budget": (SetBudgetArgs, "_set_budget"),
    "list_approvals": (ListApprovalsArgs, "_list_approvals"),
    "decide_approval": (DecideArgs, "_decide_approval"),
}
_STOPS: Final = frozenset({"interrupt_agent", "pause_agent", "resume_agent"})


def _tool_list() -> list[types.Tool]:
    tools = []
    for name, (args, _) in TOOLS.items():
        description, schema = parameters(args)
        tools.append(types.Tool(name=name, description=description, input_schema=schema))
    return tools


def _given(value: Any) -> Any:
    return None if value is UNSET else value


class _Call:
    """One tools/call: the client's holdings and the request context (for progress)."""

    def __init__(self, ctx: ServerRequestContext[Any, Any], held: set[str]) -> None:
        self.ctx = ctx
        self.held = held


class McpFace:
    """The tools over one runtime; one instance per server, shared by its clients."""

    def __init__(self, rt: Runtime, options: FaceOptions, *, stdio: bool = False) -> None:
        self.rt = rt
        self.options = options
        self._stdio = stdio
        self._held: dict[str, set[str]] = {}
        self._parents: dict[str, str | None] = {}  # durable: a session's parent never changes
        self._tools = _tool_list()
        # Stops (interrupt, pause, resume) have threads of their own: they never wait
        # behind other calls (as on /rpc).
        self._stop_lane = anyio.CapacityLimiter(4)
        self._work_lane = anyio.CapacityLimiter(32)

    # ---- the SDK's server --------------------------------------------------------------

    def server(self) -> Server[Any]:
        async def list_tools(
            ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
        ) -> types.ListToolsResult:
            return types.ListToolsResult(tools=self._tools)

        async def call_tool(
            ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
        ) -> types.CallToolResult:
            result = await self.call(ctx, params.name, params.arguments)
            is_error = "error" in result
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=msgspec.json.encode(result).decode())],
                structured_content=result,
                is_error=is_error,
            )

        return Server(
            "tether",
            version="3",
            instructions="Tether: background agents you can steer, cancel, abort, preempt, "
            "pause and resume without destroying them. spawn_agent opens one.",
            on_list_tools=list_tools,
            on_call_tool=call_tool,
        )

    def _holdings(self, ctx: ServerRequestContext[Any, Any]) -> set[str]:
        if self._stdio:
            key: str | None = _STDIO
        else:
            headers = getattr(ctx.request, "headers", None)
            owner = headers.get(OWNER_HEADER) if headers is not None else None
            if owner:
                if len(owner) > _MAX_OWNER:
                    raise InvalidParams(f"a {OWNER_HEADER} is at most {_MAX_OWNER} characters")
                key = "owner:" + owner  # never a session id: those are hex, with no colon
            else:
                key = headers.get("mcp-session-id") if headers is not None else None
        if key is None:  # a stateless request: it holds only the configured roots
            return set(self.options.roots)
        return self._held.setdefault(key, set(self.options.roots))

    async def call(
        self, ctx: ServerRequestContext[Any, Any], name: str, arguments: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Run one tool; its JSON result, or ``{"error": code, "message": ...}``."""
        tool = TOOLS.get(name)
        if tool is None:
            return {"error": "unknown-tool", "message": f"no tool named {name!r}"}
        args_type, method = tool
        raw = {k: v for k, v in (arguments or {}).items() if v is not None}
        try:
            args = msgspec.convert(raw, args_type)
        except msgspec.ValidationError as exc:
            return {"error": "invalid-params", "message": f"{name}: {exc}"}
        handler: Callable[[_Call, Any], Awaitable[dict[str, Any]]] = getattr(self, method)
        try:
            return await handler(_Call(ctx, self._holdings(ctx)), args)
        except TetherError as exc:
            code = "invalid-params" if exc.code == "driver-not-found" else exc.code
            if code != "internal":
                return {"error": code, "message": exc.message}
            return _internal(name, exc)
        except anyio.get_cancelled_exc_class():
            log.info("mcp.call_cancelled", tool=name, request=str(ctx.request_id))
            raise
        except Exception as exc:  # the SDK would answer with the exception's text
            return _internal(name, exc)

    # ---- helpers -----------------------------------------------------------------------

    async def _run(self, fn: Callable[..., Any], *args: Any, stop: bool = False) -> Any:
        lane = self._stop_lane if stop else self._work_lane
        return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=lane)

    def _lineage(self, target: str) -> list[str]:
        """``target`` and its ancestors, root last (from the catalog's durable parents)."""
        chain = [target]
        while len(chain) <= _MAX_DEPTH:
            sid = chain[-1]
            if sid not in self._parents:
                self._parents[sid] = self.rt.status(sid).parent
            parent = self._parents[sid]
            if parent is None:
                return chain
            chain.append(parent)
        raise Unauthorized(f"{target} is deeper than {_MAX_DEPTH} levels")

    async def _user(self, call: _Call, target: str) -> User:
        """The address this client presents for ``target``; Unauthorized unless the
        target is one of its roots or below one."""
        if not isinstance(target, str) or not target:
            raise InvalidParams("an agent id is a non-empty string")
        chain: list[str] = await self._run(self._lineage, target)
        if chain[-1] not in call.held:
            raise Unauthorized(f"{target} is not an agent this client opened, or below one")
        return User(parent=chain[1] if len(chain) > 1 else target)

    async def _progress(self, call: _Call, started: float, timeout: float, note: str) -> None:
        with contextlib.suppress(Exception):  # a client that went away: the wait goes on
            await call.ctx.session.report_progress(time.monotonic() - started, timeout, note)

    async def _wait_turn(
        self, call: _Call, session: str, message: str, cursor: int, timeout: float
    ) -> dict[str, Any]:
        """Wait for the turn that claims ``message`` to end; its outcome and final text.

        Progress notifications carry the agent's latest words. On timeout the call
        returns what it knows (``"outcome": null``); the agent goes on.
        """
        started = time.monotonic()
        last_note = 0.0
        turn_id: str | None = None
        text: str | None = None
        while True:
            record = await self._run(turn_of_message, self.rt, session, message)
            if record is not None:
                turn_id = record.id
                while True:  # read what the turn said so far, page by page
                    entries, after = await self._run(
                        turn_entries, self.rt, session, record.id, cursor
                    )
                    for entry in entries:
                        if entry.kind == "assistant":
                            text = entry.text
                    if after == cursor:
                        break
                    cursor = after
                if record.outcome is not None:
                    return {"turn": turn_id, "outcome": record.outcome, "text": text}
            now = time.monotonic()
            if now - started >= timeout:
                return {"turn": turn_id, "outcome": None, "text": text, "timed_out": True}
            if now - last_note >= _PROGRESS_EVERY:
                last_note = now
                note = await self._run(self._where, session, turn_id, text)
                await self._progress(call, started, timeout, note[:200])
            await anyio.sleep(_POLL)

    def _where(self, session: str, turn: str | None, text: str | None) -> str:
        """Where a waited-for message is, as a progress note: queued behind another
        turn, claimed but waiting for a worker, or its turn's latest words."""
        info = self.rt.status(session)
        if turn is None:  # not claimed yet: it waits in the inbox
            if info.turn is not None:
                how = "paused" if info.state == "paused" else "running"
                return f"queued behind the {how} turn {info.turn}"
            return f"queued ({session} is {info.state})"
        if info.turn == turn and info.state == "running" and not info.dispatched:
            return "waiting for a worker"
        return text or "working"

    async def _first_message(self, agent: str) -> str:
        """The id of a new child's first message: pending in its inbox, or claimed by its
        first turn (between the two, for a moment, neither shows it: look again)."""
        while True:
            turns = await self._run(self.rt.turns, agent)
            if turns:
                return str(turns[0].message)
            inbox = await self._run(self.rt.inbox, agent)
            if inbox:
                return str(inbox[0].id)
            await anyio.sleep(_POLL)

    # ---- the tools ---------------------------------------------------------------------

    async def _spawn(self, call: _Call, a: SpawnArgs) -> dict[str, Any]:
        rt, opts = self.rt, self.options
        prompt, data, slug = _given(a.prompt), _given(a.data), _given(a.slug)
        budget = _given(a.budget)
        if a.parent is UNSET:
            if a.mode != "continuable":
                raise InvalidParams("a root agent is continuable; give parent for a one-shot")
            agent: str = await self._run(
                lambda: rt.open_session(opts.driver, config=opts.config, slug=slug, budget=budget)
            )
            call.held.add(agent)
            self._parents[agent] = None
            message = None
            if prompt is not None:
                message = await self._run(lambda: rt.prompt(agent, prompt, data=data))
            log.info("mcp.root_opened", session=agent)
        else:
            parent = str(a.parent)
            await self._user(call, parent)
            child = await self._run(
                lambda: rt.spawn(
                    parent,
                    opts.driver,
                    mode=a.mode,
                    prompt=prompt,
                    data=data,
                    slug=slug,
                    config=opts.config,
                    budget=budget,
                )
            )
            agent = child.id if isinstance(child, OneShot) else str(child)
            self._parents[agent] = parent
            message = None
            if prompt is not None and a.wait:
                message = await self._first_message(agent)
        result: dict[str, Any] = {"agent": agent}
        if a.wait and message is not None:
            result |= await self._wait_turn(call, agent, message, 0, a.timeout)
        return result

    async def _send(self, call: _Call, a: SendArgs) -> dict[str, Any]:
        user = await self._user(call, a.to)
        cursor = await self._run(last_seq, self.rt, a.to) if a.wait else 0
        message: str = await self._run(
            lambda: self.rt.send(a.to, a.text, authority=user, data=_given(a.data), wake=a.wake)
        )
        result: dict[str, Any] = {"sent": True, "message": message}
        if a.wait:
            result |= await self._wait_turn(call, a.to, message, cursor, a.timeout)
        return result

    async def _interrupt(self, call: _Call, a: InterruptArgs) -> dict[str, Any]:
        user = await self._user(call, a.agent)
        common: dict[str, Any] = {
            "authority": user,
            "kind": a.kind,
            "reason": a.reason,
            "grace": _given(a.grace),
            "deadline": _given(a.deadline),
            "turn": _given(a.turn),
        }
        if a.scope == "subtree":  # every running turn below too, each bound to its own
            turns = await self._run(
                lambda: self.rt.interrupt(a.agent, scope="subtree", **common), stop=True
            )
            return {"accepted": True, "turns": list(turns)}
        turn = await self._run(lambda: self.rt.interrupt(a.agent, **common), stop=True)
        return {"accepted": True, "turn": turn}

    async def _pause(self, call: _Call, a: PauseArgs) -> dict[str, Any]:
        user = await self._user(call, a.agent)
        turns = await self._run(
            lambda: self.rt.pause(a.agent, authority=user, scope=a.scope, reason=a.reason),
            stop=True,
        )
        return {"accepted": True, "turns": list(turns)}

    async def _resume(self, call: _Call, a: ResumeArgs) -> dict[str, Any]:
        user = await self._user(call, a.agent)
        turns = await self._run(
            lambda: self.rt.resume(a.agent, authority=user, scope=a.scope), stop=True
        )
        return {"accepted": True, "turns": list(turns)}

    async def _list(self, call: _Call, a: ListArgs) -> dict[str, Any]:
        rt = self.rt
        if a.agent is not UNSET:
            agent = str(a.agent)
            await self._user(call, agent)
            agents = await self._run(lambda: rt.list_agents(agent, scope=a.scope))
            return {"agents": msgspec.to_builtins(agents)}

        def roots() -> list[Any]:
            out: list[Any] = []
            for root in sorted(call.held):
                out.append(rt.status(root))
                if a.scope == "descendants":
                    out.extend(rt.list_agents(root, scope="descendants"))
            return out

        return {"agents": msgspec.to_builtins(await self._run(roots))}

    async def _transcript(self, call: _Call, a: ReadTranscriptArgs) -> dict[str, Any]:
        await self._user(call, a.agent)
        entries = await self._run(
            lambda: self.rt.transcript(a.agent, after=a.after, limit=a.limit + 1)
        )
        return {"entries": msgspec.to_builtins(entries[: a.limit]), "more": len(entries) > a.limit}

    def _holds_turn(self, held: set[str], turn: str) -> bool:
        """Whether ``turn`` is a turn of one of the client's roots or of an agent below
        them (looked up in their turn records; a report is never read for it)."""
        for root in sorted(held):
            try:
                sessions = [root, *(a.id for a in self.rt.list_agents(root, scope="descendants"))]
            except TetherError:  # a root that is gone holds no turn
                continue
            for session in sessions:
                with contextlib.suppress(TetherError):  # nor does an agent gone meanwhile
                    if any(t.id == turn for t in self.rt.turns(session)):
                        return True
        return False

    async def _stop_report(self, call: _Call, a: StopReportArgs) -> dict[str, Any]:
        # A report is read by who may stop its turn: that is checked before anything about
        # the turn is read, and a turn that is not the client's is refused as one that
        # does not exist, naming no agent.
        if not await self._run(self._holds_turn, set(call.held), a.turn):
            raise Unauthorized("no agent this client opened, nor one below them, ran that turn")
        report = await self._run(self.rt.stop_report, a.turn)
        return {"report": None if report is None else msgspec.to_builtins(report)}

    async def _wait_agent(self, call: _Call, a: WaitAgentArgs) -> dict[str, Any]:
        await self._user(call, a.agent)
        started = last_note = time.monotonic()
        while True:
            info = await self._run(self.rt.status, a.agent)
            if info.state not in ("running", "paused", "disposing"):
                return {"agent": msgspec.to_builtins(info)}
            now = time.monotonic()
            if now - started >= a.timeout:
                return {"agent": msgspec.to_builtins(info), "timed_out": True}
            if now - last_note >= _PROGRESS_EVERY:
                last_note = now
                await self._progress(call, started, a.timeout, info.state)
            await anyio.sleep(_POLL)

    async def _read_budget(self, call: _Call, a: ReadBudgetArgs) -> dict[str, Any]:
        await self._user(call, a.agent)
        status = await self._run(self.rt.budget, a.agent)
        return {"budget": msgspec.to_builtins(status)}

    async def _set_budget(self, call: _Call, a: SetBudgetArgs) -> dict[str, Any]:
        if (a.budget is UNSET) == (not a.remove):
            raise InvalidParams("set_budget takes a budget, or remove: true (not both)")
        user = await self._user(call, a.agent)
        budget = _given(a.budget)
        # On the stop lane, as interrupts: raising a spent tree's limit never waits
        # behind other calls.
        await self._run(lambda: self.rt.set_budget(a.agent, budget, authority=user), stop=True)
        return {"accepted": True}

    async def _list_approvals(self, call: _Call, a: ListApprovalsArgs) -> dict[str, Any]:
        rt = self.rt
        if a.agent is not UNSET:
            agent = str(a.agent)
            await self._user(call, agent)
            found = await self._run(lambda: rt.approvals(agent, scope=a.scope))
            return {"approvals": msgspec.to_builtins(found)}

        def held() -> list[Any]:
            out: list[Any] = []
            for root in sorted(call.held):
                with contextlib.suppress(NotFound):  # a root that is gone waits for nothing
                    out.extend(rt.approvals(root, scope="subtree"))
            return sorted(out, key=lambda x: (x.requested_at, x.id))

        return {"approvals": msgspec.to_builtins(await self._run(held))}

    async def _decide_approval(self, call: _Call, a: DecideArgs) -> dict[str, Any]:
        # Who may decide is checked before anything of the approval is told: one of
        # another client's agents is refused naming neither its agent nor how it stands.
        found = await self._run(self.rt.approval, a.approval)
        try:
            user = await self._user(call, found.session)
        except Unauthorized:
            raise Unauthorized(
                "no agent this client opened, nor one below them, asked for that approval"
            ) from None
        decided = await self._run(
            lambda: self.rt.decide(
                a.approval,
                a.decision,
                authority=user,
                reason=a.reason,
                arguments=_given(a.arguments),
            ),
            stop=True,
        )
        return {"approval": msgspec.to_builtins(decided)}


def _internal(tool: str, exc: BaseException) -> dict[str, Any]:
    """An unexpected failure as the client sees it: the id that finds it in the host's
    log, never its text (which may hold paths or data)."""
    error_id = "err_" + uuid.uuid4().hex[:16]
    log.error("mcp.internal_error", error_id=error_id, tool=tool, exc_info=exc)
    return {"error": "internal", "message": f"internal error (id {error_id})"}


# ---- transports ----------------------------------------------------------------------------


class McpHttp:
    """``/mcp`` on ``tether serve``: Streamable HTTP, one MCP session per client.

    Token and loopback rules are the server's own (its guard runs before this app), so
    the SDK's own Host/Origin check is off here rather than done twice.
    """

    def __init__(self, rt: Runtime, options: FaceOptions) -> None:
        self.face = McpFace(rt, options)
        self.manager = StreamableHTTPSessionManager(
            app=self.face.server(),
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        self.routes: list[BaseRoute] = [
            Route("/mcp", StreamableHTTPASGIApp(self.manager), methods=["GET", "POST", "DELETE"])
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield


class _StdinLines:
    """The protocol's input: lines from the process's stdin, read without a thread.

    The SDK's own reader blocks a thread in ``readline`` until a line or end of file
    comes, so a SIGTERM could not end a server whose client is silent. This one waits on
    the descriptor in the event loop, where a cancellation reaches it. As the SDK does,
    fd 0 then points at the null device: a worker or a tool that reads its stdin gets
    end of file, never the client's bytes.
    """

    def __init__(self) -> None:
        self._fd = os.dup(0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.set_blocking(self._fd, False)
        self._buffer = b""
        self._eof = False
        # A file (``< /dev/null``, ``< requests.jsonl``) cannot be waited on, and a read
        # of it never blocks: it is read directly.
        self._pollable = True

    def __aiter__(self) -> _StdinLines:
        return self

    async def __anext__(self) -> str:
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline or (self._eof and line):
                self._buffer = rest
                return (line + newline).decode("utf-8", errors="replace")
            if self._eof:
                raise StopAsyncIteration
            if self._pollable:
                try:
                    await anyio.wait_readable(self._fd)
                except PermissionError:  # epoll refuses a regular file or /dev/null
                    self._pollable = False
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                continue
            self._eof = not chunk
            self._buffer += chunk

    def close(self) -> None:
        os.close(self._fd)


def run_stdio(
    *,
    path: str,
    workers: int = 2,
    grace: float = 5.0,
    options: FaceOptions | None = None,
) -> int:
    """``tether mcp``: the runtime embedded, MCP on stdin/stdout until stdin closes or
    SIGTERM/SIGINT comes; then the runtime drains (as ``tether serve``'s does).

    The SDK points fd 1 at stderr while it serves, and the runtime starts inside that,
    so nothing a worker, a driver or a tool prints can reach the protocol stream.
    """
    opts = options or FaceOptions()

    async def on_signal(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                log.info("mcp.stdio_stopping")
                scope.cancel()

    async def main() -> None:
        stdin = _StdinLines()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(on_signal, tg.cancel_scope)
                stdin_file: Any = stdin  # the SDK only iterates it for lines
                async with stdio_server(stdin=stdin_file) as (read, write):
                    rt = await anyio.to_thread.run_sync(
                        lambda: Runtime(path, workers=workers, grace=grace, subreaper=True)
                    )
                    try:
                        server = McpFace(rt, opts, stdio=True).server()
                        log.info("mcp.stdio_serving", store=path, driver=opts.driver)
                        await server.run(read, write, server.create_initialization_options())
                    finally:
                        with anyio.CancelScope(shield=True):
                            await anyio.to_thread.run_sync(rt.close)
                tg.cancel_scope.cancel()  # stdin closed, the client is gone: stop watching
        finally:
            stdin.close()

    try:
        anyio.run(main)
    except BaseExceptionGroup as group:  # the task group's: say a TetherError as itself
        found = _tether_error(group)
        if found is None:
            raise
        raise found from None
    return 0


def _tether_error(group: BaseExceptionGroup[Any]) -> TetherError | None:
    """The first TetherError in ``group`` (nested groups included), e.g. a store that
    another host holds (``StoreLocked``), so the command says it in one line."""
    for exc in group.exceptions:
        if isinstance(exc, TetherError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _tether_error(exc)
            if found is not None:
                return found
    return None
