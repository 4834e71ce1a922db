"""Approvals (semantics §17.2), the session's helper: a tool call that waits for a
decision before it starts.

A driver asks through its call's write-ahead (``ctx.ask_approval``: a ``begin_call``
whose arguments carry ``approval``). The answer is held until the call is decided:
approved, the call's start is made durable (with the arguments it will run with) and the
answer carries its key; denied, expired or cancelled, the answer carries the text the
model reads instead of a result. Functions the session calls on its host's thread, with
itself and its turn, as its other helpers are:

- ``request``: the approval is made (its record, marker, ``approval`` event and the
  parent's notice) and the turn waits: it counts against no worker slot, no budget's
  ``turn_seconds`` and no stall watchdog while nothing but approvals holds it;
- ``decide``: a person's or an ancestor's decision (the host authorized it);
- ``fired``: an approval's ``approval_timeout`` ran out (``expired``);
- ``preempt``: a preempt of the turn while calls wait denies them (by its ``by``);
- ``stopped`` and ``ended``: a cancel, an abort or the turn's end cancels what waits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from tether.actors import recovery, watchdog
from tether.actors._ids import new_id
from tether.actors.authority import Authority, User
from tether.actors.clock import Timer
from tether.actors.ports import Durable
from tether.actors.turn import Turn
from tether.wire.approval import (
    Approval,
    ApprovalState,
    Approver,
    approval_marker,
    call_text,
    decided_marker,
    parse_arguments,
    result_text,
)
from tether.wire.errors import AlreadyDecided, InvalidParams, Unauthorized
from tether.wire.frames import ToolCall, ToolReply
from tether.wire.records import MarkerAction, StopOrigin
from tether.wire.text import cap, neutralize

if TYPE_CHECKING:
    from tether.actors.agent import Session

__all__ = ["Decide", "Pending", "decide", "ended", "fired", "preempt", "request", "stopped"]

log = structlog.get_logger("tether.agent")

_MARKS: dict[ApprovalState, MarkerAction] = {
    "approved": "approved",
    "denied": "denied",
    "expired": "approval-expired",
    "cancelled": "approval-cancelled",
}


@dataclass(slots=True)
class Pending:
    """One call of the turn that waits for its decision: its record, and the worker's
    call to answer once it is decided."""

    record: Approval
    frame: ToolCall
    answer: Callable[[ToolReply], None]
    gen: int
    timer: Timer | None = None


def request(s: Session, frame: ToolCall, answer: Callable[[ToolReply], None]) -> None:
    """The worker asks for ``frame``'s call to be approved: the approval is made and the
    answer held until it is decided."""
    t = s.turn
    if t is None or t.id != frame.turn:
        answer(ToolReply(frame.turn, frame.call, code="not-found", message="no such turn"))
        return
    args = frame.args
    asked: dict[str, Any] = args.get("approval") or {}
    host, h = s.services, s.header
    now = host.clock.now()
    timeout = asked.get("timeout")
    approver: Approver = "user" if asked.get("approver") == "user" else "any"
    schema = asked.get("schema")
    a = Approval(
        id=new_id("a_", now),
        session=h.id,
        turn=t.id,
        tool=str(args.get("name", "")),
        arguments=parse_arguments(str(args.get("arguments", ""))),
        requested_at=now,
        approver=approver,
        timeout=None if timeout is None else float(timeout),
        tool_call_id=args.get("tool_call_id"),
        schema=schema if isinstance(schema, dict) else None,
    )
    if t.approvals is None:
        t.approvals = {}
    t.approval_gen += 1
    p = Pending(a, frame, answer, t.approval_gen)
    host.store.put_approval(a)
    s.marker(
        t, "approval", "system", "tether", "", text=approval_marker(a), data={"approval": a.id}
    )
    log.info("approval.requested", session=h.id, turn=t.id, approval=a.id, tool=a.tool)
    _emit(s, a)
    if t.stop is not None:  # asked as the turn stops: it will never run
        _settle(s, t, p, "cancelled", "system", "system", f"the turn is stopping ({t.stop.kind})")
        return
    first = not t.approvals
    t.approvals[a.id] = p
    if a.timeout is not None:
        p.timer = host.arm(h.id, t.id, "approval", a.timeout, p.gen)
    if first:
        _hold(s, t)
    _notify_parent(s, a)


@dataclass(frozen=True, slots=True)
class Decide:
    """A decision on ``approval`` of ``session`` (asked of its host, which authorizes it
    as an interrupt of the session). ``arguments``: the edit, with ``edited``."""

    session: str
    approval: str
    approve: bool
    authority: Authority
    reason: str = ""
    arguments: Any = None
    edited: bool = False


def decide(s: Session, d: Decide) -> tuple[Approval, Durable]:
    """A decision the host authorized: the approval as decided and the ticket of its
    record. ``AlreadyDecided`` when it no longer waits; ``Unauthorized`` for an ancestor
    under ``approver: "user"``; ``InvalidParams`` for an edit the tool's schema refuses."""
    t = s.turn
    p = None if t is None or t.approvals is None else t.approvals.get(d.approval)
    if t is None or p is None:
        raise AlreadyDecided(f"approval {d.approval} is no longer pending")
    a = p.record
    auth = d.authority
    if a.approver == "user" and not isinstance(auth, User):
        raise Unauthorized(f"approval {d.approval} is for a person to decide (approver: user)")
    used = a.arguments
    if d.approve and d.edited:
        used = _checked_edit(a, d.arguments)
    state: ApprovalState = "approved" if d.approve else "denied"
    return _settle(s, t, p, state, auth.origin, auth.by, d.reason, used)


