"""Durable records and the values the public API returns.

All are frozen msgspec Structs, so the same types are stored, sent to workers, returned
to Python callers and encoded as JSON for RPC. New fields always get defaults so that an
older peer still decodes a newer record.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from tether.wire.budget import Budget
from tether.wire.vocab import StallPolicy

__all__ = [
    "STATES",
    "AgentInfo",
    "AgentRef",
    "AgentState",
    "ChildTurnEnded",
    "Entry",
    "EntryKind",
    "Event",
    "KillVia",
    "MarkerAction",
    "Message",
    "Mode",
    "OnCrash",
    "Origin",
    "Outcome",
    "PendingMessage",
    "ProcessFate",
    "Recovered",
    "RecoveryCause",
    "SessionHeader",
    "Stop",
    "StopKind",
    "StopOrigin",
    "StopReport",
    "ToolFate",
    "TurnRecord",
    "UnknownCall",
    "Via",
    "message_key",
]

# One word per thing, as types: every record field that takes one of these is typed by it.
Mode = Literal["continuable", "one-shot"]
Outcome = Literal["completed", "cancelled", "aborted", "failed", "crashed"]
# A turn's cause: who stopped it (the watchdog's and the budget's stops are the system's).
Origin = Literal["user", "parent", "system"]
# Who issued a stop or a control; a marker and a stop report name it.
StopOrigin = Literal["user", "parent", "watchdog", "budget", "system"]
StopKind = Literal["cancel", "abort", "preempt", "pause"]
MarkerAction = Literal[
    "steered",
    "cancelled",
    "aborted",
    "preempted",
    "paused",
    "resumed",
    "forced",
    "escalated",
    "discarded",  # a steer no boundary took: a stop discarded it, or the turn ended first
    "recovered",  # a turn a crash interrupted runs on from its last step (semantics §17.1)
    # A tool call waits for a decision, and how it was decided (semantics §17.2).
    "approval",
    "approved",
    "denied",
    "approval-expired",
    "approval-cancelled",
]
# How a stop took effect: the driver took it at a boundary, or at an await it was in;
# or its tree was killed, whole by its cgroup or by the walk.
Via = Literal["boundary", "cancel-at-await", "cgroup", "walk", "recovery"]
# the kill's share of Via; "recovery": the host died, and a new one ended the turn as the
# stop accepted before said (semantics §17.1)
KillVia = Literal["cgroup", "walk", "recovery"]
# What a session's turn does when a crash interrupts it (semantics §17.1).
OnCrash = Literal["recover", "park"]
# What interrupted a recovered turn: its host stopped (a crash or a suspending close),
# or its worker died of something Tether did not do.
RecoveryCause = Literal["host", "worker"]
EntryKind = Literal["user", "assistant", "marker", "tool", "notice"]


class AgentState(enum.StrEnum):
    """An agent's lifecycle state (semantics §3); its transitions are the actors'."""

    RUNNING = "running"  # a turn is claimed (dispatched or waiting for a free worker)
    PAUSED = "paused"  # a turn is claimed but frozen in place until resumed
    IDLE = "idle"  # no turn, empty inbox
    PARKED = "parked"  # no turn; nothing starts until a waking send
    DISPOSING = "disposing"  # a disposal is under way
    DORMANT = "dormant"  # in the catalog, not materialized
    SETTLED = "settled"  # disposed or finished (one-shot); only records remain


STATES: tuple[str, ...] = tuple(s.value for s in AgentState)


def message_key(message_id: str) -> int:
    """The store's order of a message id (``m_17`` -> 17): ids sort by acceptance."""
    return int(message_id[2:])


class AgentRef(msgspec.Struct, frozen=True):
    """One activation of a session: its id and the epoch it was materialized in.

    A ref from an earlier epoch is stale: authority checks refuse it.
    """

    id: str
    epoch: int


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One inbox message. ``kind="notice"`` for a ``ChildTurnEnded`` notice.

    ``id`` is opaque (``m_17``) and sorts messages in the order they were accepted.
    """

    id: str
    session: str
    content: str
    data: dict[str, Any] | None = None
    kind: Literal["user", "notice"] = "user"
    sender: str | None = None
    created_at: float = 0.0
    # The W3C traceparent of the span that sent it (telemetry, semantics §16.3): the turn
    # that claims it is that span's child, however much later it starts.
    trace: str | None = None


class PendingMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One message waiting in an inbox, as ``Runtime.inbox`` lists it."""

    id: str
    kind: Literal["user", "notice"]
    sender: str | None = None
    created_at: float = 0.0
    preview: str = ""  # the first 200 characters of the content


class ChildTurnEnded(msgspec.Struct, frozen=True, kw_only=True):
    """What a parent's inbox receives when one of its subagents' turns ends."""

    child: str
    slug: str | None = None
    turn: str
    outcome: Outcome
    cause: Origin | None = None
    partial: str | None = None


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One transcript entry. Markers also carry ``action``, ``origin``, ``by``, ``reason``."""

    seq: int
    session: str
    kind: EntryKind
    text: str
    turn: str | None = None
    action: MarkerAction | None = None
    origin: StopOrigin | None = None
    by: str | None = None
    reason: str | None = None
    data: dict[str, Any] | None = None
    created_at: float = 0.0


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's start and (once ended) end record. ``outcome`` is None while it runs."""

    id: str
    session: str
    message_id: int
    message: str = ""  # the id of the message the turn claimed
    outcome: Outcome | None = None
    cause: Origin | None = None
    by: str | None = None
    forced: bool = False
    escalated: bool = False
    reason: str | None = None
    error: str | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    # The waking send (or notice) that started this turn on an idle, parked or held
    # session, in the host's own order; None when the turn followed its predecessor's
    # completion (semantics §4 rule 2). A turn after a stop always names one.
    woken_by: str | None = None
    # Token usage summed over the turn's model requests (semantics §15.2), e.g.
    # {"prompt_tokens": 12, "completion_tokens": 30}; None when nothing reported any.
    # ``"estimated": true`` when some of it is an estimate (a reply cut by a stop).
    usage: dict[str, int | bool] | None = None
    # What the turn's cgroup counted (semantics §15.5): {"cpu_ms", "processes",
    # "memory_peak_mb"}, each only where its controller is available; None without one.
    resources: dict[str, float] | None = None
    # How many times a crash interrupted this turn and it recovered (semantics §17.1).
    recoveries: int = 0


class UnknownCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call whose start was durable and whose result was not when its turn's host
    or worker died: it may or may not have taken effect."""

    key: str  # Tether's call key (``TETHER_CALL_ID``), unique in the store
    name: str
    arguments: str = ""
    tool_call_id: str | None = None  # the model's own id for the call, where it has one


class Recovered(msgspec.Struct, frozen=True, kw_only=True):
    """What a recovered turn's driver is told (``ctx.recovered``; semantics §17.1)."""

    attempt: int  # 1 for the first recovery of this turn
    cause: RecoveryCause
    steps: int  # this turn's durable entries kept (replies and tool results)
    unknown_calls: list[UnknownCall] = []


class AgentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A session as discovery sees it (semantics §7). A hint, never authority."""

    id: str
    slug: str | None
    parent: str | None
    depth: int
    mode: Mode
    state: AgentState
    pending: int = 0
    stopping: Literal["cancel", "abort"] | None = None
    turn: str | None = None
    dispatched: bool = False  # a running turn has a worker (False: it waits for one)
    approvals: tuple[str, ...] = ()  # its turn's pending approvals' ids (semantics §17.2)


class SessionHeader(msgspec.Struct, frozen=True, kw_only=True):
    """A session's durable header (semantics §1)."""

    id: str
    parent: str | None
    mode: Mode
    slug: str | None
    driver: str
    config: dict[str, Any] | None = None
    permissions: dict[str, Any] | None = None
    created_at: float = 0.0
    settled: bool = False
    # The stall watchdog's policy (semantics §14.5), completed by its check (``every`` and
    # ``nudge`` filled in), or None; a child without one inherits its parent's.
    stall: StallPolicy | None = None
    # Per-turn limits enforced by the turn's cgroup (semantics §15.5), or None:
    # {"memory_mb", "pids", "cpu"}; a child without its own inherits its parent's.
    limits: dict[str, float] | None = None
    # The budget of this session and its subtree (semantics §16.2), as it was set at creation
    # (``set_budget`` changes the stored one; the runtime's governor holds the live one).
    budget: Budget | None = None
    # What a crash does to this session's turn, and how often a turn may recover
    # (semantics §17.1); a child inherits both. ``recoverable``: its driver can continue
    # a turn from its last step (found when the session was opened).
    on_crash: OnCrash = "recover"
    max_recoveries: int = 3
    recoverable: bool = False
    # The spawn_agent call that made it: its parent's call key and which spawn of that
    # call (``<key>/<n>``), so that the call re-issued after a crash finds it (§17.1)
    spawned_by: str | None = None


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """Something an agent did, for observers (``Runtime.subscribe``, ``GET /events``).

    ``lineage`` holds the session's ancestor ids, root first, so "this session and its
    subtree" is ``q == ev.session or q in ev.lineage``.
    """

    name: str
    session: str
    lineage: tuple[str, ...] = ()
    data: dict[str, Any] = {}
    ts: float = 0.0


class ProcessFate(msgspec.Struct, frozen=True, kw_only=True):
    """One process a stop signalled (semantics §15.6): who it was and whether it died."""

    pid: int
    started: float  # its start time (seconds since the epoch): tells it from a reused pid
    argv: list[str] = []
    signal: str = "SIGKILL"
    fate: Literal["dead", "survived"] = "dead"


class ToolFate(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call open when a stop landed, and how it ended (semantics §15.6)."""

    name: str
    fate: Literal["returned", "preempted", "cancelled", "abandoned", "killed", "shielded"]
    call: str | None = None  # the tool call's id where it has one (an MCP request id)


class Stop(msgspec.Struct, frozen=True):
    """One stop as it was accepted: what (``kind``), who (``origin``, ``by``) and why.

    The one shape of a stop: the frames that carry it to a worker, the worker's answer that
    it took effect, the outcome's facts and the stop report are made from it, so the
    marker's text and the report's fields name the same stop. Hashable: a preempt in
    flight is found again by it when its worker answers.
    """

    kind: StopKind
    origin: StopOrigin
    by: str
    reason: str = ""


class StopReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one stop did to one turn, durable (semantics §15.6): ``rt.stop_report(turn)``.

    ``requested_at`` is when the stop was accepted, ``effective_at`` when it took effect
    (the boundary that delivered it, the await it cancelled, or the moment the kill was
    confirmed); ``via`` says how: ``boundary``, ``cancel-at-await``, ``cgroup``, ``walk``.
    A forced or escalated cancel took effect only by its kill, whatever reached the
    driver before; a cancel a shield held back took effect when the shield let it through.
    """

    turn: str
    session: str
    kind: StopKind
    origin: StopOrigin
    by: str
    reason: str = ""
    requested_at: float = 0.0
    effective_at: float | None = None
    latency_ms: float | None = None
    outcome: Outcome | None = None
    forced: bool = False
    escalated: bool = False
    via: Via | None = None
    processes: list[ProcessFate] = []
    tools: list[ToolFate] = []
    partial: str | None = None

    @property
    def stop(self) -> Stop:
        """The stop this reports on."""
        return Stop(self.kind, self.origin, self.by, self.reason)
