"""What the actors need from the outside world, as Protocols.

``runtime`` implements these and passes them in, so no import runs from ``actors`` up
into ``runtime``. The executor queues frames and kills without waiting on a worker, and
the store queues writes for its writer thread (a caller that needs durability waits on
the returned ``Durable``); ``Executor.freeze``/``thaw`` and ``AgentStore.pending`` are
the exceptions, and wait on the caller's thread (docs/design.md, section 14).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tether.actors.outcomes import TurnOutcome
from tether.wire.approval import Approval
from tether.wire.frames import (
    Delivered,
    Escalating,
    HostFrame,
    Progress,
    Say,
    Steer,
    ToolCall,
    ToolKilled,
    ToolReply,
    Trace,
    TurnEnd,
)
from tether.wire.records import (
    EntryKind,
    KillVia,
    MarkerAction,
    Message,
    ProcessFate,
    Recovered,
    SessionHeader,
    StopOrigin,
    StopReport,
    UnknownCall,
)

__all__ = [
    "AgentStore",
    "Durable",
    "EndRecord",
    "EventSink",
    "Executor",
    "Keep",
    "KeptTurn",
    "ParentNotice",
    "TurnOver",
    "TurnSink",
    "TurnSpec",
]


class TurnSink(Protocol):
    """Where the executor reports what happened to a turn (called from its threads).

    Every report of one turn, its driver's entries (``said``) included, goes through the
    one sink in the order its worker sent it: the session's host then writes the
    transcript alone, so a marker always precedes the driver's reaction to it.
    """

    def said(self, frame: Say) -> None: ...
    def delivered(self, frame: Delivered) -> None: ...
    def tool_killed(self, frame: ToolKilled) -> None: ...
    def progress(self, frame: Progress) -> None: ...
    def escalating(self, frame: Escalating) -> None: ...
    def usage(self, turn: str, usage: dict[str, int]) -> None:
        """One response's usage, as it was reported (the budgets', semantics §16.2): a
        ``Usage`` frame's, or a ``Say``'s that brought its response's usage."""

    def begin_call(self, frame: ToolCall, answer: Callable[[ToolReply], None]) -> None:
        """A tool call's start, to make durable before the tool runs (semantics §17.1):
        ``answer`` gets its call key once it is (or the error), on any thread."""

    def started(self, turn: str) -> None:
        """A worker took ``turn`` (told only of a turn whose spec is ``watched``)."""

    def ended(self, over: TurnOver) -> None:
        """The turn is over: its one report, after which nothing more is said of it."""


@dataclass(frozen=True, slots=True, eq=False)
class TurnSpec:
    """One claimed turn as its session decided it, handed to the executor.

    Immutable: what becomes of the turn after (its held frames, its worker, how it died)
    is the executor's, and comes back in :class:`TurnOver`.
    """

    turn: str
    session: str
    driver: str
    message: Message
    config: dict[str, Any] | None
    permissions: dict[str, Any] | None
    sink: TurnSink
    progress_every: float | None = None  # see RunTurn
    repeat: int | None = None
    # The claim's durability (the store's ticket for ``start_turn``): the turn reaches a
    # worker only once it is done, so a claim lost to a failed commit never runs work
    # that a restart would run again.
    claim: Durable | None = None
    # The session's limits (semantics §15.5), applied by the executor to the turn's cgroup.
    limits: dict[str, float] | None = None
    trace: Trace | None = None  # telemetry on: the turn span the worker's spans join
    # The session's watchdog runs from when a worker takes the turn, never while it waits
    # for one: the executor says when (``TurnSink.started``), and only then, as it costs
    # a message to the session's host.
    watched: bool = False
    # Set when a crash interrupted this turn and it runs on (semantics §17.1).
    recovered: Recovered | None = None


@dataclass(frozen=True, slots=True)
class TurnOver:
    """A turn's one report from the executor: its end, or how it died."""

    turn: str
    end: TurnEnd | None  # None: its worker did not end it (killed, crashed, never started)
    error: str | None = None  # why, when ``end`` is None
    # How its tree was killed (the stop report, semantics §15.6), and every process
    # signalled, with its fate; what the turn's cgroup counted.
    via: KillVia | None = None
    processes: tuple[ProcessFate, ...] = ()
    resources: dict[str, float] | None = None
    # Its worker died of something Tether did not do (a SIGKILL from outside, the OOM
    # killer, a segfault): a crash, which a recoverable turn recovers from (§17.1).
    crashed: bool = False


class Executor(Protocol):
    """Runs turns in worker processes. Every method returns at once but ``freeze`` and
    ``thaw``, which wait (bounded) until the tree is stopped or continued."""

    def submit(self, spec: TurnSpec) -> None: ...
    def signal(self, turn: str, frame: HostFrame) -> None:
        """Send a frame to the worker running ``turn`` (held until it is dispatched)."""

    def kill(self, turn: str) -> None:
        """Kill the whole process tree running ``turn`` now; report through the sink."""

    def accepting(self) -> bool:
        """False once the runtime drains: no new turn may start."""

    def freeze(self, turn: str) -> None:
        """Stop ``turn`` in place (SIGSTOP its worker's group and every escapee); a turn
        still waiting for a worker is held back until thawed. Waits on the caller's
        thread, bounded: the walk's SIGSTOPs, a cgroup's ``frozen 1``, Ray's reaper."""

    def thaw(self, turn: str) -> None:
        """Undo ``freeze``: SIGCONT exactly what it stopped."""

    def dispatched(self, turn: str) -> bool:
        """True once a worker has taken ``turn`` (False while it waits for one)."""

    def waiting(self, turn: str, on: bool) -> None:
        """``turn`` waits on approvals alone (``on``), or no more: while it does, it
        counts against no worker slot, and other turns start beside it (§17.2)."""

    def disposed(self, sessions: list[str]) -> None:
        """``sessions`` are settled for good: tell the workers that may keep something
        of theirs across turns (a kit's tool servers), so that it goes. Best effort, and
        never waits on a worker: a dead, busy or paused one holds nothing up."""


