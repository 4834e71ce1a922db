"""The JSON-RPC table: each method's params → the runtime call → its result, one lane
per kind of call so that a stop never waits behind a slow read (docs/design.md, section 13)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import msgspec
import structlog

from tether import Runtime, User
from tether.wire.errors import TetherError
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
    ApprovalList,
    ApprovalParams,
    ApprovalResult,
    ApprovalsParams,
    BudgetParams,
    BudgetResult,
    DecideParams,
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
    RootList,
    RootsParams,
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

__all__ = ["FAULT_INJECTION_ENV", "MAX_BATCH", "RpcDispatcher"]

MAX_BATCH: Final = 100
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
            on_crash=p.on_crash,
            max_recoveries=p.max_recoveries,
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
            on_crash=p.on_crash,
            max_recoveries=p.max_recoveries,
        )
        return SessionResult(child if isinstance(child, str) else child.id)

    def send(p: SendParams) -> MessageAccepted:
        a = p.address
        message = rt.send(
            a.session,
            p.content,
            authority=User(parent=a.parent, name=p.name),
            data=p.data,
            wake=p.wake,
        )
        return MessageAccepted(message=message)

    def interrupt(p: InterruptParams) -> InterruptResult | SubtreeStopResult:
        # The core primitive alone decides: User(parent) is compared with the target's
        # durable parent, and the turn is bound there, so nothing here looks anything up.
        auth = User(parent=p.address.parent, name=p.name)
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
        me = User(parent=a.parent, name=p.name)
        turns = rt.pause(a.session, authority=me, scope=p.scope, reason=p.reason, turn=p.turn)
        return PauseResult(turns=turns)

    def resume(p: ResumeParams) -> PauseResult:
        a = p.address
        return PauseResult(
            turns=rt.resume(a.session, authority=User(parent=a.parent, name=p.name), scope=p.scope)
        )

    def list_(p: ListParams) -> AgentList:
        return AgentList(rt.list_agents(p.root, scope=p.scope))

    def roots(p: RootsParams) -> RootList:
        # One root past the page says whether there is more, as a transcript's page does.
        found = rt.list_roots(before=p.before, limit=p.limit + 1)
        return RootList(found[: p.limit], more=len(found) > p.limit)

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

    def approvals(p: ApprovalsParams) -> ApprovalList:
        return ApprovalList(rt.approvals(p.session, scope=p.scope))

    def approval(p: ApprovalParams) -> ApprovalResult:
        return ApprovalResult(rt.approval(p.approval))

    def decide(p: DecideParams) -> ApprovalResult:
        # The authority of an interrupt of the approval's session: the runtime compares
        # User(parent) with that session's durable parent, as for a stop.
        decided = rt.decide(
            p.approval,
            p.decision,
            authority=User(parent=p.parent, name=p.name),
            reason=p.reason,
            arguments=p.arguments,
        )
        return ApprovalResult(decided)

    return {
        "session.open": open_,
        "session.prompt": prompt,
        "session.release": release,
        "session.list": roots,
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
        "subagent.approvals": approvals,
        "subagent.approval": approval,
        "subagent.decide": decide,
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

    ``subagent.interrupt``, ``subagent.pause`` and ``subagent.decide`` have a lane of
    their own and ``subagent.status`` another: nothing else runs there, so a stop or a
    decision (and the look that checks it landed) never waits behind other calls, however
    many of those are slow or stuck. Everything else shares ``work``, bounded so a flood
    of calls cannot grow threads without limit.
    """

    STOP: Final = frozenset({"subagent.interrupt", "subagent.pause", "subagent.decide"})
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
