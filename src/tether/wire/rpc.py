"""JSON-RPC 2.0 params, results and envelopes of ``tether serve`` (semantics §10).

Every method's params are one msgspec Struct, decoded strictly (no type coercion,
unknown fields refused), so the schema is the validation: a one-shot address, a
misspelt field or a string where a number belongs is ``invalid-params`` before any
runtime call is made. Results are Structs too and encode straight to JSON.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

from tether.wire.approval import Approval, Decision
from tether.wire.budget import Budget, BudgetStatus
from tether.wire.records import AgentInfo, Entry, PendingMessage, StopReport, TurnRecord
from tether.wire.vocab import (
    INT64_MAX,
    INT64_MIN,
    MAX_DEPTH,
    Grace,
    Kind,
    ListScope,
    PauseScope,
    Permission,
    Seconds,
    StallPolicy,
)

__all__ = [
    "APPLICATION_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "MAX_DEPTH",
    "METHODS",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "RPC_ERROR_CODES",
    "Accepted",
    "Address",
    "AgentList",
    "ApprovalList",
    "ApprovalParams",
    "ApprovalResult",
    "ApprovalsParams",
    "BudgetParams",
    "BudgetResult",
    "DecideParams",
    "DisposeParams",
    "ErrorData",
    "ErrorObject",
    "FailParams",
    "Inbox",
    "InboxParams",
    "InterruptKind",
    "InterruptParams",
    "InterruptResult",
    "ListParams",
    "MessageAccepted",
    "OpenParams",
    "PauseParams",
    "PauseResult",
    "PromptParams",
    "ReleaseParams",
    "Response",
    "ResumeParams",
    "RootList",
    "RootsParams",
    "SendParams",
    "SessionResult",
    "SetBudgetParams",
    "SpawnParams",
    "StatusParams",
    "StopReportParams",
    "StopReportResult",
    "SubtreeStopResult",
    "Transcript",
    "TranscriptParams",
    "Turns",
    "TurnsParams",
    "json_problem",
]

# JSON-RPC 2.0 error codes; the Tether code (``error.data.code``) says which refusal.
PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
APPLICATION_ERROR: Final = -32000

# The only values ``error.data.code`` takes on the wire.
RPC_ERROR_CODES: Final = (
    "subagent-unauthorized",
    "parent-offline",
    "not-found",
    "budget-exhausted",
    "invalid-params",
    "store-unavailable",
    "already-decided",
    "internal",
)

# MAX_DEPTH: how deeply a request object may nest (``{"params": {"data": {...}}}`` is 3
# deep). The decoder's own recursion guard sits near 1,000 and refuses as a
# RecursionError; data nested that deep would also reach the store and the worker
# channel, so the edge refuses it with ``-32600`` long before. Integers are 64-bit
# signed wherever they go: one outside is invalid-params at the edge, not an overflow
# deep inside. Both bounds, and every duration's, come from ``wire.vocab``.

SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
TurnId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ApprovalId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
InterruptKind = Kind
JsonObject = dict[str, Any]
# Who the caller is, said after "by" in the markers of their stops and as the sender of
# their messages (``User(parent, name)``); left out or "": "by user". The runtime refuses
# control characters.
Name = Annotated[str, msgspec.Meta(max_length=64)]


class _Params(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every params Struct: strict and keyword-only."""


class Address(_Params):
    """A continuable subagent as the RPC caller names it.

    The caller acts as ``User(parent=parent)``; the runtime compares ``parent`` with the
    target's durable parent. A one-shot is owned by its handle's holder and has no
    address, so ``mode`` admits only ``"continuable"``.
    """

    session: SessionId
    parent: SessionId
    mode: Literal["continuable"] = "continuable"


class OpenParams(_Params):
    """``stall``: the stall watchdog's policy (semantics §14.5); a bad one is
    ``invalid-params`` and opens nothing."""

    driver: Annotated[str, msgspec.Meta(min_length=1)]
    config: JsonObject | None = None
    slug: str | None = None
    permissions: dict[str, Permission] | None = None
    stall: StallPolicy | None = None
    # each turn's {"memory_mb", "pids", "cpu"}, enforced by its cgroup (semantics §15.5); one
    # the kernel cannot enforce there is invalid-params and opens nothing
    limits: JsonObject | None = None
    budget: Budget | None = None  # the tree's budget (semantics §16.2)
    # what a crash does to its turns (semantics §17.1); null: the server's default
    on_crash: Literal["recover", "park"] | None = None
    max_recoveries: Annotated[int, msgspec.Meta(ge=0, le=100)] | None = None


