"""The host's side of a worker's tool calls: a typed call in, the runtime's answer out.

Each call acts as the calling session (``Ancestor`` of its activation), gated by that
session's permissions; the answer goes back as the call's ``ToolReply``.
"""

from __future__ import annotations

import contextvars
import threading
import uuid
from typing import TYPE_CHECKING, Any, Final

import msgspec
import structlog

from tether.actors.authority import Ancestor
from tether.actors.ports import TurnSpec
from tether.actors.supervisor import Resolve
from tether.runtime._secrets import Secrets
from tether.runtime.backend import WorkerHost
from tether.wire.approval import Approval
from tether.wire.codec import MAX_FRAME
from tether.wire.errors import InvalidParams, NotFound, TetherError, Unauthorized
from tether.wire.frames import ToolCall, ToolReply
from tether.wire.records import Entry
from tether.wire.text import cap, neutralize
from tether.wire.tool_calls import (
    BudgetCall,
    DecideCall,
    HistoryCall,
    InterruptCall,
    ListApprovalsCall,
    ListCall,
    PauseCall,
    ResumeCall,
    SendCall,
    SpawnCall,
    StopReportCall,
    host_call,
)

if TYPE_CHECKING:
    from tether.runtime.runtime import Runtime

__all__ = ["HostTools", "spawning"]

log = structlog.get_logger("tether.runtime")  # the runtime's logger, shared by its modules

_HISTORY_PAGE: Final = 500  # at most this many entries per `history` call (ctx.history pages)
# ... and at most this many bytes (msgpack), half the frame cap: a page always fits its
# reply frame, however long the entries. One entry alone over a quarter of it (a say of
# millions of characters) is sent cut, with a visible mark.
_HISTORY_BYTES: Final = MAX_FRAME // 2
_HISTORY_CHUNK: Final = 16  # entries read from the store at a time while filling a page
_encoder: Final = msgspec.msgpack.Encoder()

# The spawn_agent call a spawn made on this thread comes from (``SpawnCall.call``), for
# the child's header (``SessionHeader.spawned_by``): set only around that spawn.
spawning: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tether_spawning", default=None
)