class Durable(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...
    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` once done (at once if done); ``error`` None: committed."""


# What a start on a store does with a turn a dead host left open (semantics §17.1).
Keep = Literal["recover", "end", "exhausted"]


@dataclass(frozen=True, slots=True)
class KeptTurn:
    """A turn a dead host left open that recovers on this one: its session, id, the
    message it claimed, how often it recovered before, its row in the store; and the
    controls that dead host had accepted for it (semantics §17.1): the cancel or abort
    that stands (its report, not yet completed), the pause in force (origin, by,
    reason), the steers no boundary took yet, in order."""

    session: str
    turn: str
    message: Message
    recoveries: int
    row: int
    stop: StopReport | None = None
    paused: tuple[StopOrigin, str, str] | None = None
    steers: tuple[Steer, ...] = ()


@dataclass(frozen=True, slots=True)
class ParentNotice:
    """A message for a parent's inbox, written with its child's turn end (one commit:
    a host killed between the two would leave a turn end nobody is told of)."""

    parent: str
    content: str
    data: dict[str, Any]
    sender: str
    trace: str | None = None  # the child's turn span: the parent's next turn follows it


@dataclass(frozen=True, slots=True)
class EndRecord:
    """What the store records at a turn's end: its outcome whole, what it produced and
    spent, and the parent's notice (committed with it, or neither is)."""

    outcome: TurnOutcome
    final: str | None = None  # the turn's final text, written as an assistant entry
    usage: dict[str, int] | None = None
    resources: dict[str, float] | None = None
    notice: ParentNotice | None = None


class AgentStore(Protocol):
    """The durable operations the session actors perform; writes are queued."""

    @property
    def failed(self) -> bool:
        """A commit failed for good: no claim can be made durable, so no turn starts."""

    def own_writes(self) -> None:
        """The calling thread (a host's) commits the writes it queues, with
        ``commit_own``, rather than waking the store's writer thread for each."""

    def commit_own(self) -> None:
        """Commit what this thread queued since its last call (or hand it to the
        writer thread when that cannot be done at once)."""

    def create_session(self, row: SessionHeader) -> Durable: ...
    def append_message(
        self,
        session: str,
        content: str,
        *,
        data: dict[str, Any] | None = None,
        kind: str = "user",
        sender: str | None = None,
        trace: str | None = None,
    ) -> tuple[Message, Durable]: ...
    def pending(self, session: str) -> tuple[list[Message], int]: ...
    def close_message(self, message_id: str) -> None: ...
    def pending_count(self, session: str) -> int: ...
    def start_turn(self, turn: str, message: Message, woken_by: str | None = None) -> Durable: ...
    def end_turn(self, turn: str, record: EndRecord) -> Message | None: ...
    def append_entry(
        self,
        session: str,
        kind: EntryKind,
        text: str,
        *,
        turn: str | None = None,
        action: MarkerAction | None = None,
        origin: StopOrigin | None = None,
        by: str | None = None,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> Any: ...
    def begin_call(
        self,
        key: str,
        session: str,
        turn: str,
        name: str,
        arguments: str,
        tool_call_id: str | None,
    ) -> Durable:
        """Record a tool call's start (its write-ahead, semantics §17.1), after every
        write queued before it."""

    def recovered(self, turn: str, recoveries: int) -> Durable: ...
    def turn_steps(self, session: str, turn: str) -> int: ...
    def last_assistant_text(self, session: str, turn: str) -> str | None: ...
    def unknown_calls(self, session: str, turn: str) -> list[UnknownCall]: ...
    def settle(self, session: str) -> Durable: ...
    def dispose_accepted(self, sessions: list[str]) -> Durable:
        """Record that a disposal of ``sessions`` was accepted (finished at recovery if
        a host kill cuts it short)."""

    def put_approval(self, a: Approval) -> Durable:
        """Queue an approval's record (semantics §17.2): new, or decided over its pending
        one; done once durable."""

    def put_stop_report(self, report: StopReport) -> None:
        """Queue a turn's stop report (semantics §15.6), replacing the turn's earlier one."""

    def put_steer(self, turn: str, steer: Steer) -> None:
        """Queue a steer accepted for ``turn`` (delivered after a crash, §17.1)."""

    def barrier(self) -> Durable:
        """Done once every write queued before it is durable (or refused, if its commit
        fails): a control is answered then (semantics §17.1)."""


class EventSink(Protocol):
    """Observers of what agents do: events for /events, and status for waiters."""

    def emit(
        self, name: str, session: str, lineage: tuple[str, ...], data: dict[str, Any]
    ) -> None: ...
    def wants(self, name: str) -> bool:
        """False when nobody would see the event: the agent skips building it."""
