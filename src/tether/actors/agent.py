"""One live session (one activation): its inbox, its state, its turn, its stops.

A ``Session`` is not a thread. It is a state machine hosted by one ``SessionHost`` actor
(see ``actors.host``), which calls it for every message about it, one at a time: a send,
an interrupt, a frame from its worker, a timer, its turn's end. So nothing here takes a
lock, and two operations on one session never interleave.

Requested is kept apart from took-effect: ``_Turn.stop`` records the issued stop (the
first one stands; an abort overrides a cancel), ``delivered`` records that the driver saw
the cancel at a boundary, a grace or deadline timer only *requests* a kill, and the
outcome (``forced``, ``escalated`` included) is decided when the turn has ended, from
what actually happened to it.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import structlog

from tether.actors._ids import new_id
from tether.actors.budget import Governor, StepKind
from tether.actors.clock import SYSTEM_CLOCK, Clock, Timer
from tether.actors.outcomes import TurnFacts, TurnOutcome, decide_outcome
from tether.actors.ports import (
    AgentStore,
    Durable,
    EndRecord,
    EventSink,
    Executor,
    ParentNotice,
    TurnOver,
    TurnSink,
    TurnSpec,
)
from tether.actors.states import AgentState, check_transition
from tether.telemetry.hooks import NOOP, ControlSpan, Telemetry, TurnSpan
from tether.wire.errors import InvalidParams, TetherError
from tether.wire.frames import (
    Cancel,
    CancelFrame,
    Delivered,
    Escalate,
    Escalating,
    Preempt,
    Progress,
    Say,
    Steer,
    SteerFrame,
    ToolFateName,
    ToolKilled,
    ToolMark,
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
    StopReport,
    ToolFate,
    message_key,
)
from tether.wire.text import discarded_text, marker_text, neutralize
from tether.wire.vocab import Kind, StallPolicy

__all__ = ["Interrupt", "Session", "Wake", "make_info", "notice_text"]

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
    )


@dataclass(frozen=True, slots=True)
class Interrupt:
    """An authorized interrupt, as the host hands it to the session."""

    kind: Kind
    origin: StopOrigin
    by: str
    reason: str
    grace: float
    deadline: float | None = None
    turn: str | None = None  # the guard: act only if this is still the running turn
    trace: str | None = None  # the caller's trace context (telemetry on)


@dataclass(slots=True)
class _Stop:
    """The turn's pending stop (a cancel or an abort), with what the session keeps of it."""

    stop: Stop
    grace: float
    at: float = 0.0  # wall clock at acceptance: the report's requested_at

    @property
    def kind(self) -> Literal["cancel", "abort"]:
        return "abort" if self.stop.kind == "abort" else "cancel"  # only these two pend


@dataclass(slots=True)
class _Cut:
    """A tool call a stop found open (or that opened before the stop took effect)."""

    name: str
    call: str | None
    fate: ToolFateName | None = None  # None while it is open
    late: bool = False  # opened after the stop took effect: listed only if it was cut


TimerKind = Literal["grace", "deadline", "escalate", "watchdog"]
_ESCALATE_WAIT = 1.0  # seconds to wait for a worker's answer to Escalate before killing
_PREEMPTS_KEPT = 16  # preempts remembered per turn, to date the one a ToolKilled reports
_STEERS_KEPT = 16  # undelivered steers remembered per turn, to note those never delivered


@dataclass(slots=True)
class _Turn:
    id: str
    message: Message
    stop: _Stop | None = None
    # The turn's latest assistant text, kept as the worker says it, so that its end can
    # name its partial work without reading the store.
    last_say: str | None = None
    delivered: bool = False
    force: bool = False  # the grace timer fired: a kill was requested
    escalating: bool = False  # the deadline passed: the worker was asked (Escalate)
    escalate: bool = False  # no boundary before the deadline: a kill was requested
    wake_latch: bool = False
    # The stop's clock (grace, deadline or escalate) and the watchdog's; ``gen`` tells a
    # timer that fired before it was re-armed or cancelled from the current one.
    clock: TimerKind | None = None
    timer: Timer | None = None
    due: float = 0.0  # the monotonic time at which the stop's clock fires
    gen: int = 0
    watch: Timer | None = None
    paused: bool = False
    stopped_clock: tuple[TimerKind, float] | None = None  # the stop clock stopped by a pause
    last_progress: float = 0.0
    stepped_at: float = 0.0
    step: int = 0
    in_tool: bool = False
    # For the stop report (semantics §15.6): the tool calls open now (number -> name, call),
    # those the stop found open, when and how the cancel reached the driver, and the
    # preempts issued and not yet seen to land (each with when it was accepted).
    tools: dict[int, tuple[str, str | None]] | None = None
    cut: dict[int, _Cut] | None = None
    delivered_at: float | None = None
    delivered_via: str = "boundary"
    preempts: list[tuple[Stop, float]] | None = None
    preempted: list[ToolFate] | None = None  # calls a preempt cut, for its ToolKilled
    preempt_report: StopReport | None = None
    # A worker has taken the turn (the executor said so, or its first report came): the
    # watchdog's clock runs from there, never while the turn waits for a free worker.
    started: bool = False
    # Telemetry on (semantics §16.3): the turn's span, and the control actions' spans that
    # have not landed yet (steers in order, the stop, preempts with what names them).
    span: TurnSpan | None = None
    controls: _Controls | None = None
    # A user's or a parent's steers issued to the turn and not yet delivered, in order (the
    # last few): those left when the turn ends were never delivered, and the transcript
    # says so, since whoever issued one was told it was bound to this turn. ``first_stop``:
    # the stop that discarded them (semantics §5), if one did.
    steers: deque[Steer] | None = None
    first_stop: Literal["cancel", "abort"] | None = None


