"""A fast state machine for one ``Session`` alone: no process, no thread, no sleep.

Hypothesis drives the session as its host actor would, one message at a time: sends
(waking, not, if idle; crossed tells; a late tell of a message already loaded), a worker
taking the turn, the worker's reports (a boundary, a say, a tool call opening and
closing, its end, its crash), the executor's kill landing, the host reading what the
worker sent (late, in order), steer/cancel/abort/preempt from the user, a parent or the
watchdog (with and without the ``turn`` guard), pause and resume, dispose, and the clock
moving on. The executor, the store and the clock are fakes that keep the rules of their
Protocols (``actors.ports``): the executor holds frames for a turn no worker has taken,
a frozen worker reads nothing, a kill ends the turn only when it lands; the clock and the
timers move only when the test says so (``ManualClock``, ``ManualTimers``).

After every step it checks what semantics §4, §5, §14.2, §14.4 and §14.5 promise:

* nothing accepted is lost: every accepted message is queued (in key order) or claimed
  by exactly one turn, a turn claims the oldest, and a session with no turn and
  messages queued is parked (never stranded) unless it settled;
* at most one turn is open, and the executor is only ever told about the running turn;
* every stop is bound to the turn it was issued to and leaves exactly one marker (a
  repeated cancel none; an abort that overrides a cancel its own), written while that
  turn is open; the turn's record names the stop that stands, its outcome follows;
* a stop's report exists, says the same outcome, and its ``requested_at`` is the
  session's clock at acceptance (the session reads no clock of its own);
* a paused turn's worker is frozen, is never killed but by an abort, never gets an
  Escalate, and its grace and deadline clocks stand still: a turn is ``forced`` only
  after ``grace`` unpaused seconds from the host seeing the cancel taken, ``escalated``
  only after a deadline's unpaused seconds with no boundary seen; and they do fire: a
  grace or deadline that ran out always has its kill requested;
* the watchdog steps only after ``after`` seconds with no progress, and its clock is
  armed while its ladder has steps left; every state change is one the transition table
  allows (``publish`` checks it).

Speed, measured on the 2-core box shared with four other helpers (load ~17): the default
run (200 derandomized examples of up to 80 steps, ~14,500 steps) takes 8.7 s of CPU,
about 1,700 steps a second, and 27 s of wall clock under that load. Hypothesis's own
draws are most of it: an empty three-rule machine runs ~2,500 steps a second of CPU on
the same box, so the session, its fakes and every check above cost about 0.2 ms a
step. ``TETHER_MACHINE_EXAMPLES`` and ``TETHER_MACHINE_STEPS`` scale it;
``TETHER_MACHINE_EXPLORE=1`` lets Hypothesis pick fresh examples instead of the
derandomized set CI runs.

What it found is kept at the end as plain tests: a send's late tell (a send loaded by
the materialization it woke, told after) undid a later stop's parking or parked an idle
session; and a dispose pushed back the deadline of a cancel it found.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import heapq
import itertools
import os
import random
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import pytest
import structlog
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from drivers import ROOT
from tether.actors.agent import Session
from tether.actors.ports import EndRecord, TurnOver, TurnSpec
from tether.actors.services import SessionServices, TimerKind
from tether.actors.stops import Interrupt
from tether.runtime.backends._held import Held
from tether.wire.errors import StoreUnavailable
from tether.wire.frames import (
    CancelFrame,
    Delivered,
    Escalate,
    Escalating,
    HostFrame,
    Preempt,
    Progress,
    Say,
    Steer,
    SteerFrame,
    ToolKilled,
    ToolMark,
    TurnEnd,
)
from tether.wire.records import Entry, Message, SessionHeader, StopOrigin, StopReport
from tether.wire.vocab import Kind, StallPolicy

pytestmark = pytest.mark.unit  # starts no process: make test-unit

SID = "s_kid"
PARENT = "s_lead"
EPS = 1e-6
ESCALATE_WAIT = 1.0  # stops.ESCALATE_WAIT: how long the host waits for an Escalating


class Violation(AssertionError):
    pass


# ---- the clock and the timers, moved by hand ------------------------------------------------


class ManualClock:
    def __init__(self) -> None:
        self.wall = 1_800_000_000.0
        self.mono = 100.0

    def now(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def set(self, mono: float) -> None:
        self.wall += mono - self.mono
        self.mono = mono


class ManualTimer:
    __slots__ = ("cancelled", "gen", "turn", "when", "which")

    def __init__(self, when: float, turn: str, which: TimerKind, gen: int) -> None:
        self.when = when
        self.turn = turn
        self.which = which
        self.gen = gen
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualTimers:
    """``SessionServices.arm``: the timers fire when the test moves the clock."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.heap: list[tuple[float, int, ManualTimer]] = []
        self.seq = itertools.count()

    def arm(self, session: str, turn: str, which: TimerKind, delay: float, gen: int) -> ManualTimer:
        timer = ManualTimer(self.clock.mono + max(delay, 0.0), turn, which, gen)
        heapq.heappush(self.heap, (timer.when, next(self.seq), timer))
        return timer

    def pop_due(self, until: float) -> ManualTimer | None:
        while self.heap and self.heap[0][0] <= until:
            _, _, timer = heapq.heappop(self.heap)
            if not timer.cancelled:
                return timer
        return None

    def armed(self, turn: str, which: TimerKind) -> bool:
        return any(t.turn == turn and t.which == which and not t.cancelled for _, _, t in self.heap)


# ---- the store and the executor: fakes that keep their Protocols' rules ---------------------