def fired(s: Session, t: Turn, gen: int) -> None:
    """An approval's timeout ran out (``gen``: its own): it expires, and the model is
    told it timed out."""
    for p in list((t.approvals or {}).values()):
        if p.gen == gen:
            p.timer = None
            _settle(s, t, p, "expired", "system", "timeout", "")
            return


def preempt(s: Session, t: Turn, origin: StopOrigin, by: str, reason: str) -> bool:
    """A preempt of a turn whose calls wait for approval denies them (decided by the
    preempt's ``by``): True when it did (the preempt has nothing else to stop)."""
    if not t.approvals:
        return False
    for p in list(t.approvals.values()):
        _settle(s, t, p, "denied", origin, by, reason)
    return True


def stopped(s: Session, t: Turn, kind: str, origin: StopOrigin, by: str) -> None:
    """A cancel or an abort of the turn cancels the approvals it waits for."""
    for p in list((t.approvals or {}).values()):
        _settle(s, t, p, "cancelled", origin, by, _stop_reason(kind))


def ended(s: Session, t: Turn, why: str) -> None:
    """The turn ended (or its worker died): what still waits is cancelled."""
    for p in list((t.approvals or {}).values()):
        _settle(s, t, p, "cancelled", "system", "system", why)


def _stop_reason(kind: str) -> str:
    return "the turn was aborted" if kind == "abort" else "the turn was cancelled"


# ---- internals -------------------------------------------------------------------------


def _checked_edit(a: Approval, arguments: Any) -> Any:
    if not isinstance(arguments, dict):
        raise InvalidParams("arguments must be a JSON object (the call's arguments, edited)")
    if a.schema is not None:
        errors = _schema_errors(arguments, a.schema)
        if errors:
            raise InvalidParams(f"the edited arguments do not fit {a.tool}'s schema: {errors[0]}")
    return arguments


def _schema_errors(value: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """What is wrong with ``value`` under the tool's JSON Schema, each error with where.
    ``jsonschema`` comes with every extra that runs a tool with a schema (through the
    ``mcp`` SDK), so a host that has such a tool has it."""
    try:
        import jsonschema
    except ImportError:
        why = "checking edited arguments needs jsonschema (pip install 'tether-runtime[agents]')"
        raise InvalidParams(why) from None
    try:
        check = jsonschema.validators.validator_for(schema)(schema)
        errors = sorted(check.iter_errors(value), key=lambda e: list(e.absolute_path))
    except jsonschema.exceptions.SchemaError as exc:  # the tool's own schema is broken
        raise InvalidParams(f"the tool's schema cannot be checked: {exc.message}") from None
    return [
        ".".join(["arguments", *(str(p) for p in e.absolute_path)]) + f": {e.message}"
        for e in errors
    ]


def _settle(
    s: Session,
    t: Turn,
    p: Pending,
    state: ApprovalState,
    origin: StopOrigin,
    by: str,
    reason: str,
    used: Any = None,
) -> tuple[Approval, Durable]:
    """Decide ``p`` (its record, marker and event), answer its call, and end the turn's
    wait when it was the last."""
    host = s.services
    a = msgspec.structs.replace(
        p.record,
        state=state,
        decided_by=by,
        origin=origin,
        reason=cap(reason) or None,
        decided_at=host.clock.now(),
        arguments_used=used if state == "approved" else None,
    )
    if p.timer is not None:
        p.timer.cancel()
        p.timer = None
    waited = t.approvals is not None and t.approvals.pop(a.id, None) is not None
    ticket = host.store.put_approval(a)
    s.marker(
        t,
        _MARKS[state],
        origin,
        by,
        a.reason or "",
        text=decided_marker(a),
        data={"approval": a.id},
    )
    log.info("approval.decided", session=a.session, turn=a.turn, approval=a.id, state=state, by=by)
    _emit(s, a)
    frame, answer = p.frame, p.answer
    if state == "approved":
        key = new_id("c_", host.clock.now())
        arguments = json.dumps(a.arguments_used, ensure_ascii=False)
        started = host.store.begin_call(key, a.session, a.turn, a.tool, arguments, a.tool_call_id)
        result = {"state": state, "approval": a.id, "key": key, "arguments": arguments}
        recovery.answer_started(started, frame, answer, result)
    else:
        text = result_text(a)
        answer(
            ToolReply(
                frame.turn, frame.call, result={"state": state, "approval": a.id, "text": text}
            )
        )
    if waited and not t.approvals:
        _release(s, t)
    return a, ticket


def _hold(s: Session, t: Turn) -> None:
    """The turn waits on approvals alone: no worker slot, budget clock or watchdog."""
    host = s.services
    host.executor.waiting(t.id, True)
    if host.budget is not None:
        host.budget.hold(t.id, True)
    watchdog.pause(t)


def _release(s: Session, t: Turn) -> None:
    """The last decision came: the turn counts again, and its watchdog starts afresh."""
    host = s.services
    host.executor.waiting(t.id, False)
    if host.budget is not None:
        host.budget.hold(t.id, False)
    if not t.paused:
        watchdog.resume(s, t)


def _emit(s: Session, a: Approval) -> None:
    if s.services.events.wants("approval"):
        s.emit("approval", {"approval": msgspec.to_builtins(a)})


def _notify_parent(s: Session, a: Approval) -> None:
    """The parent agent's notice, as for a child's turn end: an ancestor may decide."""
    h, host = s.header, s.services
    if h.parent is None or not host.inbox_open(h.parent):
        return
    who = h.slug or h.id
    text = neutralize(f"[{who}] approval needed: {call_text(a.tool, a.arguments)} ({a.id})")
    data = {"approval": msgspec.to_builtins(msgspec.structs.replace(a, schema=None))}
    msg, _ = host.store.append_message(h.parent, text, data=data, kind="notice", sender=h.id)
    host.notify_parent(h.parent, msg)