class PromptParams(_Params):
    session: SessionId
    content: str
    data: JsonObject | None = None


class ReleaseParams(_Params):
    session: SessionId


class SpawnParams(_Params):
    """A continuable child of ``parent``; the server is trusted like the host itself."""

    parent: SessionId
    driver: Annotated[str, msgspec.Meta(min_length=1)]
    mode: Literal["continuable"] = "continuable"
    prompt: str | None = None
    data: JsonObject | None = None
    slug: str | None = None
    config: JsonObject | None = None
    permissions: dict[str, Permission] | None = None
    stall: StallPolicy | None = None  # without one, the child inherits its parent's
    limits: JsonObject | None = None  # likewise
    # its own budget, which must fit in what its ancestors' have left (semantics §16.2)
    budget: Budget | None = None
    on_crash: Literal["recover", "park"] | None = None  # null: its parent's
    max_recoveries: Annotated[int, msgspec.Meta(ge=0, le=100)] | None = None


class SendParams(_Params):
    address: Address
    content: str
    data: JsonObject | None = None
    wake: bool = True
    name: Name | None = None


class InterruptParams(_Params):
    """``turn`` is a guard: act only if that turn is still the running one (semantics §14.2).

    ``scope="subtree"`` (a cancel or an abort) stops the running turn of ``address``
    and of every continuable session below it, each bound to its own turn (semantics §15.6).
    """

    address: Address
    kind: InterruptKind = "cancel"
    reason: str = ""
    grace: Grace | None = None  # seconds, 0 to MAX_SECONDS (30 days)
    deadline: Seconds | None = None  # seconds, finite, > 0, at most MAX_SECONDS
    turn: TurnId | None = None
    scope: PauseScope = "session"
    name: Name | None = None


class PauseParams(_Params):
    """Freeze the running turn of ``address`` (``subtree``: and of every running
    descendant) in place (semantics §14.4). Authority as for an interrupt."""

    address: Address
    scope: PauseScope = "session"
    reason: str = ""
    turn: TurnId | None = None  # act only if this is still the running turn
    name: Name | None = None


class ResumeParams(_Params):
    """Thaw what a pause froze (``subtree``: below ``address`` too)."""

    address: Address
    scope: PauseScope = "session"
    name: Name | None = None


class ListParams(_Params):
    root: SessionId
    scope: ListScope = "children"


class RootsParams(_Params):
    """``session.list``: the roots, newest first; ``before`` (the last id of the page
    before) pages on to older ones."""

    before: SessionId | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100


class StatusParams(_Params):
    session: SessionId


class TranscriptParams(_Params):
    """Entries with ``seq > after``, at most ``limit`` of them (``more`` says if cut)."""

    session: SessionId
    after: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 500


class TurnsParams(_Params):
    session: SessionId


class InboxParams(_Params):
    session: SessionId


class DisposeParams(_Params):
    address: Address


class StopReportParams(_Params):
    turn: TurnId


class BudgetParams(_Params):
    session: SessionId


class BudgetResult(msgspec.Struct, frozen=True):
    """``subagent.budget``: the session's tree against its budget (semantics §16.2)."""

    budget: BudgetStatus


class SetBudgetParams(_Params):
    """``subagent.setBudget``: the authority of an interrupt; ``budget`` null removes the
    session's own budget."""

    address: Address
    budget: Budget | None


class ApprovalsParams(_Params):
    """``subagent.approvals``: the pending approvals of ``session`` (``subtree``: and of
    every session below it), oldest first (semantics §17.2). A read: no authority."""

    session: SessionId
    scope: PauseScope = "session"


class ApprovalParams(_Params):
    """``subagent.approval``: one approval, in whatever state (a read: no authority)."""

    approval: ApprovalId


class DecideParams(_Params):
    """``subagent.decide``: approve or deny a pending tool call (semantics §17.2), with the
    authority of an interrupt of its session: ``parent`` is that session's parent as the
    caller holds it (for a root, the root's own id), compared with its durable parent;
    ``name`` says who decides (``by user alice``). ``arguments`` (with ``approve`` only)
    replace the call's, checked against the tool's schema."""

    approval: ApprovalId
    parent: SessionId
    decision: Decision = "approve"
    reason: str = ""
    arguments: JsonObject | None = None
    name: Name | None = None


