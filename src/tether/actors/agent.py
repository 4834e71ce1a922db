"""One live session: its inbox, its state, its current turn and pending interrupts.

The actor never blocks: a turn runs in a worker, so each message here is short
bookkeeping (a store write, a frame handed to the executor, a timer armed). It never
asks another actor; it only tells the supervisor, so no cycle of waits can form.

Requested is kept apart from took-effect: ``_Turn.stop`` records the issued stop (the
first one stands; an abort overrides a cancel), ``delivered`` records that the driver
saw the cancel at a boundary, and the outcome is decided only when the turn has ended.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import pykka
import structlog

from tether.actors._ids import new_id
from tether.actors.ports import AgentStore, EventSink, Executor, TurnJob
from tether.actors.states import AgentState, check_transition
from tether.wire.errors import InvalidParams, TetherError
from tether.wire.frames import (
    Cancel,
    CancelFrame,
    Delivered,
    Preempt,
    Steer,
    SteerFrame,
    ToolKilled,
    TurnEnd,
)
from tether.wire.records import AgentInfo, ChildTurnEnded, Message, SessionHeader
from tether.wire.text import marker_text

__all__ = [
    "AgentActor",
    "AgentStatus",
    "Dispose",
    "Enqueue",
    "Interrupt",
    "Release",
    "Settled",
    "StatusCell",
    "Sync",
    "TurnNotice",
    "make_info",
]

log = structlog.get_logger("tether.agent")
_stdlib_log = logging.getLogger("tether.agent")


def _debug() -> bool:
    """Per-turn debug events are skipped cheaply unless debug logging is on."""
    return _stdlib_log.isEnabledFor(logging.DEBUG)


Wake = Literal["yes", "no", "if-idle"]


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """An immutable snapshot, swapped in whole so readers on other threads see one state."""

    state: AgentState
    pending: int = 0
    stopping: str | None = None
    turn: str | None = None


class StatusCell:
    """Where the agent publishes its status for the supervisor's discovery walk.

    ``info`` is the same status as discovery returns it (depth counted from the tree's
    root), built once per change so that listing ten thousand sessions copies references.

    Sends that need no decision from the agent do not wake its actor; they count
    themselves in ``quiet`` and the agent takes the count at its next decision point (a
    waking send, a turn's end, a status query). Those are: a non-waking send, and a
    waking send while a turn runs with no stop issued (``busy``): the turn's auto-drain
    will take it, exactly as if the agent had been told. ``busy`` is cleared, under the
    same lock, when the turn ends and as soon as a stop is issued, so a waking send that
    must latch or start a turn always reaches the actor. The same flag lets a steer or a
    preempt go straight to the busy turn's worker (``busy_turn``): they change nothing
    the actor keeps, and a stop issued first has already cleared it.
    """

    __slots__ = ("_busy", "_lock", "_turn", "info", "quiet", "status")

    def __init__(self, status: AgentStatus, header: SessionHeader, depth: int) -> None:
        self.status = status
        self.info = make_info(header, depth, status)
        self.quiet = 0
        self._busy = False
        self._turn: str | None = None
        self._lock = threading.Lock()

    def add_quiet(self, *, wake: bool) -> bool:
        """Count a send without waking the actor; False when the actor must be told."""
        with self._lock:
            if wake and not self._busy:
                return False
            self.quiet += 1
            return True

    def take_quiet(self) -> int:
        with self._lock:
            n, self.quiet = self.quiet, 0
        return n

    def turn_changed(self, turn: str | None) -> int:
        """A turn began (busy: no stop yet) or ended (None); take the quiet count."""
        with self._lock:
            n, self.quiet = self.quiet, 0
            self._turn = turn
            self._busy = turn is not None
        return n

    def stop_issued(self) -> None:
        with self._lock:
            self._busy = False

    def claim_stop(self) -> str | None:
        """Issue the one stop of the busy turn: its id if it had none yet, else None."""
        with self._lock:
            if not self._busy:
                return None
            self._busy = False
            return self._turn

    def busy_turn(self) -> str | None:
        """The running turn when no stop has been issued for it, else None."""
        with self._lock:
            return self._turn if self._busy else None


def make_info(header: SessionHeader, depth: int, status: AgentStatus) -> AgentInfo:
    return AgentInfo(
        id=header.id,
        slug=header.slug,
        parent=header.parent,
        depth=depth,
        mode=header.mode,
        state=str(status.state),
        pending=status.pending,
        stopping=status.stopping,
        turn=status.turn,
    )


# ---- messages the agent receives ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Enqueue:
    """``count`` messages were durably appended to the inbox."""

    wake: Wake
    count: int = 1


@dataclass(frozen=True, slots=True)
class Interrupt:
    kind: str
    origin: str
    by: str
    reason: str
    grace: float
    deadline: float | None = None
    # Set when the caller already sent the cancel frame to this turn's worker itself
    # (see StatusCell.claim_stop): the agent records the stop and does not send it again.
    turn: str | None = None
    signalled: bool = False


@dataclass(frozen=True, slots=True)
class Dispose:
    origin: str
    by: str
    grace: float


@dataclass(frozen=True, slots=True)
class Sync:
    """Asked: answered once every message told before it has been handled."""


@dataclass(frozen=True, slots=True)
class Release:
    """Asked by the supervisor: stop this activation unless a turn is running."""


@dataclass(frozen=True, slots=True)
class _Delivered:
    frame: Delivered


@dataclass(frozen=True, slots=True)
class _ToolKilled:
    frame: ToolKilled


@dataclass(frozen=True, slots=True)
class _Ended:
    turn: str
    end: TurnEnd | None
    error: str | None


@dataclass(frozen=True, slots=True)
class _Timer:
    turn: str
    which: Literal["grace", "deadline"]


# ---- messages the agent tells the supervisor -----------------------------------------


@dataclass(frozen=True, slots=True)
class TurnNotice:
    parent: str
    notice: ChildTurnEnded


@dataclass(frozen=True, slots=True)
class Settled:
    session: str


def _tell(ref: pykka.ActorRef[Any], message: Any) -> None:
    """Tell from a pool or timer thread; an actor already stopped (at close) is fine."""
    with contextlib.suppress(pykka.ActorDeadError):
        ref.tell(message)


class _Sink:
    """The executor's view of one turn: every report becomes a message to the actor."""

    __slots__ = ("_ref",)

    def __init__(self, ref: pykka.ActorRef[Any]) -> None:
        self._ref = ref

    def delivered(self, frame: Delivered) -> None:
        _tell(self._ref, _Delivered(frame))

    def tool_killed(self, frame: ToolKilled) -> None:
        _tell(self._ref, _ToolKilled(frame))

    def ended(self, turn: str, end: TurnEnd | None, error: str | None) -> None:
        _tell(self._ref, _Ended(turn, end, error))


@dataclass(slots=True)
class _Stop:
    kind: Literal["cancel", "abort"]
    origin: str
    by: str
    reason: str
    grace: float


@dataclass(slots=True)
class _Turn:
    id: str
    message: Message
    stop: _Stop | None = None
    delivered: bool = False
    forced: bool = False
    escalated: bool = False
    wake_latch: bool = False
    timers: list[threading.Timer] = field(default_factory=list)


class AgentActor(pykka.ThreadingActor):
    """The actor of one live session (one activation)."""

    def __init__(
        self,
        *,
        header: SessionHeader,
        lineage: tuple[str, ...],
        cell: StatusCell,
        pending: int,
        hold: bool,
        store: AgentStore,
        executor: Executor,
        events: EventSink,
        supervisor: pykka.ActorRef[Any],
    ) -> None:
        super().__init__()
        self._header = header
        self._lineage = lineage
        self._cell = cell
        self._pending = pending
        self._hold = hold
        self._store = store
        self._executor = executor
        self._events = events
        self._supervisor = supervisor
        self._turn: _Turn | None = None
        self._started = 0
        self._disposing = False
        self._settled = False
        self._sink: _Sink | None = None

    def on_start(self) -> None:
        self._sink = _Sink(self.actor_ref)
        self._start_next()
        self._publish()

    def on_stop(self) -> None:
        if self._turn is not None:
            self._cancel_timers(self._turn)

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, Sync):
            self._absorb_quiet()
            self._publish()
            return None
        if isinstance(message, Release):
            if self._turn is not None:
                raise InvalidParams(
                    f"session {self._header.id} is running a turn; interrupt it before release"
                )
            self.stop()
            return None
        try:
            self._handle(message)
        except Exception:  # one bad message must not stop the session's actor
            log.exception("agent.error", session=self._header.id, message=type(message).__name__)
        self._publish()
        return None

    def _handle(self, message: Any) -> None:
        match message:
            case Enqueue():
                self._enqueue(message)
            case Interrupt():
                self._interrupt(message)
            case _Delivered(frame):
                self._delivered(frame)
            case _ToolKilled(frame):
                t = self._turn
                if t is not None and t.id == frame.turn:
                    self._marker(t, "preempted", frame.origin, frame.by, frame.reason)
            case _Ended():
                self._ended(message)
            case _Timer():
                self._timer(message)
            case Dispose():
                self._dispose(message)

    # ---- inbox --------------------------------------------------------------------

    def _absorb_quiet(self, n: int | None = None) -> None:
        """Count the sends that arrived without telling us (see StatusCell)."""
        if n is None:
            n = self._cell.take_quiet()
        if n:
            self._pending += n
            if self._turn is None:
                self._hold = True  # as each would have: wake=False on a session at rest

    def _enqueue(self, msg: Enqueue) -> None:
        if self._settled:
            return
        self._absorb_quiet()
        self._pending += msg.count
        t = self._turn
        if msg.wake == "yes":
            if t is not None:
                if t.stop is not None:
                    t.wake_latch = True  # resume the queue when the stopping turn ends
            else:
                self._hold = False
                self._start_next()
        elif msg.wake == "if-idle":
            if t is None and not self._hold:
                self._start_next()
        elif t is None:
            self._hold = True

    def _can_start(self) -> bool:
        return (
            self._turn is None
            and not self._disposing
            and not self._settled
            and not self._hold
            and self._pending > 0
            and self._executor.accepting()
            and (self._header.mode != "one-shot" or self._started == 0)
        )

    def _start_next(self) -> None:
        if not self._can_start():
            return
        turn_id = new_id("t_")
        message = self._store.claim_next(self._header.id, turn_id)
        self._begin(turn_id, message)

    def _begin(self, turn_id: str, message: Message | None) -> None:
        """Hand a claimed message to the executor as a new turn."""
        if message is None:
            self._pending = 0  # the store had less than we counted: it is the truth
            return
        h = self._header
        self._pending -= 1
        self._started += 1
        self._turn = _Turn(turn_id, message)
        # from here on waking sends may count quietly: this turn's auto-drain takes them
        self._absorb_quiet(self._cell.turn_changed(turn_id))
        assert self._sink is not None
        job = TurnJob(
            turn=turn_id,
            session=h.id,
            driver=h.driver,
            message=message,
            config=h.config,
            permissions=h.permissions,
            sink=self._sink,
        )
        try:
            self._executor.submit(job)
        except TetherError as exc:  # closed under us: end the claimed turn, never leave it open
            self._ended(_Ended(turn_id, None, exc.message))
            return
        if _debug():
            log.debug("turn.started", session=h.id, turn=turn_id, message=message.id)
        if self._events.wants("turn.started"):
            self._emit("turn.started", {"turn": turn_id, "message": message.id})

    # ---- interrupts ---------------------------------------------------------------

    def _interrupt(self, i: Interrupt) -> None:
        sid = self._header.id
        t = self._turn
        if self._disposing or self._settled or t is None:
            if i.kind == "steer":
                log.info("interrupt.dropped", session=sid, kind=i.kind, why="no running turn")
            return
        self._signal(t, i)
        log.info("interrupt.accepted", session=sid, turn=t.id, kind=i.kind, by=i.by)

    def _signal(self, t: _Turn, i: Interrupt) -> None:
        sid = self._header.id
        match i.kind:
            case "steer":
                if t.stop is not None:
                    log.info("interrupt.dropped", session=sid, kind="steer", why="turn is stopping")
                    return
                self._executor.signal(t.id, SteerFrame(t.id, Steer(i.reason, i.origin, i.by)))
            case "preempt":
                self._executor.signal(t.id, Preempt(t.id, i.reason, i.origin, i.by))
            case "cancel":
                if t.stop is not None or (i.turn is not None and i.turn != t.id):
                    return  # one pending stop per turn: the first one stands
                t.stop = _Stop("cancel", i.origin, i.by, i.reason, i.grace)
                self._cell.stop_issued()
                if not i.signalled:
                    # the signal first, the bookkeeping after: the worker must not wait on SQLite
                    frame = CancelFrame(t.id, Cancel(i.reason, i.origin, i.by))
                    self._executor.signal(t.id, frame)
                self._marker(t, "cancelled", i.origin, i.by, i.reason)
                if i.deadline is not None:
                    self._arm(t, i.deadline, "deadline")
            case "abort":
                if t.stop is not None and t.stop.kind == "abort":
                    return
                t.stop = _Stop("abort", i.origin, i.by, i.reason, i.grace)
                self._cell.stop_issued()
                self._executor.kill(t.id)
                self._marker(t, "aborted", i.origin, i.by, i.reason)

    def _delivered(self, frame: Delivered) -> None:
        t = self._turn
        if t is None or t.id != frame.turn:
            return
        for steer in frame.steers:
            self._marker(t, "steered", steer.origin, steer.by, steer.text)
        if frame.cancel and not t.delivered and t.stop is not None:
            t.delivered = True
            self._cancel_timers(t)  # a boundary was reached: no escalation
            self._arm(t, t.stop.grace, "grace")

    def _timer(self, tm: _Timer) -> None:
        t = self._turn
        if t is None or t.id != tm.turn or t.stop is None or t.stop.kind != "cancel":
            return
        if tm.which == "grace":
            t.forced = True
            self._marker(
                t, "forced", "system", "system", f"no end {t.stop.grace:g}s after the cancel"
            )
        else:
            if t.delivered:
                return
            t.escalated = True
            self._marker(t, "escalated", "system", "system", "no boundary before the deadline")
        self._executor.kill(t.id)

    def _arm(self, t: _Turn, delay: float, which: Literal["grace", "deadline"]) -> None:
        timer = threading.Timer(max(delay, 0.0), _tell, args=(self.actor_ref, _Timer(t.id, which)))
        timer.daemon = True
        t.timers.append(timer)
        timer.start()

    def _cancel_timers(self, t: _Turn) -> None:
        for timer in t.timers:
            timer.cancel()
        t.timers.clear()

    def _marker(self, t: _Turn, action: str, origin: str, by: str, reason: str) -> None:
        text = marker_text(action, origin, by, reason)
        entry = self._store.append_entry(
            self._header.id,
            "marker",
            text,
            turn=t.id,
            action=action,
            origin=origin,
            by=by,
            reason=reason,
        )
        if self._events.wants("marker"):
            self._emit("marker", {"entry": msgspec.to_builtins(entry)})

    # ---- turn end -----------------------------------------------------------------

    def _ended(self, e: _Ended) -> None:
        t = self._turn
        if t is None or t.id != e.turn:
            return
        # sent while the turn ran: the auto-drain below may claim them; from here on every
        # waking send is told to us again
        self._absorb_quiet(self._cell.turn_changed(None))
        self._cancel_timers(t)
        h = self._header
        stop = t.stop
        cause: str | None
        by: str | None
        reason: str | None
        error = e.end.error if e.end is not None else e.error
        if stop is not None:
            outcome = "aborted" if stop.kind == "abort" or t.escalated else "cancelled"
            cause, by, reason = stop.origin, stop.by, stop.reason
            if e.end is None:
                error = None  # killed on purpose: the stop says why
        elif e.end is None:
            outcome, cause, by, reason = "crashed", "system", None, None
        else:
            outcome = "failed" if e.end.outcome == "failed" else "completed"
            cause = by = reason = None
        final = e.end.final if e.end is not None else None
        self._turn = None
        if outcome != "completed":
            self._hold = not t.wake_latch  # park the inbox unless a waking send latched
        next_turn = new_id("t_") if self._can_start() else None
        message = self._store.end_turn(
            t.id,
            outcome=outcome,
            cause=cause,
            by=by,
            forced=t.forced,
            escalated=t.escalated,
            reason=reason,
            error=error,
            final=final,
            next_turn=next_turn,
        )
        record = {
            "turn": t.id,
            "outcome": outcome,
            "cause": cause,
            "by": by,
            "forced": t.forced,
            "escalated": t.escalated,
            "reason": reason,
            "error": error,
        }
        if outcome != "completed":
            log.info("turn.ended", session=h.id, **record)
        elif _debug():
            log.debug("turn.ended", session=h.id, **record)
        if self._events.wants("turn.ended"):
            self._emit("turn.ended", record)
        if h.parent is not None:
            notice = ChildTurnEnded(
                child=h.id,
                slug=h.slug,
                turn=t.id,
                outcome=outcome,
                cause=cause,
                partial=final if final is not None else self._store.last_assistant_text(h.id, t.id),
            )
            self._supervisor.tell(TurnNotice(h.parent, notice))
        if h.mode == "one-shot" or self._disposing:
            self._settle()
        elif next_turn is not None:
            self._begin(next_turn, message)

    # ---- disposal -----------------------------------------------------------------

    def _dispose(self, d: Dispose) -> None:
        if self._disposing or self._settled:
            return
        t = self._turn
        if t is None:
            self._disposing = True
            self._settle()
            return
        if t.stop is None:  # cancel with grace; no boundary within grace escalates to abort
            self._interrupt(Interrupt("cancel", d.origin, d.by, "disposed", d.grace, d.grace))
        elif not t.delivered and t.stop.kind == "cancel":
            self._arm(t, d.grace, "deadline")
        self._disposing = True  # after the cancel: interrupts to a disposing session are no-ops

    def _settle(self) -> None:
        self._settled = True
        self._store.settle(self._header.id)
        self._publish()
        self._supervisor.tell(Settled(self._header.id))
        self.stop()

    # ---- status -------------------------------------------------------------------

    def _derive(self) -> AgentStatus:
        t = self._turn
        if self._settled:
            state = AgentState.SETTLED
        elif self._disposing:
            state = AgentState.DISPOSING
        elif t is not None:
            state = AgentState.RUNNING
        elif self._pending == 0 and not self._hold:
            state = AgentState.IDLE
        else:
            state = AgentState.PARKED
        stopping = t.stop.kind if t is not None and t.stop is not None else None
        return AgentStatus(state, max(self._pending, 0), stopping, t.id if t else None)

    def _publish(self) -> None:
        new = self._derive()
        old = self._cell.status
        if new == old:
            return
        check_transition(old.state, new.state)
        self._cell.info = make_info(self._header, len(self._lineage), new)
        self._cell.status = new
        if self._events.wants("state"):
            self._emit(
                "state",
                {
                    "state": str(new.state),
                    "pending": new.pending,
                    "stopping": new.stopping,
                    "turn": new.turn,
                },
            )

    def _emit(self, name: str, data: dict[str, Any]) -> None:
        self._events.emit(name, self._header.id, self._lineage, data)