class HostTools(WorkerHost):
    """The tool calls of every worker of one runtime (the backend's ``WorkerHost``)."""

    def __init__(self, runtime: Runtime, secrets: Secrets, tool_user: str | None) -> None:
        self._rt = runtime
        self._secrets = secrets
        self.tool_user = tool_user
        # A spawn by a call key looks for the child it made, then makes one: one at a time
        self._spawn_lock = threading.Lock()

    def turn_secrets(self, spec: TurnSpec) -> tuple[dict[str, str] | None, list[str]]:
        return self._secrets.for_turn(spec.config)

    def worker_environ(self) -> dict[str, str]:
        return self._secrets.worker_environ()

    def on_tool_call(self, spec: TurnSpec, frame: ToolCall) -> ToolReply:
        try:
            # what the call sends, spawns or stops is a child of the call's span
            with self._rt._tel.attached(frame.trace):
                result = self.call(spec, frame.name, frame.args)
            return ToolReply(turn=frame.turn, call=frame.call, result=result)
        except TetherError as exc:
            return ToolReply(turn=frame.turn, call=frame.call, code=exc.code, message=exc.message)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("tool.internal_error", error_id=error_id, tool=frame.name)
            return ToolReply(
                turn=frame.turn,
                call=frame.call,
                code="internal",
                message=f"internal error {error_id}",
            )

    def call(self, spec: TurnSpec, name: str, args: dict[str, Any]) -> Any:
        """Run tool ``name`` for ``spec``'s session; a ``TetherError`` is its refusal."""
        call = host_call(name, args)
        rt, caller = self._rt, spec.session
        match call:
            case None:
                raise NotFound(f"no tool named {name!r}")
            case HistoryCall(after=after):
                return self._history_page(caller, after)
            case SpawnCall():
                return self._spawn(spec, call)
            case BudgetCall():
                # What the caller's own tree may still spend: the least that each budget
                # on it or above it has left, and the state they put it in.
                status = rt.budget(caller)
                return {
                    "state": status.state,
                    "decided_by": status.decided_by,
                    "spent": status.spent,
                    "left": rt._gov.left(caller, rt._dir.catalog.lineage(caller)),
                }
            case SendCall(to=to, text=text, data=data, wake=wake):
                auth = self._gate(spec, "send")
                target = self._resolve(caller, to)
                # An agent's words to its child: no frame of its user's among them
                return rt.send(target, neutralize(text), authority=auth, data=data, wake=wake)
            case ListCall(scope=scope):
                self._gate(spec, "list")
                return msgspec.to_builtins(rt.list_agents(caller, scope=scope))
            case InterruptCall(agent_id=agent_id, kind=kind, reason=reason, scope="subtree"):
                auth = self._gate(spec, "interrupt")
                target = self._resolve(caller, agent_id)
                return rt.interrupt(
                    target, authority=auth, kind=kind, reason=reason, scope="subtree"
                )
            case InterruptCall(agent_id=agent_id, kind=kind, reason=reason):
                auth = self._gate(spec, "interrupt")
                target = self._resolve(caller, agent_id)
                return rt.interrupt(target, authority=auth, kind=kind, reason=reason)
            case StopReportCall(turn=turn):
                return self._stop_report(caller, turn)
            # Pausing is stopping in place: the interrupt permission gates both ways.
            case PauseCall(agent_id=agent_id, scope=scope, reason=reason):
                auth = self._gate(spec, "interrupt")
                target = self._resolve(caller, agent_id)
                return rt.pause(target, authority=auth, scope=scope, reason=reason)
            case ResumeCall(agent_id=agent_id, scope=scope):
                auth = self._gate(spec, "interrupt")
                return rt.resume(self._resolve(caller, agent_id), authority=auth, scope=scope)
            # Deciding a call is controlling the agent that made it: as an interrupt.
            case ListApprovalsCall():
                self._gate(spec, "interrupt")
                below = rt.approvals(caller, scope="subtree")
                return [_for_agent(a) for a in below if a.session != caller]
            case DecideCall(approval=approval, decision=decision, reason=reason):
                auth = self._gate(spec, "interrupt")
                decided = rt.decide(
                    approval, decision, authority=auth, reason=reason, arguments=call.arguments
                )
                return _for_agent(decided)

    def _gate(self, spec: TurnSpec, key: str) -> Ancestor:
        if (spec.permissions or {}).get(key, "allow") == "deny":
            raise Unauthorized(f"{key} is denied by this session's permissions")
        return Ancestor(self._rt.agent_ref(spec.session))

    def _resolve(self, caller: str, ref: str) -> str:
        """A child's id or slug, as the caller names it, to its id."""
        return str(self._rt._ask(Resolve(caller, ref)))

    def _spawn(self, spec: TurnSpec, call: SpawnCall) -> str:
        self._gate(spec, "spawn")
        # The host sets what loads code and widens authority: a child runs its parent's
        # driver and config, with the parent's permissions narrowed.
        for key, value in (("driver", call.driver), ("config", call.config)):
            if value is not None:
                raise InvalidParams(f"a tool call cannot choose the child's {key}")
        if call.call is None:
            return self._spawn_new(spec, call)
        # Idempotent by the call's key (semantics §17.1): re-issued after a crash, the
        # call gets the child it made then (the key is in the child's durable header)
        with self._spawn_lock:
            made = self._spawned(spec.session, call.call)
            if made is not None:
                return made
            token = spawning.set(call.call)
            try:
                return self._spawn_new(spec, call)
            finally:
                spawning.reset(token)

    def _spawned(self, parent: str, call: str) -> str | None:
        """The child of ``parent`` that the spawn ``call`` made, if it made one."""
        catalog = self._rt._dir.catalog
        for child in catalog.get(parent).children or ():
            node = catalog.nodes.get(child)
            if node is not None and node.header.spawned_by == call:
                return child
        return None

    def _spawn_new(self, spec: TurnSpec, call: SpawnCall) -> str:
        result = self._rt.spawn(
            spec.session,
            spec.driver,
            mode=call.mode or "continuable",
            prompt=None if call.prompt is None else neutralize(call.prompt),
            data=call.data,
            slug=call.slug,
            config=spec.config,
            permissions=call.permissions,
            budget=call.budget,
            on_crash=call.on_crash,
        )
        return result if isinstance(result, str) else result.id  # a one-shot's handle

    def _stop_report(self, caller: str, turn: str) -> Any:
        """A report is read only over the caller's own subtree: its own turns and those
        of the sessions below it."""
        rt = self._rt
        report = rt.stop_report(turn)
        if report is None:
            return None
        catalog = rt._dir.catalog
        if report.session not in catalog.nodes or (
            report.session != caller and caller not in catalog.lineage(report.session)
        ):
            raise Unauthorized(f"turn {report.turn} is not in {caller}'s subtree")
        return msgspec.to_builtins(report)

    def _history_page(self, session: str, after: int) -> dict[str, Any]:
        """``{"entries": [...], "more": bool}``: the entries past ``after``, bounded by
        count and by size (``_HISTORY_BYTES``), so a transcript of huge entries pages
        instead of overflowing the reply frame (which would fail every turn that reads
        history)."""
        page: list[Any] = []
        size = 0
        while True:
            chunk = self._rt._store.entries(session, after=after, limit=_HISTORY_CHUNK)
            for entry in chunk:
                item = _history_item(entry)
                n = len(_encoder.encode(item))
                if page and (size + n > _HISTORY_BYTES or len(page) >= _HISTORY_PAGE):
                    return {"entries": page, "more": True}
                page.append(item)
                size += n
                after = entry.seq
            if len(chunk) < _HISTORY_CHUNK:
                return {"entries": page, "more": False}


def _for_agent(a: Approval) -> Any:
    """An approval as an agent's tool gets it: without the tool's schema (its tools have
    it already)."""
    return msgspec.to_builtins(msgspec.structs.replace(a, schema=None))


def _history_item(entry: Entry) -> dict[str, Any]:
    """An entry as a history page carries it: whole unless it alone would crowd a page
    (over a quarter of ``_HISTORY_BYTES``), then with its text cut (visibly) and its data
    left out."""
    item: dict[str, Any] = msgspec.to_builtins(entry)
    if len(entry.text) * 4 + len(_encoder.encode(entry.data)) <= _HISTORY_BYTES // 4:
        return item  # small for sure (a character is at most 4 bytes): no need to measure
    if len(_encoder.encode(item)) > _HISTORY_BYTES // 4:
        item["text"] = cap(entry.text, _HISTORY_BYTES // 32)
        if entry.data is not None and len(_encoder.encode(entry.data)) > _HISTORY_BYTES // 8:
            item["data"] = None
    return item