class ApprovalList(msgspec.Struct, frozen=True):
    """Pending approvals, oldest first."""

    approvals: list[Approval]


class ApprovalResult(msgspec.Struct, frozen=True):
    """One approval: as decided (``subagent.decide``), or as it stands."""

    approval: Approval


class StopReportResult(msgspec.Struct, frozen=True):
    """What the stop that reached the turn did (semantics §15.6); None: no stop reached it."""

    report: StopReport | None = None


class FailParams(_Params):
    """``debug.fail`` takes nothing; it exists only with fault injection enabled."""


class SessionResult(msgspec.Struct, frozen=True):
    session: str


class Accepted(msgspec.Struct, frozen=True):
    accepted: bool = True


class MessageAccepted(msgspec.Struct, frozen=True):
    """A send or prompt: ``message`` is the new message's id (None from an older host)."""

    accepted: bool = True
    message: str | None = None


class InterruptResult(msgspec.Struct, frozen=True):
    """The turn the signal was bound to; ``turn`` None is an accepted no-op (semantics §14.2)."""

    accepted: bool = True
    turn: str | None = None


class SubtreeStopResult(msgspec.Struct, frozen=True):
    """A subtree stop's answer: every turn stopped, the target's own first, then its
    descendants' in pre-order; ``[]`` is an accepted no-op (nothing was running)."""

    accepted: bool = True
    turns: list[str] = msgspec.field(default_factory=list)


class PauseResult(msgspec.Struct, frozen=True):
    """The turns paused (or resumed); ``[]`` is an accepted no-op (nothing was running,
    or nothing was paused)."""

    accepted: bool = True
    turns: list[str] = msgspec.field(default_factory=list)


class Inbox(msgspec.Struct, frozen=True):
    """Pending messages, oldest first."""

    messages: list[PendingMessage]


class AgentList(msgspec.Struct, frozen=True):
    agents: list[AgentInfo]


class RootList(msgspec.Struct, frozen=True):
    """A page of roots, newest first; ``more``: older ones follow (pass the last id as
    ``before``)."""

    roots: list[AgentInfo]
    more: bool = False


class Transcript(msgspec.Struct, frozen=True):
    entries: list[Entry]
    more: bool = False


class Turns(msgspec.Struct, frozen=True):
    turns: list[TurnRecord]


class ErrorData(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    error_id: str | None = None


class ErrorObject(msgspec.Struct, frozen=True):
    code: int
    message: str
    data: ErrorData


class Response(msgspec.Struct, frozen=True):
    """One JSON-RPC response: exactly one of ``result`` and ``error`` is set."""

    id: str | int | float | None
    result: Any = msgspec.UNSET
    error: ErrorObject | msgspec.UnsetType = msgspec.UNSET
    jsonrpc: Literal["2.0"] = "2.0"


def json_problem(value: Any, limit: int = MAX_DEPTH) -> Literal["depth", "integer"] | None:
    """What makes decoded JSON unacceptable, without recursion: ``"depth"`` if it nests
    more than ``limit`` arrays/objects, ``"integer"`` if it holds an integer that is not
    64-bit signed; None if neither."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    found: Literal["integer"] | None = None
    while stack:
        node, depth = stack.pop()
        if isinstance(node, int) and not INT64_MIN <= node <= INT64_MAX:
            found = "integer"  # keep looking: depth is the graver one
            continue
        if not isinstance(node, dict | list):
            continue
        if depth + 1 > limit:
            return "depth"
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | int))
    return found


# Method name -> params type. ``subagent.status`` returns an ``AgentInfo``.
METHODS: Final[dict[str, type[_Params]]] = {
    "session.open": OpenParams,
    "session.prompt": PromptParams,
    "session.release": ReleaseParams,
    "session.list": RootsParams,
    "subagent.spawn": SpawnParams,
    "subagent.send": SendParams,
    "subagent.interrupt": InterruptParams,
    "subagent.pause": PauseParams,
    "subagent.resume": ResumeParams,
    "subagent.list": ListParams,
    "subagent.status": StatusParams,
    "subagent.transcript": TranscriptParams,
    "subagent.turns": TurnsParams,
    "subagent.inbox": InboxParams,
    "subagent.dispose": DisposeParams,
    "subagent.stopReport": StopReportParams,
    "subagent.budget": BudgetParams,
    "subagent.setBudget": SetBudgetParams,
    "subagent.approvals": ApprovalsParams,
    "subagent.approval": ApprovalParams,
    "subagent.decide": DecideParams,
}