@dataclass(slots=True)
class _Controls:
    steers: deque[ControlSpan]
    preempts: list[tuple[Stop, ControlSpan]]
    stop: ControlSpan | None = None


class Session:
    """The state machine of one activation. Only its host actor's thread calls it."""

    __slots__ = (
        "_host",
        "_started",
        "_stopped",
        "depth",
        "disposing",
        "epoch",
        "header",
        "horizon",
        "inbox",
        "info",
        "lineage",
        "parked",
        "settled",
        "stall",
        "turn",
        "woken_by",
    )

    def __init__(
        self,
        host: SessionServices,
        header: SessionHeader,
        lineage: tuple[str, ...],
        depth: int,
        epoch: int,
        inbox: list[Message],
        parked: bool,
        horizon: int = 0,
    ) -> None:
        self._host = host
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
        self.turn: _Turn | None = None
        self.disposing = False
        self.settled = False
        self._started = 0
        # The waking send that will start the next turn (TurnRecord.woken_by): the
        # host's own order, so a checker never has to guess it from clocks.
        self.woken_by: str | None = None
        self._stopped = False  # at most one stop per turn is recorded as the cause
        self.info = make_info(header, depth, self._derive())

    @property
    def id(self) -> str:
        return self.header.id

    @property
    def pending(self) -> int:
        return len(self.inbox) if self.inbox else 0

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
        h = self._host
        return (
            self.turn is None
            and not self.disposing
            and not self.settled
            and not self.parked
            and bool(self.inbox)
            and h.executor.accepting()
            and not h.store.failed  # no claim can be made durable
            and (self.header.mode != "one-shot" or self._started == 0)
        )

    def _spec(self, t: _Turn, claim: Durable) -> TurnSpec:
        """What the executor is handed for ``t``: what this session decided, frozen."""
        h, stall = self.header, self.stall
        return TurnSpec(
            turn=t.id,
            session=h.id,
            driver=h.driver,
            message=t.message,
            config=h.config,
            permissions=h.permissions,
            sink=self._host.sink(h.id),
            progress_every=None if stall is None else _progress_every(stall),
            repeat=None if stall is None else stall.repeat,
            claim=claim,
            limits=h.limits,
            trace=None if t.span is None else t.span.trace,
            watched=stall is not None,
        )

    def start_next(self) -> None:
        if not self._can_start():
            return
        assert self.inbox is not None
        message = self.inbox.popleft()
        h = self.header
        host = self._host
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
        self.turn = t = _Turn(turn_id, message)
        tel = host.telemetry
        if tel.on:
            t.span = tel.turn_started(
                name=h.slug or h.driver.rpartition(":")[2],
                session=h.id,
                root=self.lineage[0] if self.lineage else h.id,
                turn=turn_id,
                parent=message.trace,
                message=message.content,
            )
        stall = self.stall
        spec = self._spec(t, claim)
        self._started += 1
        if stall is not None:
            t.last_progress = self._host.clock.monotonic()
            self._watch(t, stall.after)
        try:
            host.executor.submit(spec)
        except TetherError as exc:  # closed under us: end the claimed turn, never leave it open
            self.ended(TurnOver(turn_id, None, exc.message))
            return
        if _debug():
            log.debug("turn.started", session=h.id, turn=turn_id, message=message.id)
        if host.events.wants("turn.started"):
            self._emit("turn.started", {"turn": turn_id, "message": message.id})

    # ---- interrupts ---------------------------------------------------------------

    def interrupt(self, i: Interrupt) -> str | None:
        """Bind the interrupt to the running turn and issue it; the turn's id, or None."""
        sid = self.header.id
        t = self.turn
        if self.disposing or self.settled or t is None or (i.turn is not None and i.turn != t.id):
            if i.kind == "steer":
                log.info("interrupt.dropped", session=sid, kind=i.kind, why="no running turn")
            self.control_noop(i.kind, i.origin, i.by, i.turn, i.trace)
            return None
        ctl = self._control(t, i.kind, i.origin, i.by, i.turn, i.trace)
        match i.kind:
            case "steer":
                issued = self._steer(t, i, ctl)
            case "preempt":
                issued = self._preempt(t, i, ctl)
            case "cancel":
                issued = self._cancel(t, i, ctl)
            case "abort":
                issued = self._abort(t, i, ctl)
        if issued:
            log.info("interrupt.accepted", session=sid, turn=t.id, kind=i.kind, by=i.by)
        # a steer to a stopping turn is dropped; a second stop joins the one that stands
        return t.id if issued or i.kind != "steer" else None

    # Each of these issues one interrupt to the running turn ``t``: True once issued,
    # False when it changes nothing (its control span then ends a no-op).

    def _steer(self, t: _Turn, i: Interrupt, ctl: ControlSpan | None) -> bool:
        if t.stop is not None:
            log.info(
                "interrupt.dropped", session=self.header.id, kind="steer", why="turn is stopping"
            )
            self._control_ended(ctl, "no-op", t)
            return False
        steer = Steer(i.reason, i.origin, i.by)
        self._host.executor.signal(t.id, SteerFrame(t.id, steer))
        if ctl is not None:
            self._controls(t).steers.append(ctl)
        if i.origin in ("user", "parent"):  # the system's own steers have their own trace
            if t.steers is None:
                t.steers = deque(maxlen=_STEERS_KEPT)
            t.steers.append(steer)
        return True

    def _preempt(self, t: _Turn, i: Interrupt, ctl: ControlSpan | None) -> bool:
        stop = Stop("preempt", i.origin, i.by, i.reason)
        self._host.executor.signal(t.id, Preempt(t.id, stop))
        if t.preempts is None:
            t.preempts = []
        t.preempts.append((stop, self._host.clock.now()))
        del t.preempts[:-_PREEMPTS_KEPT]  # those that found no command stay no-ops
        if ctl is not None:
            self._controls(t).preempts.append((stop, ctl))
        return True

    def _cancel(self, t: _Turn, i: Interrupt, ctl: ControlSpan | None) -> bool:
        if t.stop is not None:
            self._control_ended(ctl, "no-op", t)
            return False  # one pending stop per turn: the first one stands
        stop = Stop("cancel", i.origin, i.by, i.reason)
        t.stop = _Stop(stop, i.grace, self._host.clock.now())
        t.first_stop = "cancel"
        self._stop_control(t, ctl)
        # the signal first, the bookkeeping after
        self._host.executor.signal(t.id, CancelFrame(t.id, Cancel(stop)))
        self._stop_marker(t, "cancelled", stop)
        self._stop_accepted(t, t.stop)
        deadline = i.deadline if i.deadline is not None else self._host.cancel_deadline
        if deadline is not None:
            self._arm(t, deadline, "deadline")
        return True

    def _abort(self, t: _Turn, i: Interrupt, ctl: ControlSpan | None) -> bool:
        if t.stop is not None and t.stop.kind == "abort":
            self._control_ended(ctl, "no-op", t)
            return False
        stop = Stop("abort", i.origin, i.by, i.reason)
        if t.stop is None:
            t.first_stop = "abort"
        t.stop = _Stop(stop, i.grace, self._host.clock.now())
        self._stop_control(t, ctl)
        self._cancel_timer(t)
        t.stopped_clock = None
        self._host.executor.kill(t.id)  # a frozen tree too: SIGKILL needs no thaw
        self._stop_marker(t, "aborted", stop)
        self._stop_accepted(t, t.stop)
        return True

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

    def said(self, frame: Say) -> None:
        """The driver's entry, written here, in the order of its worker's reports: after
        the marker of any steer or preempt the driver saw before it said this."""
        h = self._host
        entry = h.store.append_entry(
            self.header.id, frame.kind, frame.text, turn=frame.turn, data=frame.data
        )
        t = self.turn
        if frame.kind == "assistant" and frame.text and t is not None and t.id == frame.turn:
            t.last_say = frame.text  # an entry of tool calls only is no assistant text
        if h.events.wants("entry"):
            self._emit("entry", {"entry": msgspec.to_builtins(entry)})

    def delivered(self, frame: Delivered) -> None:
        t = self.turn
        if t is None or t.id != frame.turn:
            return
        for steer in frame.steers:
            self._marker(t, "steered", steer.origin, steer.by, steer.text)
            if t.steers:
                with contextlib.suppress(ValueError):  # not kept: the system's, or a very old one
                    t.steers.remove(steer)
        if frame.steers and t.controls is not None:
            for _ in frame.steers:
                if t.controls.steers:
                    self._control_ended(t.controls.steers.popleft(), "landed", t)
        if not frame.cancel or t.stop is None:
            return
        if not t.delivered:
            t.delivered = True
            if t.stop.kind == "cancel" and not t.escalate:
                # A boundary took the cancel: no escalation; the grace clock starts.
                self._arm(t, t.stop.grace, "grace")
        if not frame.held and t.delivered_at is None:
            # When the cancel took effect; one a shield held took effect at its exit.
            t.delivered_at = self._host.clock.now()
            t.delivered_via = frame.via

    def tool_killed(self, frame: ToolKilled) -> None:
        t = self.turn
        if t is not None and t.id == frame.turn:
            self._stop_marker(t, "preempted", frame.stop)
            self._preempt_report(t, frame)
            if t.controls is not None:
                self._preempt_landed(t, t.controls, frame.stop)

    def escalating(self, frame: Escalating) -> None:
        """The worker will never hand the cancel over now: escalate to an abort."""
        t = self.turn
        if t is not None and t.id == frame.turn and t.escalating and not t.delivered:
            self._escalate(t)

    def timer(self, turn: str, which: TimerKind, gen: int) -> None:
        t = self.turn
        if t is None or t.id != turn:
            return
        if which == "watchdog":
            self._watchdog(t)
            return
        if gen != t.gen or t.paused or t.stop is None or t.stop.kind != "cancel":
            return  # stale, or held by a pause (re-armed on resume)
        t.timer = t.clock = None
        if which == "grace":
            t.force = True
            # Only a request: whether anything was forced is known when the turn ends.
            self._host.executor.kill(t.id)
        elif t.delivered:
            return
        elif which == "deadline" and self._host.executor.dispatched(t.id):
            # The worker decides whether its boundary came first (semantics §5: a boundary
            # reached before the deadline must win even if its report is in flight).
            t.escalating = True
            self._host.executor.signal(t.id, Escalate(t.id))
            self._arm(t, _ESCALATE_WAIT, "escalate")
        else:  # no worker yet, or the worker did not answer: nothing can deliver it now
            self._escalate(t)

    def _escalate(self, t: _Turn) -> None:
        self._cancel_timer(t)
        t.escalate = True
        self._host.executor.kill(t.id)

    def _arm(self, t: _Turn, delay: float, which: TimerKind) -> None:
        """Run the stop's clock; a paused turn holds it until resumed (semantics §14.4)."""
        self._cancel_timer(t)
        if t.paused:
            t.stopped_clock = (which, delay)
            return
        t.gen += 1
        t.clock = which
        t.due = self._host.clock.monotonic() + delay
        t.timer = self._host.arm(self.header.id, t.id, which, delay, t.gen)

    def _cancel_timer(self, t: _Turn) -> None:
        if t.timer is not None:
            t.timer.cancel()
        t.timer = t.clock = None
        t.gen += 1

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
                    now = self._host.clock.now()
                    stop = Stop("pause", "budget", "budget", text)
                    report = self._report(t, stop, now, effective_at=now, latency_ms=0.0)
                    self._host.store.put_stop_report(report)
                case "steer" | "cancel" | "abort" as stop:
                    grace = self._host.grace
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
        ctl = self._control(t, "pause", origin, by, None, trace)
        if t.paused:
            self._control_ended(ctl, "no-op", t)
            return t.id
        if t.stop is not None and t.stop.kind == "abort":
            self._control_ended(ctl, "no-op", t)
            return None  # already being killed
        self._host.executor.freeze(t.id)
        t.paused = True
        if t.timer is not None and t.clock is not None:  # the stop's clock stops
            held = (t.clock, max(t.due - self._host.clock.monotonic(), 0.0))
            self._cancel_timer(t)
            t.stopped_clock = held
        if t.watch is not None:  # a paused turn is never stalled
            t.watch.cancel()
            t.watch = None
        self._marker(t, "paused", origin, by, reason)
        log.info("turn.paused", session=self.header.id, turn=t.id, by=by)
        if t.span is not None:
            self._turn_event(t, "paused", origin, by, reason)
        self._control_ended(ctl, "landed", t)
        return t.id

    def resume(self, origin: StopOrigin, by: str, trace: str | None = None) -> str | None:
        t = self.turn
        if t is None or not t.paused:
            self.control_noop("resume", origin, by, None, trace)
            return None
        ctl = self._control(t, "resume", origin, by, None, trace)
        self._host.executor.thaw(t.id)
        t.paused = False
        if t.stopped_clock is not None:
            which, left = t.stopped_clock
            t.stopped_clock = None
            self._arm(t, left, which)
        stall = self.stall
        if stall is not None:  # a fresh idle clock: the pause was not a stall
            t.last_progress = self._host.clock.monotonic()
            t.step = 0
            self._watch(t, stall.after)
        self._marker(t, "resumed", origin, by, "")
        log.info("turn.resumed", session=self.header.id, turn=t.id, by=by)
        if t.span is not None:
            self._turn_event(t, "resumed", origin, by, "")
        self._control_ended(ctl, "landed", t)
        return t.id

    # ---- the stall watchdog (semantics §14.5) ------------------------------------------------

    def progress(self, frame: Progress) -> None:
        t = self.turn
        if t is None or t.id != frame.turn:
            return
        if frame.tools:
            self._tool_marks(t, frame.tools)
        if not frame.beat:
            return  # only tool calls opening or closing: the meter's reports are progress
        t.in_tool = frame.in_tool
        if not t.started or not frame.looping:  # the same call over and over is none
            t.started = True
            t.last_progress = self._host.clock.monotonic()
            t.step = 0
            stall = self.stall
            if t.watch is None and stall is not None and not t.paused and not self.disposing:
                # the ladder had run out: progress starts it again (a turn that stalls
                # again after it recovered is watched again)
                self._watch(t, stall.after)

    def _watch(self, t: _Turn, delay: float) -> None:
        if t.watch is not None:
            t.watch.cancel()
        t.watch = self._host.arm(self.header.id, t.id, "watchdog", max(delay, 0.0), 0)

    def _watchdog(self, t: _Turn) -> None:
        t.watch = None
        stall = self.stall
        if stall is None or t.paused or self.disposing:
            return
        now = self._host.clock.monotonic()
        after = stall.after
        every = stall.every or after
        if not t.started:
            # Still waiting for a worker: a turn that never ran cannot have stalled.
            # Look again later.
            self._watch(t, after)
            return
        if t.step == 0:
            since, wait = t.last_progress, after
        else:
            since, wait = max(t.last_progress, t.stepped_at), every
        due = since + wait
        if now < due:
            self._watch(t, due - now)
            return
        steps = stall.steps
        idle = now - t.last_progress
        while t.step < len(steps):
            kind = steps[t.step]
            t.step += 1
            if kind == "preempt" and not t.in_tool:
                continue  # nothing to preempt: the next step
            self._step(t, kind, idle, stall)
            break
        t.stepped_at = now
        if t.step < len(steps) and self.turn is t:
            self._watch(t, every)

    def _step(self, t: _Turn, kind: Kind, idle: float, stall: StallPolicy) -> None:
        why = f"no progress for {idle:.0f} s"
        text = f"{why}: {stall.nudge}" if kind == "steer" else why
        grace = stall.grace or self._host.grace
        log.info("watchdog.step", session=self.header.id, turn=t.id, kind=kind, idle=idle)
        if self._host.events.wants("watchdog.step"):
            self._emit("watchdog.step", {"turn": t.id, "step": t.step, "kind": kind, "idle": idle})
        try:
            self.interrupt(Interrupt(kind, "watchdog", "watchdog", text, grace))
        except TetherError as exc:  # a steer refused (too much held): the ladder goes on
            log.warning(
                "watchdog.step_refused", session=self.header.id, turn=t.id, error=exc.message
            )

    # ---- stop reports (semantics §15.6) ------------------------------------------------------

    def _tool_marks(self, t: _Turn, marks: list[ToolMark]) -> None:
        """The worker's tool calls opening and closing: which ones a stop finds open."""
        for m in marks:
            if m.name is not None:
                if t.tools is None:
                    t.tools = {}
                t.tools[m.id] = (m.name, m.call)
                if t.stop is not None:  # opened while a stop is pending, or after it
                    if t.cut is None:
                        t.cut = {}
                    late = t.stop.kind == "cancel" and t.delivered
                    t.cut[m.id] = _Cut(m.name, m.call, late=late)
            elif m.fate is not None:
                opened = t.tools.pop(m.id, None) if t.tools is not None else None
                cut = t.cut.get(m.id) if t.cut is not None else None
                if cut is not None:
                    cut.fate = m.fate
                if m.fate == "preempted" and opened is not None:
                    if t.preempted is None:
                        t.preempted = []
                    t.preempted.append(ToolFate(name=opened[0], fate="preempted", call=opened[1]))

    def _stop_accepted(self, t: _Turn, stop: _Stop) -> None:
        """A cancel or abort bound to ``t``: note the tool calls it finds open and write
        the first version of its report (completed when the turn ends)."""
        if t.cut is None:
            t.cut = {}
        for number, (name, call) in (t.tools or {}).items():
            t.cut.setdefault(number, _Cut(name, call))
        self._host.store.put_stop_report(self._report(t, stop.stop, stop.at))

    def _report(self, t: _Turn, stop: Stop, at: float, **more: Any) -> StopReport:
        """The report of ``stop`` on ``t`` (requested at ``at``): the one place a stop
        becomes its report's fields."""
        return StopReport(
            turn=t.id,
            session=self.header.id,
            kind=stop.kind,
            origin=stop.origin,
            by=stop.by,
            reason=stop.reason,
            requested_at=at,
            **more,
        )

    def _preempt_report(self, t: _Turn, frame: ToolKilled) -> None:
        """A preempt landed: its report, unless the turn's own stop has one (a turn has
        one report, and the stop that ends it is the one that matters)."""
        tools, t.preempted = t.preempted or [], None
        now = self._host.clock.now()
        at = now
        pending = t.preempts or []
        for n, (issued, when) in enumerate(pending):
            if issued == frame.stop:
                at = when
                del pending[: n + 1]  # the ones before it were no-ops, or the same tool's
                break
        if t.stop is not None:
            return
        report = self._report(
            t,
            frame.stop,
            at,
            effective_at=now,
            latency_ms=_ms(now - at),
            via=frame.via,
            processes=list(frame.processes),
            tools=tools,
        )
        t.preempt_report = report
        self._host.store.put_stop_report(report)

    def _final_report(
        self,
        t: _Turn,
        stop: _Stop,
        over: TurnOver,
        decided: TurnOutcome,
        partial: str | None,
        seen: float,
    ) -> StopReport:
        """Complete the stop's report once the turn has ended (``seen``: when its end was
        observed): when and how the stop took effect, what it killed, what became of each
        tool call it found open."""
        now = seen
        killed = over.end is None  # the worker did not report an end: its tree was killed
        forced, escalated = decided.forced, decided.escalated
        effective: float
        via: str | None
        if stop.kind == "cancel" and t.delivered_at is not None and not (forced or escalated):
            effective, via = t.delivered_at, t.delivered_via  # the driver took it
        elif killed:
            # The kill, confirmed by the executor: a forced or escalated cancel took effect
            # only then, whatever reached the driver before (a shield held it, or the
            # driver ignored it).
            effective, via = now, over.via
        else:  # the driver ended the turn on its own once the stop had reached it
            effective, via = now, "boundary"
        tools: list[ToolFate] = []
        for cut in (t.cut or {}).values():
            fate: ToolFateName = cut.fate or ("killed" if killed else "abandoned")
            if cut.late and fate == "returned":
                continue  # a wrap-up call the stop did not touch
            tools.append(ToolFate(name=cut.name, fate=fate, call=cut.call))
        report = self._report(
            t,
            stop.stop,
            stop.at,
            effective_at=effective,
            latency_ms=_ms(effective - stop.at),
            outcome=decided.outcome,
            forced=forced,
            escalated=escalated,
            via=via,
            processes=list(over.processes) if killed else [],
            tools=tools,
            partial=partial,
        )
        self._host.store.put_stop_report(report)
        return report

    def _marker(
        self, t: _Turn, action: MarkerAction, origin: StopOrigin, by: str, reason: str
    ) -> None:
        text = marker_text(action, origin, by, reason)
        entry = self._host.store.append_entry(
            self.header.id,
            "marker",
            text,
            turn=t.id,
            action=action,
            origin=origin,
            by=by,
            reason=reason,
        )
        if self._host.events.wants("marker"):
            self._emit("marker", {"entry": msgspec.to_builtins(entry)})

    def _discarded(self, t: _Turn) -> None:
        """The steers no boundary took, now that the turn has ended: a stop discarded them
        (semantics §5) or the turn ended first. Each gets a ``discarded`` marker with its
        text, and ``data.stop``, the stop that discarded it (None: the end came first)."""
        for steer in t.steers or ():
            entry = self._host.store.append_entry(
                self.header.id,
                "marker",
                discarded_text(steer.origin, steer.by, t.first_stop, steer.text),
                turn=t.id,
                action="discarded",
                origin=steer.origin,
                by=steer.by,
                reason=steer.text,
                data={"stop": t.first_stop},
            )
            if self._host.events.wants("marker"):
                self._emit("marker", {"entry": msgspec.to_builtins(entry)})
        t.steers = None

    def _stop_marker(self, t: _Turn, action: MarkerAction, stop: Stop) -> None:
        """A stop's marker names the stop as its report does (a steer's, a resume's and
        the system's own markers are not stops: they go to ``_marker`` directly)."""
        self._marker(t, action, stop.origin, stop.by, stop.reason)

    # ---- turn end -----------------------------------------------------------------

    def took(self, turn: str) -> None:
        """A worker took the turn (told only of a watched one): the watchdog runs from now."""
        t = self.turn
        if t is None or t.id != turn or t.started:
            return
        t.started = True
        t.last_progress = max(t.last_progress, self._host.clock.monotonic())

    def ended(self, over: TurnOver) -> None:
        t = self.turn
        if t is None or t.id != over.turn:
            return
        # The end observed (for a kill: the executor has confirmed the tree dead), taken
        # before the end record's own time, which the stop report's effect precedes.
        seen = self._host.clock.now()
        self._cancel_timer(t)
        if t.watch is not None:
            t.watch.cancel()
        host = self._host
        decided = self._decide(t, over)
        self._discarded(t)  # after the stop's own markers (forced, escalated)
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
        landed = self._land_reports(t, over, decided, partial or None, seen)
        self._announce(t, decided)
        if t.span is not None:
            self._turn_span_ended(t, decided, final, end, landed)
        parent = self.header.parent
        if parent is not None and notice_msg is not None:
            host.notify_parent(parent, notice_msg)
        self._after_end(t)

    def _usage(self, t: _Turn, end: TurnEnd | None) -> dict[str, int] | None:
        """The record's usage: the end's, else what the worker reported as it went (a
        killed turn sends no end), so a tree's spent always equals the sum of its turns'
        records."""
        gov = self._host.budget
        usage = end.usage if end is not None else None
        return gov.ended(t.id, usage) if gov is not None else usage

    def _after_end(self, t: _Turn) -> None:
        """Settle (one-shot, disposing), or start the next turn if one may start."""
        if self.header.mode == "one-shot" or self.disposing:
            self.settled = True
            return
        if not t.wake_latch:
            self.woken_by = None  # what starts now follows this turn (semantics §4 rule 2)
        self.start_next()

    def _decide(self, t: _Turn, over: TurnOver) -> TurnOutcome:
        """The turn's outcome, and the markers of a kill that took effect (forced,
        escalated)."""
        end, stop = over.end, t.stop
        decided = decide_outcome(
            TurnFacts(
                stop=None if stop is None else stop.stop,
                end="died" if end is None else end.outcome,
                force_requested=t.force,
                escalate_requested=t.escalate,
                error=over.error if end is None else end.error,
            )
        )
        if decided.forced and stop is not None:
            why = f"no end {stop.grace:g}s after the cancel"
            self._marker(t, "forced", "system", "system", why)
        if decided.escalated:
            self._marker(t, "escalated", "system", "system", "no boundary before the deadline")
        return decided

    def _notice(self, t: _Turn, decided: TurnOutcome, partial: str | None) -> ParentNotice | None:
        """The parent's notice of this end, if it has a parent whose inbox is open."""
        h = self.header
        if h.parent is None or not self._host.inbox_open(h.parent):
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

    def _land_reports(
        self,
        t: _Turn,
        over: TurnOver,
        decided: TurnOutcome,
        partial: str | None,
        seen: float,
    ) -> StopReport | None:
        """The stop's report completed (returned), or a preempt's given its outcome.
        ``partial`` is None, never "", when there is no assistant text."""
        if t.stop is not None:
            return self._final_report(t, t.stop, over, decided, partial, seen)
        if t.preempt_report is not None:
            report = msgspec.structs.replace(
                t.preempt_report, outcome=decided.outcome, partial=partial
            )
            self._host.store.put_stop_report(report)
        return None

    def _announce(self, t: _Turn, decided: TurnOutcome) -> None:
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
        if self._host.events.wants("turn.ended"):
            self._emit("turn.ended", record)

    # ---- telemetry (semantics §16.3) ---------------------------------------------------------

    def _control(
        self,
        t: _Turn,
        verb: str,
        origin: StopOrigin,
        by: str,
        guard: str | None,
        trace: str | None,
    ) -> ControlSpan | None:
        """A control action bound to ``t``: its span, linked to the turn's."""
        tel = self._host.telemetry
        if not tel.on:
            return None
        return tel.control(
            verb=verb,
            origin=origin,
            by=by,
            target=self.header.id,
            expected_turn=guard if guard is not None else t.id,
            turn=t.span,
            parent=trace,
        )

    def control_noop(
        self, verb: str, origin: StopOrigin, by: str, guard: str | None, trace: str | None
    ) -> None:
        """A control action that found no turn to act on (an accepted no-op)."""
        tel = self._host.telemetry
        if tel.on:
            span = tel.control(
                verb=verb,
                origin=origin,
                by=by,
                target=self.header.id,
                expected_turn=guard,
                turn=None,
                parent=trace,
            )
            if span is not None:
                tel.control_ended(span, "no-op")

    def _control_ended(
        self,
        span: ControlSpan | None,
        outcome: str,
        t: _Turn,
        latency_ms: float | None = None,
        report: str | None = None,
    ) -> None:
        if span is not None:
            self._host.telemetry.control_ended(
                span, outcome, latency_ms=latency_ms, report=report, turn=t.id
            )

    def _turn_event(self, t: _Turn, name: str, origin: StopOrigin, by: str, reason: str) -> None:
        """A pause or a resume on the turn's span, which its worker makes: sent to it."""
        assert t.span is not None
        frame = self._host.telemetry.turn_event(t.span, name, origin, by, reason)
        if frame is not None:
            self._host.executor.signal(t.id, frame)

    def _controls(self, t: _Turn) -> _Controls:
        if t.controls is None:
            t.controls = _Controls(deque(), [])
        return t.controls

    def _stop_control(self, t: _Turn, ctl: ControlSpan | None) -> None:
        """The turn's stop is ``ctl``'s: the steers it discards never land; a cancel an
        abort overrides lands no more (the abort's effect is the turn's end)."""
        if ctl is None:
            return
        c = self._controls(t)
        while c.steers:
            self._control_ended(c.steers.popleft(), "no-op", t)
        if c.stop is not None:
            self._control_ended(c.stop, "no-op", t)
        c.stop = ctl

    def _preempt_landed(self, t: _Turn, c: _Controls, key: Stop) -> None:
        """A preempt took effect: the first issued with its origin, by and reason (those
        before it found no command: no-ops), as ``_preempt_report`` dates it."""
        for n, (named, span) in enumerate(c.preempts):
            if named == key:
                for _, missed in c.preempts[:n]:
                    self._control_ended(missed, "no-op", t)
                del c.preempts[: n + 1]
                report = t.id if t.preempt_report is not None or t.stop is not None else None
                self._control_ended(span, "landed", t, report=report)
                return

    def _turn_span_ended(
        self,
        t: _Turn,
        decided: TurnOutcome,
        final: str | None,
        end: TurnEnd | None,
        landed: StopReport | None,
    ) -> None:
        """The turn's span ends with its outcome; its stop's span lands with the stop
        report's latency; what had not landed by now never will."""
        assert t.span is not None
        c = t.controls
        if c is not None:
            if c.stop is not None:
                latency = landed.latency_ms if landed is not None else None
                self._control_ended(c.stop, "landed", t, latency, report=t.id)
            for span in c.steers:
                self._control_ended(span, "no-op", t)
            for _, span in c.preempts:
                self._control_ended(span, "no-op", t)
            t.controls = None
        self._host.telemetry.turn_ended(
            t.span,
            reported=end is not None,
            outcome=decided.outcome,
            cause=decided.cause,
            by=decided.by,
            origin=t.stop.stop.origin if t.stop is not None else None,
            reason=decided.reason,
            error=decided.error,
            final=final if final is not None else t.last_say,
            usage=end.usage if end is not None else None,
        )

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
        if t.paused:  # a frozen turn reaches no boundary: dispose aborts it (semantics §14.4)
            self.interrupt(Interrupt("abort", origin, by, "disposed", grace))
        elif t.stop is None:
            self.interrupt(Interrupt("cancel", origin, by, "disposed", grace, grace))
        elif not t.delivered and t.stop.kind == "cancel" and not t.escalate:
            # A deadline of its own: only ever sooner, never later than the cancel's own.
            due = self._host.clock.monotonic() + grace
            if t.timer is None or t.due > due:
                self._arm(t, grace, "deadline")
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
        pending = self.pending
        old = self.info
        if (
            old.state == state
            and old.pending == pending
            and old.stopping == stopping
            and old.turn == turn
        ):
            return
        check_transition(AgentState(old.state), state)
        self.info = make_info(self.header, self.depth, state, pending, stopping, turn)
        if self._host.events.wants("state"):
            self._emit(
                "state",
                {"state": str(state), "pending": pending, "stopping": stopping, "turn": turn},
            )

    def _emit(self, name: str, data: dict[str, Any]) -> None:
        self._host.events.emit(name, self.header.id, self.lineage, data)


