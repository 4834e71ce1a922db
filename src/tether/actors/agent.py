"""One live session (one activation): its inbox and its turn.

A ``Session`` is not a thread. It is a state machine hosted by one ``SessionHost`` actor
(see ``actors.host``), which calls it for every message about it, one at a time: a send,
an interrupt, a frame from its worker, a timer, its turn's end. So nothing here takes a
lock, and two operations on one session never interleave.

The session keeps the inbox (queue, wake, claim) and the running turn (``Turn``: start,
pause, resume, end). Each other job on the turn is a helper it calls on the same thread,
with itself and the turn: ``actors.stops`` (the interrupts, the stop that stands, its
grace, deadline and escalation), ``actors.watchdog`` (the stall ladder),
``actors.reports`` (stop reports) and its services' ``listener`` (telemetry's spans).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import structlog

from tether.actors import approvals, recovery, reports, stops, watchdog
from tether.actors._ids import new_id
from tether.actors.approvals import Decide
from tether.actors.budget import StepKind
from tether.actors.outcomes import TurnOutcome
from tether.actors.ports import Durable, EndRecord, KeptTurn, ParentNotice, TurnOver, TurnSpec
from tether.actors.services import SessionServices, TimerKind
from tether.actors.states import AgentState, check_transition
from tether.actors.stops import Interrupt
from tether.actors.turn import Turn
from tether.wire.approval import Approval
from tether.wire.errors import InvalidParams, TetherError
from tether.wire.frames import (
    Delivered,
    Escalating,
    Progress,
    Say,
    ToolCall,
    ToolKilled,
    ToolReply,
    TurnEnd,
)
from tether.wire.records import (
    AgentInfo,
    ChildTurnEnded,
    MarkerAction,
    Message,
    SessionHeader,
    Stop,
    StopOrigin,
    message_key,
)
from tether.wire.text import marker_text, neutralize

__all__ = ["Session", "Wake", "make_info", "notice_text"]

log = structlog.get_logger("tether.agent")
_stdlib_log = logging.getLogger("tether.agent")

Wake = Literal["yes", "no", "if-idle"]


def _debug() -> bool:
    """Per-turn debug events are skipped cheaply unless debug logging is on."""
    return _stdlib_log.isEnabledFor(logging.DEBUG)


def make_info(
    header: SessionHeader,
    depth: int,
    state: AgentState,
    pending: int = 0,
    stopping: Literal["cancel", "abort"] | None = None,
    turn: str | None = None,
    waiting: tuple[str, ...] = (),
) -> AgentInfo:
    return AgentInfo(
        id=header.id,
        slug=header.slug,
        parent=header.parent,
        depth=depth,
        mode=header.mode,
        state=state,
        pending=pending,
        stopping=stopping,
        turn=turn,
        approvals=waiting,
    )


class Session:
    """The state machine of one activation. Only its host actor's thread calls it."""

    __slots__ = (
        "_started",
        "depth",
        "disposing",
        "epoch",
        "header",
        "horizon",
        "inbox",
        "info",
        "lineage",
        "parked",
        "services",
        "settled",
        "stall",
        "suspended",
        "turn",
        "woken_by",
    )

    def __init__(
        self,
        services: SessionServices,
        header: SessionHeader,
        lineage: tuple[str, ...],
        depth: int,
        epoch: int,
        inbox: list[Message],
        parked: bool,
        horizon: int = 0,
    ) -> None:
        self.services = services
        self.header = header
        self.stall = header.stall
        self.lineage = lineage  # ancestor ids, root first, fixed at materialization
        self.depth = depth
        self.epoch = epoch
        # An empty inbox is None: a million idle sessions need no million deques.
        self.inbox: deque[Message] | None = deque(inbox) if inbox else None
        # Every message with a key up to here was loaded with the inbox (or claimed
        # before): a send that committed before this materialization and is told
        # after it must not be queued twice.
        self.horizon = horizon
        self.parked = parked  # nothing starts until a waking send (AgentState.PARKED)
        self.turn: Turn | None = None
        # Its host is closing with its turn left open, to recover at the next start
        # (semantics §17.1): nothing of the turn is recorded, and no turn starts.
        self.suspended = False
        self.disposing = False
        self.settled = False
        self._started = 0
        # The waking send that will start the next turn (TurnRecord.woken_by): the
        # host's own order, so a checker never has to guess it from clocks.
        self.woken_by: str | None = None
        self.info = make_info(header, depth, self._derive())

    @property
    def id(self) -> str:
        return self.header.id

    @property
    def pending(self) -> int:
        return len(self.inbox) if self.inbox else 0

    @property
    def recovers(self) -> bool:
        """Its turns run on after a crash (semantics §17.1): a recoverable driver, and
        ``on_crash`` is ``recover``."""
        return self.header.recoverable and self.header.on_crash == "recover"

    # ---- inbox --------------------------------------------------------------------

    def enqueue(self, msg: Message, wake: Wake) -> None:
        """Queue an accepted message (in key order), then act on ``wake``."""
        key = message_key(msg.id)
        if key <= self.horizon:
            # Loaded by the materialization that a waking send made (hold cleared), and
            # perhaps run and stopped since: its wake was spent there. Acting on it now
            # would undo a later stop's parking, or park an idle session for nothing.
            return
        inbox = self.inbox
        if inbox is None:
            self.inbox = deque([msg])
        elif message_key(inbox[-1].id) < key:
            inbox.append(msg)
        else:  # two senders' tells crossed: keep the order the store gave them
            keys = [message_key(m.id) for m in inbox]
            inbox.insert(bisect.bisect(keys, key), msg)
        t = self.turn
        if wake == "yes":
            if t is not None:
                if t.stop is not None:
                    if not t.wake_latch:
                        self.woken_by = msg.id
                    t.wake_latch = True  # resume the queue when the stopping turn ends
            else:
                self.parked = False
                self.woken_by = msg.id  # this send starts the next turn, if any
                self.start_next()
        elif wake == "if-idle":
            if t is None and not self.parked:
                self.woken_by = msg.id
                self.start_next()
        elif t is None:
            self.parked = True

    def _can_start(self) -> bool:
        h = self.services
        return (
            self.turn is None
            and not self.suspended
            and not self.disposing
            and not self.settled
            and not self.parked
            and bool(self.inbox)
            and h.executor.accepting()
            and not h.store.failed  # no claim can be made durable
            and (self.header.mode != "one-shot" or self._started == 0)
        )

    def spec(self, t: Turn, claim: Durable) -> TurnSpec:
        """What the executor is handed for ``t``: what this session decided, frozen."""
        h, stall = self.header, self.stall
        return TurnSpec(
            turn=t.id,
            session=h.id,
            driver=h.driver,
            message=t.message,
            config=h.config,
            permissions=h.permissions,
            sink=self.services.sink(h.id),
            progress_every=None if stall is None else watchdog.progress_every(stall),
            repeat=None if stall is None else stall.repeat,
            claim=claim,
            limits=h.limits,
            trace=None if t.span is None else t.span.trace,
            watched=stall is not None,
            recovered=t.recovered,
        )

    def start_next(self) -> None:
        if not self._can_start():
            return
        assert self.inbox is not None
        message = self.inbox.popleft()
        h = self.header
        host = self.services
        turn_id = new_id("t_", host.clock.now())
        gov = host.budget
        if gov is not None and not gov.start(h.id, self.lineage, turn_id):
            # A budget of the tree is spent (or its turns are all used): the message
            # stays, parked, until the budget is raised and a waking send comes.
            self.inbox.appendleft(message)
            self.parked = True
            log.info("turn.held_by_budget", session=h.id, message=message.id)
            return
        if not self.inbox:
            self.inbox = None
        woken_by, self.woken_by = self.woken_by, None
        claim = host.store.start_turn(turn_id, message, woken_by)
        self.turn = t = Turn(turn_id, message)
        host.listener.turn_started(t, h, self.lineage)
        spec = self.spec(t, claim)
        self._started += 1
        watchdog.start(self, t)
        try:
            host.executor.submit(spec)
        except TetherError as exc:  # closed under us: end the claimed turn, never leave it open
            self.ended(TurnOver(turn_id, None, exc.message))
            return
        if _debug():
            log.debug("turn.started", session=h.id, turn=turn_id, message=message.id)
        if host.events.wants("turn.started"):
            self.emit("turn.started", {"turn": turn_id, "message": message.id})

    # ---- interrupts (actors.stops) ------------------------------------------------------

    def interrupt(self, i: Interrupt) -> str | None:
        """Bind the interrupt to the running turn and issue it; the turn's id, or None."""
        sid = self.header.id
        t = self.turn
        if self.disposing or self.settled or t is None or (i.turn is not None and i.turn != t.id):
            if i.kind == "steer":
                log.info("interrupt.dropped", session=sid, kind=i.kind, why="no running turn")
            self.control_noop(i.kind, i.origin, i.by, i.turn, i.trace)
            return None
        listener = self.services.listener
        ctl = listener.control(sid, t, i.kind, i.origin, i.by, i.turn, i.trace)
        if i.kind == "preempt" and approvals.preempt(self, t, i.origin, i.by, i.reason):
            listener.unchanged(t, ctl)  # its calls wait for approval: denied, none was running
            return t.id
        issued = stops.issue(self, t, i)
        if issued is not None and i.kind in ("cancel", "abort"):
            approvals.stopped(self, t, i.kind, i.origin, i.by)
        if issued is None:
            listener.unchanged(t, ctl)
        else:
            listener.pending(t, ctl, issued)
            log.info("interrupt.accepted", session=sid, turn=t.id, kind=i.kind, by=i.by)
        # a steer to a stopping turn is dropped; a second stop joins the one that stands
        return t.id if issued is not None or i.kind != "steer" else None

    def control_noop(
        self, verb: str, origin: StopOrigin, by: str, guard: str | None, trace: str | None
    ) -> None:
        """A control action that found no turn to act on (an accepted no-op)."""
        self.services.listener.unbound("no-op", verb, origin, by, self.header.id, guard, trace)

    # ---- what the worker reports ------------------------------------------------------

    def from_worker(self, frame: Delivered | ToolKilled | Escalating | Progress) -> None:
        match frame:
            case Delivered():
                self.delivered(frame)
            case ToolKilled():
                self.tool_killed(frame)
            case Escalating():
                self.escalating(frame)
            case Progress():
                self.progress(frame)

    def begin_call(self, frame: ToolCall, answer: Callable[[ToolReply], None]) -> None:
        """A tool call's start, made durable before its tool runs (``actors.recovery``);
        one under an approval policy waits for its decision first (``actors.approvals``)."""
        if frame.args.get("approval") is not None:
            approvals.request(self, frame, answer)
        else:
            recovery.begin_call(self, frame, answer)

    def decide(self, op: Decide) -> tuple[Approval, Durable]:
        """A decision on one of its turn's approvals, authorized (``actors.approvals``)."""
        return approvals.decide(self, op)

    def said(self, frame: Say) -> None:
        """The driver's entry, written here, in the order of its worker's reports: after
        the marker of any steer or preempt the driver saw before it said this."""
        h = self.services
        entry = h.store.append_entry(
            self.header.id, frame.kind, frame.text, turn=frame.turn, data=frame.data
        )
        t = self.turn
        if frame.kind == "assistant" and frame.text and t is not None and t.id == frame.turn:
            t.last_say = frame.text  # an entry of tool calls only is no assistant text
        if h.events.wants("entry"):
            self.emit("entry", {"entry": msgspec.to_builtins(entry)})

    def delivered(self, frame: Delivered) -> None:
        t = self.turn
        if t is not None and t.id == frame.turn:
            stops.delivered(self, t, frame)
            if frame.steers:
                self.services.listener.steers_landed(t, len(frame.steers))

    def tool_killed(self, frame: ToolKilled) -> None:
        t = self.turn
        if t is not None and t.id == frame.turn:
            stop = frame.stop
            self.marker(t, "preempted", stop.origin, stop.by, stop.reason)
            reports.preempt_landed(self, t, frame)
            self.services.listener.preempt_landed(t, stop)

    def escalating(self, frame: Escalating) -> None:
        t = self.turn
        if t is not None and t.id == frame.turn:
            stops.escalating(self, t)

    def progress(self, frame: Progress) -> None:
        t = self.turn
        if t is None or t.id != frame.turn:
            return
        if frame.tools:
            reports.tool_marks(t, frame.tools)
        if frame.beat:  # else only tool calls opening or closing
            watchdog.progress(self, t, frame)

    def took(self, turn: str) -> None:
        """A worker took the turn (told only of a watched one): the watchdog runs from now."""
        t = self.turn
        if t is not None and t.id == turn:
            watchdog.took(self, t)

    def timer(self, turn: str, which: TimerKind, gen: int) -> None:
        t = self.turn
        if t is None or t.id != turn:
            return
        if which == "watchdog":
            watchdog.fired(self, t)
        elif which == "approval":
            approvals.fired(self, t, gen)
        else:
            stops.fired(self, t, which, gen)

    # ---- budgets (semantics §16.2) ------------------------------------------------------------

    def budget_step(self, turn: str, kind: StepKind, text: str) -> None:
        """The governor's step for ``turn``: a steer, a pause, a cancel or an abort of
        origin ``budget``, bound to that turn (a no-op once it is over). A stop the turn
        already has stands (semantics §5: one pending stop per turn)."""
        t = self.turn
        if t is None or t.id != turn:
            return
        try:
            match kind:
                case "pause":
                    if t.paused or self.pause("budget", "budget", text) is None:
                        return
                    # A pause that stands for a stop (``on_hard: pause``) says so as a
                    # stop would (semantics §15.6); a cancel or abort later replaces it.
                    now = self.services.clock.now()
                    stop = Stop("pause", "budget", "budget", text)
                    report = reports.report(
                        self.id, t.id, stop, now, effective_at=now, latency_ms=0.0
                    )
                    self.services.store.put_stop_report(report)
                case "steer" | "cancel" | "abort" as stop:
                    grace = self.services.grace
                    self.interrupt(Interrupt(stop, "budget", "budget", text, grace, None, turn))
        except TetherError as exc:  # a steer refused (too much held): the stop is not
            log.warning("budget.step_refused", session=self.header.id, turn=turn, error=exc.message)

    # ---- pause / resume (semantics §14.4) ---------------------------------------------------

    def pause(
        self, origin: StopOrigin, by: str, reason: str, trace: str | None = None
    ) -> str | None:
        """Freeze the running turn in place; its id, or None when there is none."""
        t = self.turn
        if t is None or self.disposing or self.settled:
            self.control_noop("pause", origin, by, None, trace)
            return None
        listener = self.services.listener
        ctl = listener.control(self.header.id, t, "pause", origin, by, None, trace)
        if t.paused:
            listener.unchanged(t, ctl)
            return t.id
        if t.stop is not None and t.stop.kind == "abort":
            listener.unchanged(t, ctl)
            return None  # already being killed
        self.services.executor.freeze(t.id)
        t.paused = True
        stops.pause(self, t)  # the stop's clock stops
        watchdog.pause(t)  # a paused turn is never stalled
        self.marker(t, "paused", origin, by, reason)
        log.info("turn.paused", session=self.header.id, turn=t.id, by=by)
        listener.paused(t, origin, by, reason)
        listener.landed(t, ctl)
        return t.id

    def resume(self, origin: StopOrigin, by: str, trace: str | None = None) -> str | None:
        t = self.turn
        if t is None or not t.paused:
            self.control_noop("resume", origin, by, None, trace)
            return None
        listener = self.services.listener
        ctl = listener.control(self.header.id, t, "resume", origin, by, None, trace)
        self.services.executor.thaw(t.id)
        t.paused = False
        stops.resume(self, t)
        watchdog.resume(self, t)
        self.marker(t, "resumed", origin, by, "")
        log.info("turn.resumed", session=self.header.id, turn=t.id, by=by)
        listener.resumed(t, origin, by)
        listener.landed(t, ctl)
        return t.id

    # ---- markers ------------------------------------------------------------------

    def marker(
        self,
        t: Turn,
        action: MarkerAction,
        origin: StopOrigin,
        by: str,
        reason: str,
        *,
        text: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        """A marker in the transcript, bound to ``t`` (``text``: other than the usual)."""
        entry = self.services.store.append_entry(
            self.header.id,
            "marker",
            marker_text(action, origin, by, reason) if text is None else text,
            turn=t.id,
            action=action,
            origin=origin,
            by=by,
            reason=reason,
            data=data,
        )
        if self.services.events.wants("marker"):
            self.emit("marker", {"entry": msgspec.to_builtins(entry)})

    # ---- turn end -----------------------------------------------------------------

    def ended(self, over: TurnOver) -> None:
        t = self.turn
        if t is None or t.id != over.turn or self.suspended:
            return  # suspended: the turn stays open in the store, to recover
        if t.approvals:
            approvals.ended(self, t, "its worker died" if over.crashed else "the turn ended")
        if over.crashed:
            crashed = recovery.crashed(self, t, over)
            if crashed is None:
                return  # it runs on, on another worker
            over = crashed
        # The end observed (for a kill: the executor has confirmed the tree dead), taken
        # before the end record's own time, which the stop report's effect precedes.
        host = self.services
        seen = host.clock.now()
        if t.stop is not None:
            stops.disarm(t.stop)
        watchdog.stop(t)
        decided = stops.decide(self, t, over)
        stops.discarded(self, t)  # after the stop's own markers (forced, escalated)
        end = over.end
        final = end.final if end is not None else None
        partial = final if final is not None else t.last_say
        usage = self._usage(t, end)
        self.turn = None
        if decided.outcome != "completed":
            self.parked = not t.wake_latch  # park the inbox unless a waking send latched
        # the parent's notice is committed with the end, or neither is
        record = EndRecord(decided, final, usage, over.resources, self._notice(t, decided, partial))
        notice_msg = host.store.end_turn(t.id, record)
        landed = reports.land(self, t, over, decided, partial or None, seen)
        self._announce(t, decided)
        host.listener.turn_ended(t, decided, final, end, landed)
        parent = self.header.parent
        if parent is not None and notice_msg is not None:
            host.notify_parent(parent, notice_msg)
        self._after_end(t)

    # ---- durable turns (actors.recovery) -------------------------------------------------

    def suspend(self) -> bool:
        return recovery.suspend(self)

    def recover_kept(self, kept: KeptTurn) -> None:
        recovery.recover_kept(self, kept)

    def started_one(self) -> None:
        """A turn was claimed here (a one-shot's one turn is counted by it)."""
        self._started += 1

    def _usage(self, t: Turn, end: TurnEnd | None) -> dict[str, int] | None:
        """The record's usage: the end's, else what the worker reported as it went (a
        killed turn sends no end), so a tree's spent always equals the sum of its turns'
        records."""
        gov = self.services.budget
        usage = end.usage if end is not None else None
        return gov.ended(t.id, usage) if gov is not None else usage

    def _after_end(self, t: Turn) -> None:
        """Settle (one-shot, disposing), or start the next turn if one may start."""
        if self.header.mode == "one-shot" or self.disposing:
            self.settled = True
            return
        if not t.wake_latch:
            self.woken_by = None  # what starts now follows this turn (semantics §4 rule 2)
        self.start_next()

    def _notice(self, t: Turn, decided: TurnOutcome, partial: str | None) -> ParentNotice | None:
        """The parent's notice of this end, if it has a parent whose inbox is open."""
        h = self.header
        if h.parent is None or not self.services.inbox_open(h.parent):
            return None
        told = ChildTurnEnded(
            child=h.id,
            slug=h.slug,
            turn=t.id,
            outcome=decided.outcome,
            cause=decided.cause,
            partial=partial,
        )
        data = {"notice": msgspec.to_builtins(told)}
        trace = t.span.parent if t.span is not None else None
        return ParentNotice(h.parent, notice_text(told), data, h.id, trace)

    def _announce(self, t: Turn, decided: TurnOutcome) -> None:
        """The end in the log (a stopped or failed one at info; a failed one a warning
        too, with its error, since nothing else says so at the default level) and as an
        event."""
        record = {
            "turn": t.id,
            "outcome": decided.outcome,
            "cause": decided.cause,
            "by": decided.by,
            "forced": decided.forced,
            "escalated": decided.escalated,
            "reason": decided.reason,
            "error": decided.error,
        }
        if decided.outcome == "failed":
            log.warning("turn.failed", session=self.header.id, turn=t.id, error=decided.error)
        if decided.outcome != "completed":
            log.info("turn.ended", session=self.header.id, **record)
        elif _debug():
            log.debug("turn.ended", session=self.header.id, **record)
        if self.services.events.wants("turn.ended"):
            self.emit("turn.ended", record)

    # ---- lifecycle ----------------------------------------------------------------

    def dispose(self, origin: StopOrigin, by: str, grace: float) -> None:
        """Cancel with grace (escalating to an abort), then settle once the turn ends."""
        if self.disposing or self.settled:
            return
        t = self.turn
        if t is None:
            self.disposing = True
            self.settled = True
            return
        stops.dispose(self, t, origin, by, grace)
        approvals.stopped(self, t, "cancel", origin, by)
        self.disposing = True  # after the cancel: interrupts to a disposing session are no-ops

    def check_release(self) -> None:
        if self.turn is not None:
            raise InvalidParams(
                f"session {self.header.id} is running a turn; interrupt it before release"
            )

    # ---- status -------------------------------------------------------------------

    def _derive(self) -> AgentState:
        if self.settled:
            return AgentState.SETTLED
        if self.disposing:
            return AgentState.DISPOSING
        if self.turn is not None:
            return AgentState.PAUSED if self.turn.paused else AgentState.RUNNING
        if self.inbox is None and not self.parked:
            return AgentState.IDLE
        return AgentState.PARKED

    def publish(self) -> None:
        """Swap in a new ``info`` if anything shown changed; emit ``state`` if so."""
        state = self._derive()
        t = self.turn
        stopping = t.stop.kind if t is not None and t.stop is not None else None
        turn = t.id if t is not None else None
        waiting = tuple(t.approvals) if t is not None and t.approvals else ()
        pending = self.pending
        old = self.info
        if (
            old.state == state
            and old.pending == pending
            and old.stopping == stopping
            and old.turn == turn
            and old.approvals == waiting
        ):
            return
        check_transition(AgentState(old.state), state)
        self.info = make_info(self.header, self.depth, state, pending, stopping, turn, waiting)
        if self.services.events.wants("state"):
            self.emit(
                "state",
                {"state": str(state), "pending": pending, "stopping": stopping, "turn": turn},
            )

    def emit(self, name: str, data: dict[str, Any]) -> None:
        self.services.events.emit(name, self.header.id, self.lineage, data)


def notice_text(notice: ChildTurnEnded) -> str:
    """A child's turn end as its parent reads it in its inbox: the parent's model reads it
    as a user message, so the child's text cannot hold a frame of Tether's (its data
    keeps the partial as the child wrote it)."""
    who = notice.slug or notice.child
    text = f"[{who}] turn {notice.outcome}"
    return neutralize(f"{text}: {notice.partial}" if notice.partial else text)
