"""The arguments of a worker's call to its host (a ``ToolCall`` frame), typed.

A turn's context (``ctx.spawn_agent``, ``ctx.history``, ...) sends its arguments as a
plain mapping, so a driver's mistake (a prompt that is not text) reaches the host as an
``InvalidParams`` reply for that call, never as a frame the host refuses (which would
end the worker). The host converts the mapping here, once, at the edge: past this point
a call is one of these Structs, matched by type.

Kinds and scopes take the vocabulary's types (``wire.vocab``); what only the runtime
can judge (a spawn's mode, its permissions and budget) it checks as the Python API does.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from tether.wire.errors import InvalidParams
from tether.wire.vocab import Kind, ListScope, PauseScope

__all__ = [
    "BudgetCall",
    "DecideCall",
    "HistoryCall",
    "HostCall",
    "InterruptCall",
    "ListApprovalsCall",
    "ListCall",
    "PauseCall",
    "ResumeCall",
    "SendCall",
    "SpawnCall",
    "StopReportCall",
    "host_call",
]


class _Call(msgspec.Struct, frozen=True, kw_only=True, tag_field="tool"):
    pass


class HistoryCall(_Call, frozen=True, tag="history"):
    after: Annotated[int, msgspec.Meta(ge=0)] = 0


class SpawnCall(_Call, frozen=True, tag="spawn_agent"):
    mode: str = "continuable"
    prompt: str | None = None
    data: dict[str, Any] | None = None
    slug: str | None = None
    permissions: dict[str, str] | None = None
    budget: dict[str, Any] | None = None
    on_crash: str | None = None
    # The calling tool call's key and which spawn of it (``<key>/<n>``): a spawn re-issued
    # with it after a crash returns the child it made (semantics §17.1). Set by the context.
    call: str | None = None
    # Never the caller's to choose (the host sets what loads code): present only so the
    # refusal can name them.
    driver: Any = None
    config: Any = None


class BudgetCall(_Call, frozen=True, tag="budget"):
    pass


class SendCall(_Call, frozen=True, tag="send_message"):
    to: str = ""
    text: str = ""
    data: dict[str, Any] | None = None
    wake: bool = True


class ListCall(_Call, frozen=True, tag="list_agents"):
    scope: ListScope = "children"


class InterruptCall(_Call, frozen=True, tag="interrupt_agent"):
    agent_id: str = ""
    kind: Kind = "cancel"
    reason: str = ""
    scope: PauseScope = "session"


class StopReportCall(_Call, frozen=True, tag="stop_report"):
    turn: str = ""


class ListApprovalsCall(_Call, frozen=True, tag="list_approvals"):
    pass


class DecideCall(_Call, frozen=True, tag="decide_approval"):
    approval: str = ""
    decision: str = "approve"
    reason: str = ""
    arguments: dict[str, Any] | None = None


class PauseCall(_Call, frozen=True, tag="pause_agent"):
    agent_id: str = ""
    scope: PauseScope = "session"
    reason: str = ""


class ResumeCall(_Call, frozen=True, tag="resume_agent"):
    agent_id: str = ""
    scope: PauseScope = "session"


HostCall = (
    HistoryCall
    | SpawnCall
    | BudgetCall
    | SendCall
    | ListCall
    | InterruptCall
    | StopReportCall
    | PauseCall
    | ResumeCall
    | ListApprovalsCall
    | DecideCall
)

_TAGS: Final = frozenset(
    str(t.__struct_config__.tag)
    for t in (
        HistoryCall,
        SpawnCall,
        BudgetCall,
        SendCall,
        ListCall,
        InterruptCall,
        StopReportCall,
        PauseCall,
        ResumeCall,
        ListApprovalsCall,
        DecideCall,
    )
)


def host_call(name: str, args: dict[str, Any]) -> HostCall | None:
    """The call ``name`` with ``args``; None for a name no host tool has. A value of the
    wrong type is an ``InvalidParams`` that names it (``history: Expected `int` >= 0,
    got `-1` - at `$.after```)."""
    if name not in _TAGS:
        return None
    # None is "left out" (the field's default), as the model tools take it.
    given = {k: v for k, v in args.items() if v is not None}
    try:
        call: HostCall = msgspec.convert({**given, "tool": name}, HostCall)
    except msgspec.ValidationError as exc:
        raise InvalidParams(f"{name}: {exc}") from None
    return call