class Done:
    """A durable write that has committed."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def then(self, fn: Any) -> None:
        fn(None)


DONE = Done()


@dataclass
class TurnLog:
    """What the test saw of one turn, to check the session against."""

    id: str
    message: str
    wall_started: float
    ended: dict[str, Any] | None = None
    markers: list[Entry] = field(default_factory=list)
    # unpaused seconds, for the grace and deadline clocks (a pause stops them)
    active: float = 0.0
    paused_at: float | None = None
    delivered_active: float | None = None  # the host saw the cancel taken
    deadlines: list[tuple[float, float]] = field(default_factory=list)  # (armed at, seconds)
    kill_active: float | None = None  # the first kill requested
    grace: float | None = None  # the cancel's, as the session accepted it
    kill_with_delivery_in_flight: bool = False
    escalate_while_paused: bool = False
    steers_sent: list[Steer] = field(default_factory=list)
    latched: bool = False  # a waking send came while its stop converged


class FakeStore:
    """``AgentStore`` for one session: records what the session writes, checks the order."""

    failed = False  # its commits never fail

    def __init__(self, machine: SessionMachine) -> None:
        self.m = machine
        self.seq = itertools.count(1)
        self.open: str | None = None
        self.turns: dict[str, TurnLog] = {}
        self.order: list[str] = []
        self.claimed: list[int] = []
        self.reports: dict[str, StopReport] = {}
        self.entries = 0

    def start_turn(self, turn: str, message: Message, woken_by: str | None = None) -> Done:
        m = self.m
        if self.open is not None:
            raise Violation(f"turn {turn} claimed while {self.open} is open")
        key = int(message.id[2:])
        s = m.session
        if s.inbox and key > min(int(q.id[2:]) for q in s.inbox):
            raise Violation(f"claimed {message.id} before an older queued message")
        self.open = turn
        self.turns[turn] = TurnLog(turn, message.id, m.clock.wall)
        self.order.append(turn)
        self.claimed.append(key)
        return DONE

    def end_turn(self, turn: str, record: EndRecord) -> Message | None:
        if turn != self.open:
            raise Violation(f"end of {turn}, which is not the open turn {self.open}")
        log = self.turns[turn]
        if log.ended is not None:
            raise Violation(f"{turn} ended twice")
        log.ended = dataclasses.asdict(record.outcome)
        self.open = None
        notice = record.notice
        if notice is None:
            return None
        if notice.parent != PARENT or notice.data["notice"]["turn"] != turn:
            raise Violation(f"{turn}'s end wrote a notice for another turn or parent: {notice}")
        key = 10**9 + len(self.m.notices)  # not the session's keys: the model owns those
        return Message(
            id=f"m_{key}",
            session=notice.parent,
            content=notice.content,
            data=notice.data,
            kind="notice",
            sender=notice.sender,
        )

    def append_entry(self, session: str, kind: str, text: str, **kw: Any) -> Entry:
        turn = kw.get("turn")
        if turn is None or turn != self.open:
            raise Violation(f"a {kind} entry for {turn} while {self.open} is the open turn")
        entry = Entry(seq=next(self.seq), session=session, kind=kind, text=text, **kw)  # type: ignore[arg-type]
        entry = _with_created(entry, self.m.clock.wall)
        if kind == "marker":
            log = self.turns[turn]
            log.markers.append(entry)
            t = self.m.session.turn
            if entry.action == "cancelled" and t is not None and t.stop is not None:
                log.grace = t.stop.grace
            if entry.origin == "watchdog" and entry.action in ("cancelled", "aborted"):
                self.m.check_watchdog_waited()
        self.entries += 1
        return entry

    def put_stop_report(self, report: StopReport) -> None:
        if report.turn not in self.turns:
            raise Violation(f"a report for {report.turn}, never started")
        self.reports[report.turn] = report

    def _unused(self, *args: Any, **kw: Any) -> Any:
        raise Violation("a session never calls this store method")

    create_session = append_message = pending = close_message = pending_count = _unused
    settle = _unused


def _with_created(entry: Entry, wall: float) -> Entry:
    return msgspec.structs.replace(entry, created_at=wall)


@dataclass
class Worker:
    """One turn's worker, as the executor and the host see it."""

    spec: TurnSpec
    held: Held = field(default_factory=Held)  # what waits for a worker, as in the turn table
    dispatched: bool = False
    frozen: bool = False
    gone: bool = False  # finished, crashed or killed: it sends nothing more
    kill_requested: bool = False
    backlog: list[HostFrame] = field(default_factory=list)  # read once thawed
    steers: list[Steer] = field(default_factory=list)
    cancel: CancelFrame | None = None
    cancel_delivered: bool = False
    escalating: bool = False
    tool: int | None = None  # the open run_command's number
    tools: int = 0