def _ms(seconds: float) -> float:
    return round(max(seconds, 0.0) * 1000.0, 3)


def _progress_every(stall: StallPolicy) -> float:
    """How often a worker reports progress: a few times a second at most, and often
    enough that the watchdog's clock is a small fraction of ``after`` late."""
    return min(0.25, stall.after / 8)


def notice_text(notice: ChildTurnEnded) -> str:
    """A child's turn end as its parent reads it in its inbox: the parent's model reads it
    as a user message, so the child's text cannot hold a frame of Tether's (its data
    keeps the partial as the child wrote it)."""
    who = notice.slug or notice.child
    text = f"[{who}] turn {notice.outcome}"
    return neutralize(f"{text}: {notice.partial}" if notice.partial else text)


class SessionServices:
    """What a session needs from the actor that hosts it (set up by ``SessionHost``)."""

    def __init__(
        self,
        *,
        store: AgentStore,
        executor: Executor,
        events: EventSink,
        sink: Callable[[str], TurnSink],
        arm: Callable[[str, str, TimerKind, float, int], Timer],
        notify_parent: Callable[[str, Message], None],
        grace: float,
        inbox_open: Callable[[str], bool] = lambda _parent: True,
        clock: Clock = SYSTEM_CLOCK,
        cancel_deadline: float | None = None,
        telemetry: Telemetry = NOOP,
        budget: Governor | None = None,
    ) -> None:
        # The governor of every tree's budget (semantics §16.2); None: no budgets (tests of
        # the machine alone).
        self.budget = budget
        self.grace = grace  # the runtime's default, for the watchdog's cancel
        # The deadline of a cancel issued without one: a driver stuck where no boundary
        # comes (a blocking call) would otherwise keep its turn for ever.
        self.cancel_deadline = cancel_deadline
        self.store = store
        self.executor = executor
        self.events = events
        self.sink = sink
        self.arm = arm
        # A child's turn end is told to its parent as a notice message, written with
        # the end (``inbox_open``: whether the parent still takes one), then handed to
        # the parent's host to queue (``notify_parent``).
        self.notify_parent = notify_parent
        self.inbox_open = inbox_open
        # Every time the session reads: wall time for records, monotonic for clocks.
        self.clock = clock
        # Spans of turns and control actions (semantics §16.3); the no-op hooks when off.
        self.telemetry = telemetry
