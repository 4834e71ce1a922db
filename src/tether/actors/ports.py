"""What the actors need from the outside world, as Protocols.

``runtime`` implements these and passes them in, so no import runs from ``actors`` up
into ``runtime``. The executor queues frames and kills without waiting on a worker, and
the store queues writes for its writer thread (a caller that needs durability waits on
the returned ``Durable``); ``Executor.freeze``/``thaw`` and ``AgentStore.pending`` are
the exceptions, and wait on the caller's thread (docs/design.md, section 14).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from tether.wire.errors import InvalidParams
from tether.wire.frames import (
    CancelFrame,
    Delivered,
    Escalating,
    HostFrame,
    Preempt,
    Progress,
    RunTurn,
    Say,
    SteerFrame,
    ToolKilled,
    Trace,
    TurnEnd,
    Usage,
)
from tether.wire.records import Message, ProcessFate, SessionHeader, StopReport

__all__ = [
    "HELD_BYTES",
    "AgentStore",
    "Durable",
    "EventSink",
    "Executor",
    "ParentNotice",
    "TurnJob",
    "TurnSink",
    "held_over",
]


# Steers and preempts waiting for a turn that cannot take them now (it waits for a
# worker, or its worker is paused and stops reading), in encoded bytes: past this one is
# refused when issued. It keeps a paused turn's memory bounded, and a turn's start frame
# (which carries what was held) far under the frame cap.
HELD_BYTES = 1 << 20
_held_encoder = msgspec.msgpack.Encoder()


def held_over(frame: HostFrame, held: int) -> InvalidParams:
    """The refusal of a steer or preempt that would pass HELD_BYTES."""
    what = "steer" if isinstance(frame, SteerFrame) else "preempt"
    return InvalidParams(
        f"{what} refused: {held} bytes of steers and preempts already wait for this turn,"
        f" which cannot take them now (it is paused, or waits for a worker); at most"
        f" {HELD_BYTES} bytes may wait. Resume the turn, or wait for it to start."
    )


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
    def usage(self, frame: Usage) -> None:
        """One response's usage, as it was reported (the budgets', semantics §16.2)."""

    def ended(self, turn: str, end: TurnEnd | None, error: str | None) -> None:
        """``end`` is None when the worker died (killed, or crashed: ``error`` says)."""


@dataclass(eq=False)
class TurnJob:
    """One claimed turn, handed to the executor."""

    turn: str
    session: str
    driver: str
    message: Message
    config: dict[str, Any] | None
    permissions: dict[str, Any] | None
    sink: TurnSink
    pending: list[HostFrame] = field(default_factory=list)
    # The turn's latest assistant text, kept by the session's host as the worker says
    # it, so the turn's end can name its partial work without reading the store.
    last_say: str | None = None
    progress_every: float | None = None  # see RunTurn
    # When a worker took the turn (``time.monotonic()``, set by the executor as it
    # dispatches): the stall watchdog's clock runs from there, never while the turn
    # waits for a free worker. None while it waits. The watchdog reads it against the
    # session's clock: a runtime's hosts use the system clock, as this does; a test
    # clock drives a session with no executor.
    started_at: float | None = None
    repeat: int | None = None
    frozen: bool = False  # paused before a worker took it: held back until thawed
    held_bytes: int = 0  # steers and preempts in ``pending``, encoded (see ``hold``)
    # Filled by the executor when it kills the turn's tree, before it reports the end
    # (the stop report, semantics §15.6): how the tree was killed ("cgroup" or "walk") and
    # every process signalled, with its fate.
    kill_via: str | None = None
    kill_procs: list[ProcessFate] = field(default_factory=list)
    # The claim's durability (the store's ticket for ``start_turn``): the turn reaches a
    # worker only once it is done, so a claim lost to a failed commit never runs work
    # that a restart would run again.
    claim: Durable | None = None
    # The session's limits (semantics §15.5), applied by the executor to the turn's cgroup,
    # and what that cgroup counted for the turn, filled before the end is reported.
    limits: dict[str, float] | None = None
    resources: dict[str, float] | None = None
    trace: Trace | None = None  # telemetry on: the turn span the worker's spans join

    def hold(self, frame: HostFrame) -> None:
        """Keep ``frame`` until a worker takes this turn (it rides in the start frame).

        Steers and preempts count against HELD_BYTES and one past it is refused
        (InvalidParams, nothing kept); a cancel, an escalation or an answer is never
        refused. Every executor holds a waiting turn's frames here, so the bound has one
        home whatever holds the turn (the claim gate, the pool, Ray's scheduler).
        """
        if isinstance(frame, SteerFrame | Preempt):
            size = len(_held_encoder.encode(frame))
            if self.held_bytes + size > HELD_BYTES:
                raise held_over(frame, self.held_bytes)
            self.held_bytes += size
        self.pending.append(frame)

    def start(self) -> tuple[RunTurn, list[HostFrame]]:
        """The frame that starts this turn on a worker, and the frames held for it that
        follow it, in order; ``pending`` is left empty. Steers and a cancel issued before
        dispatch ride inside RunTurn, so the driver has them at its very first boundary
        (sent after it, they could reach the worker's reader only once the driver had
        passed that boundary)."""
        held = [f for f in self.pending if isinstance(f, SteerFrame | CancelFrame)]
        rest: list[HostFrame] = [
            f for f in self.pending if not isinstance(f, SteerFrame | CancelFrame)
        ]
        self.pending.clear()
        self.held_bytes = 0
        run = RunTurn(
            turn=self.turn,
            session=self.session,
            driver=self.driver,
            message=self.message,
            config=self.config,
            permissions=self.permissions,
            progress_every=self.progress_every,
            repeat=self.repeat,
            held=held,
            trace=self.trace,
        )
        return run, rest


class Executor(Protocol):
    """Runs turns in worker processes. Every method returns at once but ``freeze`` and
    ``thaw``, which wait (bounded) until the tree is stopped or continued."""

    def submit(self, job: TurnJob) -> None: ...
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

    def disposed(self, sessions: list[str]) -> None:
        """``sessions`` are settled for good: tell the workers that may keep something
        of theirs across turns (a kit's tool servers), so that it goes. Best effort, and
        never waits on a worker: a dead, busy or paused one holds nothing up."""


class Durable(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...
    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` once done (at once if done); ``error`` None: committed."""


@dataclass(frozen=True, slots=True)
class ParentNotice:
    """A message for a parent's inbox, written with its child's turn end (one commit:
    a host killed between the two would leave a turn end nobody is told of)."""

    parent: str
    content: str
    data: dict[str, Any]
    sender: str
    trace: str | None = None  # the child's turn span: the parent's next turn follows it


class AgentStore(Protocol):
    """The durable operations the session actors perform; writes are queued."""

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
    def end_turn(
        self,
        turn: str,
        *,
        outcome: str,
        cause: str | None = None,
        by: str | None = None,
        forced: bool = False,
        escalated: bool = False,
        reason: str | None = None,
        error: str | None = None,
        final: str | None = None,
        usage: dict[str, int] | None = None,
        resources: dict[str, float] | None = None,
        notice: ParentNotice | None = None,
    ) -> Message | None: ...
    def append_entry(
        self,
        session: str,
        kind: str,
        text: str,
        *,
        turn: str | None = None,
        action: str | None = None,
        origin: str | None = None,
        by: str | None = None,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> Any: ...
    def settle(self, session: str) -> Durable: ...
    def dispose_accepted(self, sessions: list[str]) -> Durable:
        """Record that a disposal of ``sessions`` was accepted (finished at recovery if
        a host kill cuts it short)."""

    def put_stop_report(self, report: StopReport) -> None:
        """Queue a turn's stop report (semantics §15.6), replacing the turn's earlier one."""


class EventSink(Protocol):
    """Observers of what agents do: events for /events, and status for waiters."""

    def emit(
        self, name: str, session: str, lineage: tuple[str, ...], data: dict[str, Any]
    ) -> None: ...
    def wants(self, name: str) -> bool:
        """False when nobody would see the event: the agent skips building it."""