class FakeExecutor:
    """``Executor`` for one session's turns; the worker's reports go to ``outbox``."""

    def __init__(self, machine: SessionMachine) -> None:
        self.m = machine
        self.workers: dict[str, Worker] = {}
        self.refuse_next = False

    def _live_turn(self, turn: str) -> None:
        t = self.m.session.turn
        if t is None or t.id != turn:
            raise Violation(f"the executor was told about {turn}, which is not running")

    def _live(self, turn: str) -> Worker:
        self._live_turn(turn)
        return self.workers[turn]

    def submit(self, spec: TurnSpec) -> None:
        if spec.turn in self.workers:
            raise Violation(f"{spec.turn} submitted twice")
        self._live_turn(spec.turn)
        if self.refuse_next:
            self.refuse_next = False
            raise StoreUnavailable("closed under us")
        self.workers[spec.turn] = Worker(spec)

    def signal(self, turn: str, frame: HostFrame) -> None:
        w = self._live(turn)
        log = self.m.store.turns[turn]
        if isinstance(frame, Escalate) and w.frozen:
            log.escalate_while_paused = True
        if isinstance(frame, SteerFrame):
            log.steers_sent.append(frame.steer)
            if frame.steer.origin == "watchdog":
                self.m.check_watchdog_waited()
        if isinstance(frame, Preempt) and frame.stop.origin == "watchdog":
            self.m.check_watchdog_waited()
        if w.gone:
            return  # the worker is dead: nothing reads it
        if not w.dispatched:
            w.held.hold(frame)
        elif w.frozen:
            w.backlog.append(frame)
        else:
            self.m.worker_reads(w, frame)

    def kill(self, turn: str) -> None:
        w = self._live(turn)
        log = self.m.store.turns[turn]
        if log.kill_active is None:
            log.kill_active = self.m.active(log)
            log.kill_with_delivery_in_flight = any(
                isinstance(f, Delivered) and f.cancel for f in self.m.outbox
            )
        w.kill_requested = True
        t = self.m.session.turn
        if w.frozen and (t is None or t.stop is None or t.stop.kind != "abort"):
            raise Violation(f"{turn}: a paused turn killed with no abort")

    def accepting(self) -> bool:
        return True

    def freeze(self, turn: str) -> None:
        w = self._live(turn)
        if w.frozen:
            raise Violation(f"{turn} frozen twice")
        w.frozen = True

    def thaw(self, turn: str) -> None:
        w = self._live(turn)
        if not w.frozen:
            raise Violation(f"{turn} thawed but not frozen")
        w.frozen = False
        backlog, w.backlog = w.backlog, []
        for frame in backlog:
            if not w.gone:
                self.m.worker_reads(w, frame)

    def dispatched(self, turn: str) -> bool:
        return self._live(turn).dispatched

    def disposed(self, sessions: list[str]) -> None:
        """Part of ``Executor``; only the host calls it (a session settled), never a session."""

    def waiting(self, turn: str, on: bool) -> None:
        """Part of ``Executor``; only a turn that asks for approvals waits (none here)."""
        raise Violation(f"{turn}: waiting({on}) with no approval asked")


class Events:
    def __init__(self) -> None:
        self.count = 0

    def emit(self, name: str, session: str, lineage: tuple[str, ...], data: Any) -> None:
        self.count += 1

    def wants(self, name: str) -> bool:
        return True


@dataclass(frozen=True)
class _Took:
    """The table's word that a worker took the turn (``TurnSink.started``)."""

    turn: str


class NullSink:
    def said(self, frame: Any) -> None: ...
    def begin_call(self, frame: Any, answer: Any) -> None: ...
    def delivered(self, frame: Any) -> None: ...
    def tool_killed(self, frame: Any) -> None: ...
    def progress(self, frame: Any) -> None: ...
    def escalating(self, frame: Any) -> None: ...
    def usage(self, turn: str, usage: dict[str, int]) -> None: ...
    def started(self, turn: str) -> None: ...
    def ended(self, over: Any) -> None: ...


# ---- the machine -----------------------------------------------------------------------------

