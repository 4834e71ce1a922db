"""The A2A face's approvals (semantics §17.2): a task whose turn waits for a decision is
``input-required``, its status message naming the pending calls (a text part for people,
a data part ``{"tether": {"approvals": [Approval]}}`` for programs); a message to that
task with data ``{"tether": {"approval": ID, "decision": "approve"|"deny"}}`` decides
one (its text, or ``tether.reason``, is the reason; ``tether.arguments`` an edit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from a2a.types.a2a_pb2 import Part
from a2a.utils.errors import InvalidParamsError
from google.protobuf.struct_pb2 import Value

from tether import Runtime, User
from tether.wire.approval import Approval, call_text

__all__ = ["Decision", "approvals_part", "decide", "decision_of", "waiting_note"]


@dataclass(frozen=True, slots=True)
class Decision:
    approval: str
    decision: str
    reason: str
    arguments: dict[str, Any] | None


def decision_of(data: dict[str, Any] | None, content: str) -> Decision | None:
    """The decision a message's data carries, or None when it carries none (the
    message is then an ordinary one)."""
    tether = (data or {}).get("tether")
    if not isinstance(tether, dict) or "approval" not in tether:
        return None
    approval, decision = tether.get("approval"), tether.get("decision")
    if not isinstance(approval, str) or not approval:
        raise InvalidParamsError(message="tether.approval names the approval (a_…)")
    if decision not in ("approve", "deny"):
        raise InvalidParamsError(message='tether.decision is "approve" or "deny"')
    reason = tether.get("reason", content)
    arguments = tether.get("arguments")
    if not isinstance(reason, str):
        raise InvalidParamsError(message="tether.reason is a string")
    if arguments is not None and not isinstance(arguments, dict):
        raise InvalidParamsError(message="tether.arguments is the call's arguments: an object")
    return Decision(approval, decision, reason, arguments)


def decide(rt: Runtime, session: str, task: str, d: Decision) -> Approval:
    """Decide ``d`` as the context's owner: only an approval of this task's turn."""
    found = rt.approval(d.approval)
    if found.session != session or found.turn != task:
        raise InvalidParamsError(message=f"task {task} waits for no approval {d.approval!r}")
    return rt.decide(
        d.approval,
        d.decision,
        authority=User(parent=session),
        reason=d.reason,
        arguments=d.arguments,
    )


def waiting_note(approvals: list[Approval]) -> str:
    calls = "; ".join(f"{call_text(a.tool, a.arguments)} ({a.id})" for a in approvals)
    return (
        f"waiting for approval: {calls}. Send a message to this task with data "
        '{"tether": {"approval": ID, "decision": "approve" or "deny"}} to decide'
    )


def approvals_part(approvals: list[Approval]) -> Part:
    """The pending calls as a data part (their records, less the tools' schemas)."""
    records = [msgspec.to_builtins(msgspec.structs.replace(a, schema=None)) for a in approvals]
    value = Value()
    value.struct_value.update({"tether": {"approvals": records}})
    return Part(data=value, media_type="application/json")