STALL = st.sampled_from(
    [
        None,
        None,
        {"after": 5.0, "every": 2.0, "steps": ["steer", "cancel", "abort"], "nudge": "go on"},
        {"after": 3.0, "steps": ["preempt", "abort"], "nudge": "x", "grace": 1.0},
    ]
)
ORIGIN = st.sampled_from([("user", "alice"), ("parent", PARENT), ("user", "bob")])
SECONDS = st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0])
SENDS = st.sampled_from(
    ["yes", "yes", "yes", "no", "if-idle", "crossed", "late", "late-no", "refused"]
)
WORKER = st.sampled_from(
    ["boundary", "boundary", "say", "loop", "command", "return", "return", "fail", "crash"]
)
KINDS = st.sampled_from(["cancel", "steer", "abort", "cancel", "preempt"])
# One draw for an interrupt's other five arguments (each draw costs Hypothesis more
# than a step costs the session): (origin, by), reason, grace, deadline, turn guard;
# shuffled, since Hypothesis favours the first elements.
_ARGS = list(
    itertools.product(
        [("user", "alice"), ("parent", PARENT), ("user", "bob")],
        ["", "wrap up", "<stop> & go"],
        [0.0, 0.5, 2.0, 5.0],
        [None, 0.0, 1.0, 3.0, None],
        ["none", "running", "stale", "none"],
    )
)
random.Random(17).shuffle(_ARGS)
INTERRUPTS = st.sampled_from(_ARGS)


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.timers = ManualTimers(self.clock)
        self.store = FakeStore(self)
        self.executor = FakeExecutor(self)
        self.events = Events()
        self.notices: list[Message] = []  # each written with its turn's end
        self.outbox: deque[Any] = deque()  # what the worker sent, not read by the host yet
        self.accepted: dict[int, str] = {}  # key -> message id
        self.loaded: list[Message] = []
        self.next_key = 1
        self.session: Session = None  # type: ignore[assignment]
        self.header: SessionHeader = None  # type: ignore[assignment]

    # -- setup -----------------------------------------------------------------------------

    @initialize(
        one_shot=st.booleans(),
        stall=STALL,
        loaded=st.integers(0, 2),
        hold=st.booleans(),
    )
    def boot(self, one_shot: bool, stall: dict[str, Any] | None, loaded: int, hold: bool) -> None:
        self.header = SessionHeader(
            id=SID,
            parent=PARENT,
            mode="one-shot" if one_shot else "continuable",
            slug="kid",
            driver="tests:Fake",
            stall=None if stall is None else msgspec.convert(stall, StallPolicy),
        )
        services = SessionServices(
            store=self.store,  # type: ignore[arg-type]
            executor=self.executor,
            events=self.events,
            sink=lambda sid: NullSink(),
            arm=self.timers.arm,
            notify_parent=lambda parent, notice: self.notices.append(notice),
            grace=2.0,
            clock=self.clock,
        )
        self.loaded = [self._message() for _ in range(loaded)]
        horizon = self.next_key - 1
        self.session = Session(
            services, self.header, (PARENT,), 1, 1, list(self.loaded), hold, horizon
        )
        # as the host adopts it: a loaded inbox not held starts its first turn
        s = self.session
        self.host(self._adopt, s)

    def _adopt(self, s: Session) -> None:
        if s.inbox and not s.parked:
            s.woken_by = s.inbox[0].id
        s.start_next()

    def _message(self, key: int | None = None) -> Message:
        if key is None:
            key = self.next_key
            self.next_key += 1
        msg = Message(id=f"m_{key}", session=SID, content=f"work {key}")
        self.accepted[key] = msg.id
        return msg

    def host(self, action: Any, *args: Any) -> Any:
        """One message handled by the session's host: the action, then ``publish``
        (which checks the state transition against the table)."""
        try:
            return action(*args)
        finally:
            self.session.publish()

    @property
    def open(self) -> bool:
        s = self.session
        return not s.disposing and not s.settled

    def turn_log(self) -> TurnLog | None:
        t = self.session.turn
        return self.store.turns[t.id] if t is not None else None

    def worker(self) -> Worker | None:
        t = self.session.turn
        if t is None:
            return None
        return self.executor.workers.get(t.id)

    def active(self, log: TurnLog) -> float:
        """Unpaused seconds the turn has run (on the session's monotonic clock)."""
        return log.active

    # -- sends (semantics §4) -----------------------------------------------------------------

    @precondition(lambda self: self.open)
    @rule(how=SENDS)
    def send(self, how: str) -> None:
        """``yes``/``no``/``if-idle``: a send with that wake (``if-idle``: a child's
        notice); ``crossed``: two sends committed in one order and told in the other;
        ``late``: a send loaded by the materialization, told after; ``refused``: the
        executor refuses the turn the waking send starts (closed under us)."""
        match how:
            case "crossed":
                early, late = self._message(), self._message()
                self.enqueue(late, "yes")
                self.enqueue(early, "no")
            case "late":
                if self.loaded:
                    self.tell_again(self.loaded[len(self.accepted) % len(self.loaded)], "yes")
            case "late-no":
                if self.loaded:
                    self.tell_again(self.loaded[0], "no")
            case "refused":
                self.executor.refuse_next = True
                self.enqueue(self._message(), "yes")
            case _:
                self.enqueue(self._message(), how)

    def enqueue(self, msg: Message, wake: str) -> None:
        """A send told to the host; a waking one accepted while a stop converges sets
        the turn's wake latch (semantics §4 rule 5)."""
        log = self.turn_log()
        t = self.session.turn
        if wake == "yes" and log is not None and t is not None and t.stop is not None:
            log.latched = True
        self.host(self.session.enqueue, msg, wake)

    def tell_again(self, msg: Message, wake: str) -> None:
        """A send committed before a materialization loaded it, told after (the sender's
        thread was slow): the host hands it to the session again."""
        self.host(self.session.enqueue, msg, wake)

    # -- the worker ---------------------------------------------------------------------------

    @precondition(lambda self: (w := self.worker()) is not None and not w.frozen and not w.gone)
    @rule(action=WORKER)
    def the_worker_acts_again(self, action: str) -> None:
        """(The same rule twice: a worker acts about twice as often as anything else.)"""
        self.the_worker_acts(action)

    @precondition(lambda self: (w := self.worker()) is not None and not w.frozen and not w.gone)
    @rule(action=WORKER)
    def the_worker_acts(self, action: str) -> None:
        """A worker takes the turn if none has yet; else its driver does ``action``."""
        w = self.worker()
        assert w is not None
        if not w.dispatched:
            if w.kill_requested:
                return  # the table ends a waiting turn it is told to kill: no worker takes it
            self.a_worker_takes_the_turn()
            return
        match action:
            case "boundary":
                self.the_driver_reaches_a_boundary()
            case "say" | "loop":
                self.the_driver_says_something(looping=action == "loop")
            case "command":
                self.a_command_starts_or_returns()
            case "return" | "fail":
                self.the_driver_returns(failed=action == "fail")
            case "crash":
                self.the_worker_crashes()

    def a_worker_takes_the_turn(self) -> None:
        w = self.worker()
        assert w is not None
        run, rest = w.held.start(w.spec)
        w.dispatched = True
        if w.spec.watched:  # the table says so before the worker can say anything
            self.outbox.append(_Took(w.spec.turn))
        for frame in [*run.held, *rest]:
            self.worker_reads(w, frame)

    def worker_reads(self, w: Worker, frame: HostFrame) -> None:
        """The worker's reader thread (``runtime.worker._Runner.read_loop``)."""
        turn = w.spec.turn
        match frame:
            case SteerFrame(steer=steer):
                if w.cancel is None:
                    w.steers.append(steer)
            case CancelFrame():
                if w.cancel is None:
                    w.cancel = frame
                    w.steers.clear()
            case Preempt():
                if w.tool is not None:
                    number, w.tool = w.tool, None
                    self.outbox.append(
                        Progress(turn=turn, beat=False, tools=[ToolMark(number, fate="preempted")])
                    )
                    self.outbox.append(ToolKilled(turn, frame.stop))
            case Escalate():
                answer = not w.cancel_delivered
                w.escalating = answer
                if answer:
                    self.outbox.append(Escalating(turn=turn))
            case _:
                raise Violation(f"the worker got {frame!r}")

    def running_worker(self) -> Worker | None:
        w = self.worker()
        if w is None or not w.dispatched or w.frozen or w.gone:
            return None
        return w

    def the_driver_reaches_a_boundary(self) -> None:
        w = self.running_worker()
        assert w is not None
        turn = w.spec.turn
        if w.cancel is not None:
            if not w.cancel_delivered and not w.escalating:
                w.cancel_delivered = True
                self.outbox.append(Delivered(turn=turn, steers=[], cancel=True))
        elif w.steers:
            steers, w.steers = w.steers, []
            self.outbox.append(Delivered(turn=turn, steers=steers))
        if w.spec.progress_every is not None:
            self.outbox.append(Progress(turn=turn, in_tool=w.tool is not None))

    def the_driver_says_something(self, looping: bool) -> None:
        w = self.running_worker()
        assert w is not None
        turn = w.spec.turn
        self.outbox.append(Say(turn=turn, kind="assistant", text=f"step {len(self.outbox)}"))
        if w.spec.progress_every is not None:
            self.outbox.append(Progress(turn=turn, looping=looping, in_tool=w.tool is not None))

    def a_command_starts_or_returns(self) -> None:
        w = self.running_worker()
        assert w is not None
        turn = w.spec.turn
        if w.tool is None:
            w.tools += 1
            w.tool = w.tools
            mark = ToolMark(w.tool, name="run_command")
            self.outbox.append(Progress(turn=turn, in_tool=True, tools=[mark]))
        else:
            mark = ToolMark(w.tool, fate="returned")
            w.tool = None
            self.outbox.append(Progress(turn=turn, tools=[mark]))

    def the_driver_returns(self, failed: bool) -> None:
        w = self.running_worker()
        assert w is not None
        turn = w.spec.turn
        w.gone = True
        if failed:
            end = TurnEnd(turn=turn, outcome="failed", error="ValueError: boom")
        else:
            outcome: Literal["cancelled", "completed"]
            outcome = "cancelled" if w.cancel is not None else "completed"
            end = TurnEnd(turn=turn, outcome=outcome, final="done")
        self.outbox.append((turn, end, None))

    def the_worker_crashes(self) -> None:
        w = self.running_worker()
        assert w is not None
        w.gone = True
        self.outbox.append((w.spec.turn, None, "worker exited with -11"))

    @precondition(lambda self: (w := self.worker()) is not None and w.kill_requested and not w.gone)
    @rule()
    def the_kill_lands(self) -> None:
        """The executor killed the tree (frozen or not, dispatched or not): it says so."""
        w = self.worker()
        assert w is not None
        w.gone = True
        self.outbox.append((w.spec.turn, None, None))

    # -- the host reads the worker's reports, in order -------------------------------------

    @precondition(lambda self: bool(self.outbox))
    @rule(n=st.integers(1, 8))
    def the_host_reads(self, n: int) -> None:
        for _ in range(n):
            if not self.outbox:
                return
            item = self.outbox.popleft()
            s = self.session
            if isinstance(item, _Took):
                s.took(item.turn)  # changes nothing shown: no publish, as the host does
                continue
            if isinstance(item, tuple):
                turn, end, error = item
                claimed = len(self.store.order)
                self.host(s.ended, TurnOver(turn, end, error))
                # the queue resumes: a turn starts (it may end at once), or nothing waits
                resumed = len(self.store.order) > claimed or not s.parked
                if self.store.turns[turn].latched and not resumed and self.open:
                    raise Violation(f"{turn} ended with a wake latch set, and the inbox parked")
                continue
            log = self.turn_log()
            if isinstance(item, Say):
                s.said(item)
            elif isinstance(item, Progress):
                s.progress(item)
            else:
                if (
                    isinstance(item, Delivered)
                    and item.cancel
                    and log is not None
                    and log.delivered_active is None
                ):
                    log.delivered_active = self.active(log)
                self.host(s.from_worker, item)

    # -- interrupts (semantics §5, §14.2) -------------------------------------------------------

    @rule(kind=KINDS, args=INTERRUPTS)
    def an_interrupt(self, kind: Kind, args: tuple[Any, ...]) -> None:
        self.interrupt(kind, *args)

    def interrupt(
        self,
        kind: Kind,
        who: tuple[StopOrigin, str],
        reason: str,
        grace: float,
        deadline: float | None,
        guard: str,
    ) -> None:
        s = self.session
        t = s.turn
        log = self.turn_log()
        if kind == "steer" and not reason:
            reason = "steer"
        turn = {"none": None, "running": t.id if t else None, "stale": "t_stale"}[guard]
        before = len(log.markers) if log is not None else 0
        had = None if t is None or t.stop is None else t.stop.kind
        i = Interrupt(kind, who[0], who[1], reason, grace, deadline, turn)
        got = self.host(s.interrupt, i)
        # §14.2: bound to the running turn, or an accepted no-op
        noop = t is None or not self.open or guard == "stale" or (kind == "steer" and had)
        want = None if noop else t.id  # type: ignore[union-attr]
        if got != want:
            raise Violation(f"{kind} returned {got}, not {want}")
        if noop or log is None:
            return
        # exactly one marker for a stop that took its turn, none for a repeat
        marks = [m.action for m in log.markers[before:]]
        takes = (kind == "cancel" and had is None) or (kind == "abort" and had != "abort")
        expected = [{"cancel": "cancelled", "abort": "aborted"}[kind]] if takes else []
        if marks != expected:
            raise Violation(f"{kind} (had {had}) wrote markers {marks}, not {expected}")
        if kind == "cancel" and takes and deadline is not None:
            log.deadlines.append((self.active(log), deadline))

    @rule(resume=st.booleans(), who=ORIGIN)
    def pause_or_resume(self, resume: bool, who: tuple[str, str]) -> None:
        if resume:
            self.resume(who)
        else:
            self.pause(who, "let me look")

    def pause(self, who: tuple[str, str], reason: str) -> None:
        s = self.session
        log = self.turn_log()
        was = s.turn is not None and s.turn.paused
        got = self.host(s.pause, who[0], who[1], reason)
        if got is not None and not was and log is not None:
            log.paused_at = self.clock.mono

    def resume(self, who: tuple[str, str]) -> None:
        s = self.session
        log = self.turn_log()
        got = self.host(s.resume, who[0], who[1])
        if got is not None and log is not None:
            log.paused_at = None

    @rule(who=ORIGIN, grace=SECONDS)
    def dispose(self, who: tuple[str, str], grace: float) -> None:
        s = self.session
        t = s.turn
        log = self.turn_log()
        rearms = (
            self.open
            and t is not None
            and not t.paused
            and (t.stop is None or (t.stop.kind == "cancel" and not t.stop.delivered))
        )
        self.host(s.dispose, who[0], who[1], grace)
        if rearms and log is not None:
            log.deadlines.append((self.active(log), grace))

    # -- time ------------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 1.0, 2.0, 3.0, 6.0]))
    def the_clock_moves_on(self, dt: float) -> None:
        """Every timer due fires, in order, with the clock at its time (each one a
        message to the session's host)."""
        target = self.clock.mono + dt
        while (timer := self.timers.pop_due(target)) is not None:
            self._advance_to(max(timer.when, self.clock.mono))
            s = self.session
            self.host(s.timer, timer.turn, timer.which, timer.gen)
        self._advance_to(target)
        self.check_clocks_fired()

    def _advance_to(self, mono: float) -> None:
        for log in self.store.turns.values():
            if log.ended is None and log.paused_at is None:
                log.active += mono - self.clock.mono
        self.clock.set(mono)

    # -- checks -------------------------------------------------------------------------------

    def check_clocks_fired(self) -> None:
        """A grace or deadline that ran out (unpaused) has its kill requested."""
        s = self.session
        t = s.turn
        log = self.turn_log()
        if t is None or log is None or t.paused or t.stop is None or t.stop.kind != "cancel":
            return
        w = self.worker()
        if w is None or w.kill_requested:
            return
        now = self.active(log)
        if log.delivered_active is not None:
            if now - log.delivered_active > t.stop.grace + EPS:
                raise Violation(f"no kill {now - log.delivered_active}s after the cancel was taken")
            return
        for at, seconds in log.deadlines:
            if now - at > seconds + ESCALATE_WAIT + EPS:
                raise Violation(f"no kill {now - at}s after a {seconds}s deadline")

    def check_watchdog_waited(self) -> None:
        t = self.session.turn
        stall = self.header.stall
        if t is None or stall is None or t.watch is None:
            raise Violation("a watchdog step with no turn or no policy")
        idle = self.clock.mono - t.watch.last_progress
        if idle + EPS < stall.after:
            raise Violation(f"a watchdog step after {idle}s without progress")

    @invariant()
    def the_session_keeps_its_promises(self) -> None:
        s = self.session
        if s is None:
            return
        self._nothing_accepted_is_lost(s)
        self._one_turn_and_its_worker(s)
        for turn in self.store.order[-3:]:
            self._the_turn_ended_as_its_stops_say(self.store.turns[turn])
            self._every_steer_issued_was_delivered_or_said_discarded(self.store.turns[turn])

    def _every_steer_issued_was_delivered_or_said_discarded(self, log: TurnLog) -> None:
        """A person's or a parent's steer that returned its turn lands (``steered``) or, by
        the turn's end, is said ``discarded``: never both, never neither (semantics §5)."""
        if log.ended is None:
            return
        sent = Counter(
            (s.origin, s.by, s.text) for s in log.steers_sent if s.origin in ("user", "parent")
        )
        noted = Counter(
            (m.origin, m.by, m.reason)
            for m in log.markers
            if m.action in ("steered", "discarded") and m.origin in ("user", "parent")
        )
        if noted != sent and not (sum(sent.values()) > 16 and noted <= sent):
            raise Violation(f"{log.id}: steers issued {dict(sent)}, landed or noted {dict(noted)}")

    def _nothing_accepted_is_lost(self, s: Session) -> None:
        queued = [int(m.id[2:]) for m in s.inbox or ()]
        if queued != sorted(queued) or len(set(queued)) != len(queued):
            raise Violation(f"the inbox is out of order: {queued}")
        claimed = self.store.claimed
        if len(set(claimed)) != len(claimed) or set(claimed) & set(queued):
            raise Violation("a message claimed twice, or both claimed and queued")
        if set(claimed) | set(queued) != set(self.accepted):
            lost = set(self.accepted) - set(claimed) - set(queued)
            raise Violation(f"accepted messages lost: {sorted(lost)}")
        idle = s.turn is None and not s.settled and not s.disposing and not s.parked
        if idle and queued and (self.header.mode != "one-shot" or not claimed):
            raise Violation("messages queued, no turn, and the inbox not parked: stranded")

    def _one_turn_and_its_worker(self, s: Session) -> None:
        t = s.turn
        if (t.id if t else None) != self.store.open:
            raise Violation(f"the session runs {t and t.id}, the store has {self.store.open} open")
        if t is None:
            return
        w = self.executor.workers.get(t.id)
        if w is None:
            raise Violation(f"{t.id} runs but was never submitted")
        if t.paused != w.frozen:
            raise Violation(f"{t.id}: paused={t.paused} but its worker frozen={w.frozen}")
        watch = t.watch
        clock = None if watch is None else watch.timer
        if t.paused and clock is not None and not clock.cancelled:  # type: ignore[attr-defined]
            raise Violation("a paused turn's watchdog is armed")
        stall = self.header.stall
        if (
            stall is not None
            and not t.paused
            and not s.disposing
            and (watch is None or watch.step < len(stall.steps))
            and not self.timers.armed(t.id, "watchdog")
        ):
            raise Violation("the watchdog's clock is not armed while its ladder has steps left")

    def _the_turn_ended_as_its_stops_say(self, log: TurnLog) -> None:
        if log.escalate_while_paused:
            raise Violation(f"{log.id}: an Escalate sent to a frozen worker")
        stops = [m for m in log.markers if m.action in ("cancelled", "aborted")]
        actions = [m.action for m in stops]
        if actions not in ([], ["cancelled"], ["aborted"], ["cancelled", "aborted"]):
            raise Violation(f"{log.id}: stop markers {actions}")
        rec = log.ended
        if rec is None:
            return
        outcome = rec["outcome"]
        flags = [m.action for m in log.markers if m.action in ("forced", "escalated")]
        if not stops:
            if outcome not in ("completed", "failed", "crashed") or rec["cause"] not in (
                None,
                "system",
            ):
                raise Violation(f"{log.id}: no stop, yet {outcome} ({rec['cause']})")
            report = self.store.reports.get(log.id)
            if flags or rec["forced"] or rec["escalated"] or (report and report.kind != "preempt"):
                raise Violation(f"{log.id}: no stop, yet forced/escalated or a stop report")
            return
        stands = stops[-1]  # an abort overrides a cancel; a repeated cancel wrote nothing
        cause = "system" if stands.origin == "watchdog" else stands.origin
        if (rec["cause"], rec["by"], rec["reason"]) != (cause, stands.by, stands.reason):
            raise Violation(f"{log.id}: the record names {rec}, the stop that stands {stands}")
        want = "aborted" if stands.action == "aborted" or rec["escalated"] else "cancelled"
        if outcome != want:
            raise Violation(f"{log.id}: ended {outcome}, its stops say {want}")
        if rec["forced"] != ("forced" in flags) or rec["escalated"] != ("escalated" in flags):
            raise Violation(f"{log.id}: flags {rec} but markers {flags}")
        if rec["forced"]:
            if log.delivered_active is None or log.kill_active is None:
                raise Violation(f"{log.id}: forced, but the cancel was never taken")
            waited = log.kill_active - log.delivered_active
            if log.grace is None or waited + EPS < log.grace:
                raise Violation(f"{log.id}: forced {waited}s after the cancel was taken")
        if rec["escalated"]:
            if log.kill_active is None or stops[0].action != "cancelled":
                raise Violation(f"{log.id}: escalated with no cancel or no kill")
            if not any(log.kill_active - at + EPS >= d for at, d in log.deadlines):
                raise Violation(f"{log.id}: escalated before any deadline ran out")
            w = self.executor.workers[log.id]
            if w.cancel_delivered and not log.kill_with_delivery_in_flight:
                raise Violation(f"{log.id}: escalated though the host had seen the cancel taken")
        report = self.store.reports.get(log.id)
        if report is None or report.outcome != outcome:
            raise Violation(f"{log.id}: ended {outcome}, its stop report says {report}")
        kind = {"cancelled": "cancel", "aborted": "abort"}[str(stands.action)]
        if report.requested_at != stands.created_at or report.kind != kind:
            raise Violation(f"{log.id}: report {report} does not match its stop {stands}")
        if (report.forced, report.escalated) != (rec["forced"], rec["escalated"]):
            raise Violation(f"{log.id}: the report's flags differ from the record's")

    def teardown(self) -> None:
        if self.session is None:
            return
        ended = [log for log in self.store.turns.values() if log.ended is not None]
        if len(self.notices) != len(ended):
            raise Violation(f"{len(ended)} turns ended, {len(self.notices)} notices")
        told = sorted(str(m.data["notice"]["turn"]) for m in self.notices if m.data)
        if told != sorted(log.id for log in ended):
            raise Violation(f"notices {told} for turns {[log.id for log in ended]}")


def _settings() -> settings:
    explore = os.environ.get("TETHER_MACHINE_EXPLORE") == "1"
    return settings(
        max_examples=int(os.environ.get("TETHER_MACHINE_EXAMPLES", "200")),
        stateful_step_count=int(os.environ.get("TETHER_MACHINE_STEPS", "80")),
        deadline=None,
        derandomize=not explore,
        database=None,
        suppress_health_check=list(HealthCheck),  # a slow, loaded box is not a bug here
    )


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Drop the session's log events (thousands a second) before they are rendered.
    The processors list is edited in place: loggers cached on first use see it too."""
    processors = structlog.get_config()["processors"]
    saved = list(processors)
    processors[:] = [_drop]
    try:
        yield
    finally:
        processors[:] = saved


def _drop(logger: Any, name: str, event: Any) -> Any:
    raise structlog.DropEvent


@pytest.mark.timeout(600)  # ~9 s of CPU; minutes of wall clock on a loaded box
def test_one_session_keeps_every_rule_under_any_order_of_events() -> None:
    with quiet_logs():
        run_state_machine_as_test(SessionMachine, settings=_settings())


def test_the_session_reads_no_clock_of_its_own() -> None:
    """The state machine's modules import no clock: time comes from the services."""
    src = ROOT / "src" / "tether" / "actors"
    helpers = ("turn.py", "stops.py", "watchdog.py", "reports.py", "listener.py")
    for name in ("agent.py", *helpers, "outcomes.py"):
        tree = ast.parse((src / name).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & {"time", "datetime"}, name


# ---- what the machine found, kept as plain tests ----------------------------------------------


def machine(*, loaded: int, hold: bool = False) -> SessionMachine:
    m = SessionMachine()
    m.boot(one_shot=False, stall=None, loaded=loaded, hold=hold)
    return m


def run_to_end(m: SessionMachine, *, failed: bool = False) -> None:
    """The worker takes the turn, the driver returns, the host reads it all."""
    if not m.worker().dispatched:  # type: ignore[union-attr]
        m.a_worker_takes_the_turn()
    m.the_driver_reaches_a_boundary()
    m.the_driver_returns(failed=failed)
    m.the_host_reads(n=3)
    m.the_session_keeps_its_promises()


def test_a_late_tell_of_a_message_already_run_does_not_unpark_a_stopped_session() -> None:
    """A waking send to a dormant session: the materialization loads it and runs it, the
    turn is cancelled (parked), and only then does the sender's tell reach the host.
    Before the fix the tell cleared the hold of a parked session with nothing queued:
    ``publish`` raised IllegalTransition (parked -> idle) and the status kept showing
    the old state (failed every time; found by the machine)."""
    m = machine(loaded=1)
    turn = m.session.turn
    assert turn is not None
    m.interrupt("cancel", ("user", "alice"), "stop", 1.0, None, "running")
    run_to_end(m)
    assert m.session.info.state == "parked"
    m.tell_again(m.loaded[0], "yes")
    assert m.session.info.state == "parked" and m.session.parked
    m.the_session_keeps_its_promises()


def test_a_late_tell_of_a_message_already_run_does_not_park_an_idle_session() -> None:
    """The same race with a non-waking send: before the fix its late tell parked an idle
    session with nothing queued, so a child's notice (which wakes only an idle parent)
    then sat in its inbox (failed every time)."""
    m = machine(loaded=1)
    run_to_end(m)
    assert m.session.info.state == "idle"
    m.tell_again(m.loaded[0], "no")
    assert m.session.info.state == "idle"
    notice = m._message()
    m.host(m.session.enqueue, notice, "if-idle")
    assert m.session.turn is not None and m.session.turn.message.id == notice.id


def test_a_dispose_never_postpones_the_deadline_of_a_cancel_it_finds() -> None:
    """A cancel with a 1 s deadline, then a dispose with a 5 s grace: the turn is still
    escalated 1 s after the cancel. Before the fix the dispose re-armed the deadline
    from its own arrival with its own grace, so the abort came 5 s later than the
    caller's deadline (semantics §5; failed every time; found by the machine)."""
    m = machine(loaded=1)
    m.a_worker_takes_the_turn()
    m.interrupt("cancel", ("user", "alice"), "now", 2.0, 1.0, "running")
    m.dispose(("parent", PARENT), 5.0)
    m.the_clock_moves_on(1.0)  # the deadline: Escalate, and the worker answers
    m.the_host_reads(n=1)
    worker = m.worker()
    assert worker is not None and worker.kill_requested
    m.the_kill_lands()
    m.the_host_reads(n=1)
    m.the_session_keeps_its_promises()
    [log] = m.store.turns.values()
    assert log.ended is not None and log.ended["outcome"] == "aborted" and log.ended["escalated"]
    assert m.session.settled


def test_a_waking_send_during_a_stop_resumes_the_queue_when_the_turn_ends() -> None:
    """semantics §4 rule 5, on the session alone: the latch the machine checks."""
    m = machine(loaded=1)
    m.a_worker_takes_the_turn()
    m.interrupt("cancel", ("user", "alice"), "stop", 1.0, None, "running")
    follow = m._message()
    m.enqueue(follow, "yes")
    run_to_end(m)
    assert m.session.turn is not None and m.session.turn.message.id == follow.id


def test_a_turn_that_makes_progress_after_its_ladder_ran_out_is_watched_again() -> None:
    """Its ladder ['preempt', 'abort'] ran out (no tool to preempt: the abort), then a
    progress beat from the worker reset the ladder: the watchdog must be armed again.
    Before the fix nothing re-armed it, so a turn whose ladder had run out (a steer that
    helped, say) was never watched again (found by the machine)."""
    m = SessionMachine()
    stall = {"after": 3.0, "steps": ["preempt", "abort"], "nudge": "x", "grace": 1.0}
    m.boot(one_shot=False, stall=stall, loaded=0, hold=False)
    for _ in range(3):
        m.send(how="yes")
    m.the_worker_acts(action="boundary")
    m.the_host_reads(n=1)
    m.the_worker_acts(action="boundary")
    m.the_clock_moves_on(3.0)  # the watchdog's abort; a beat is still on its way
    m.the_host_reads(n=1)
    m.the_session_keeps_its_promises()
    t = m.session.turn
    assert t is not None and t.watch is not None and t.watch.step == 0
    assert m.timers.armed(t.id, "watchdog")
