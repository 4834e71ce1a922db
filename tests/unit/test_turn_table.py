"""The turn table (``tether.runtime.backends._turns``) alone: a fake worker, a claim the
test settles, a sink that records. No process, no thread of the table's own: every
callback runs on the test's thread, so the machine sees each rule the moment it would
break.

The contract every backend stands on, as a Hypothesis state machine: each turn is
reported once; a turn runs only once its claim committed, never if it failed; a killed
turn is reported only once its worker's tree is dead; what waits for a worker is bounded
(``HELD_BYTES``) and rides in the start frame in issue order; a frozen waiting turn is
passed over until thawed; a watched turn's ``started`` comes before anything else of it;
``close`` reports every turn that never started.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from tether.actors.ports import TurnOver, TurnSpec
from tether.runtime.backends._held import HELD_BYTES
from tether.runtime.backends._turns import TurnTable, WorkerHost
from tether.wire.errors import InvalidParams, TetherError
from tether.wire.frames import (
    Cancel,
    CancelFrame,
    Delivered,
    Escalating,
    HostFrame,
    Progress,
    RunTurn,
    Say,
    Steer,
    SteerFrame,
    ToolCall,
    ToolKilled,
    ToolReply,
    TurnEnd,
    Usage,
)
from tether.wire.records import Message, Stop

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


class Broken(AssertionError):
    """A rule of the table's contract does not hold."""


# ---- the fakes ------------------------------------------------------------------------


class Claim:
    """A claim's durability, settled when the test says (the committing thread's part)."""

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None
        self._then: list[Callable[[BaseException | None], None]] = []

    def wait(self, timeout: float | None = None) -> None:
        raise AssertionError("the table never waits on a claim")

    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        if self.done:
            fn(self.error)
        else:
            self._then.append(fn)

    def settle(self, error: BaseException | None) -> None:
        self.done, self.error = True, error
        callbacks, self._then = self._then, []
        for fn in callbacks:
            fn(error)


@dataclass
class Sink:
    """Every report, per turn, in order."""

    log: dict[str, list[object]] = field(default_factory=dict)

    def _add(self, turn: str, item: object) -> None:
        self.log.setdefault(turn, []).append(item)

    def said(self, frame: Say) -> None:
        self._add(frame.turn, frame)

    def begin_call(self, frame: Any, answer: Any) -> None:
        self._add(frame.turn, frame)

    def delivered(self, frame: Delivered) -> None:
        self._add(frame.turn, frame)

    def tool_killed(self, frame: ToolKilled) -> None:
        self._add(frame.turn, frame)

    def progress(self, frame: Progress) -> None:
        self._add(frame.turn, frame)

    def escalating(self, frame: Escalating) -> None:
        self._add(frame.turn, frame)

    def usage(self, turn: str, usage: dict[str, int]) -> None:
        self._add(turn, Usage(turn=turn, usage=usage))

    def started(self, turn: str) -> None:
        self._add(turn, "started")

    def ended(self, over: TurnOver) -> None:
        self._add(over.turn, over)


class FakeWorker:
    """One worker: what it was sent, whether its tree is being killed, and whether the
    kill is done (only the test says so: ``TurnTable.dead``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.turn: str | None = None
        self.run: RunTurn | None = None
        self.got: list[HostFrame] = []
        self.killing = False
        self.dead = False
        self.frozen = False

    def start(self, spec: TurnSpec, run: RunTurn, rest: list[HostFrame]) -> None:
        if self.turn is not None or self.dead or self.killing:
            raise Broken(f"worker {self.pid} given {spec.turn} while busy or dying")
        self.turn, self.run, self.got = spec.turn, run, list(rest)

    def post(self, frame: HostFrame, *, bounded: bool) -> None:
        if self.turn is None or self.killing:
            raise Broken(f"a frame posted to worker {self.pid}, which runs nothing")
        self.got.append(frame)

    def kill(self) -> None:
        self.killing = True

    def freeze(self, turn: str) -> None:
        self.frozen = True

    def thaw(self, turn: str) -> None:
        self.frozen = False

    def turn_over(self, spec: TurnSpec) -> dict[str, float] | None:
        self.turn = None
        return {"cpu_ms": 1.0}

    def breached(self) -> bool:
        return False


class NoTools(WorkerHost):
    def on_tool_call(self, spec: TurnSpec, frame: ToolCall) -> ToolReply:
        return ToolReply(turn=frame.turn, call=frame.call, result="ok")


def _spec(turn: str, sink: Sink, claim: Claim | None, watched: bool) -> TurnSpec:
    msg = Message(id=f"m_{turn}", session=f"s_{turn}", content=turn)
    return TurnSpec(turn, f"s_{turn}", "d:D", msg, None, None, sink, claim=claim, watched=watched)


# ---- the machine ------------------------------------------------------------------------

STEER = st.sampled_from([10, 1000, 400_000, 700_000])  # two of the large pass HELD_BYTES


@dataclass
class Model:
    """What the test knows of one turn."""

    spec: TurnSpec
    claim: Claim | None
    claimed_at: int | None = None  # the step at which its claim committed (None: not yet)
    failed: bool = False  # its claim's commit failed: it may never run
    frozen: bool = False
    killed: bool = False  # a kill was asked for
    steers: list[str] = field(default_factory=list)  # accepted while it waited, in order
    cancelled: bool = False
    worker: FakeWorker | None = None


class TableContract(RuleBasedStateMachine):
    turns = Bundle("turns")

    def __init__(self) -> None:
        super().__init__()
        self.sink = Sink()
        self.workers: list[FakeWorker] = []
        self.table: TurnTable[FakeWorker] = TurnTable(NoTools(), self._idle)
        self.model: dict[str, Model] = {}
        self.closed = False
        self.step = 0
        self.n = 0

    def _idle(self) -> FakeWorker | None:
        return next((w for w in self.workers if w.turn is None and not w.killing), None)

    # -- what the sessions do ------------------------------------------------------------

    @precondition(lambda self: not self.closed)
    @rule(target=turns, claimed=st.booleans(), watched=st.booleans())
    def submit(self, claimed: bool, watched: bool) -> str:
        self.n += 1
        turn = f"t_{self.n}"
        claim = Claim() if claimed else None
        m = Model(_spec(turn, self.sink, claim, watched), claim)
        if claim is None:
            m.claimed_at = self.step
        self.model[turn] = m
        self.table.submit(m.spec)
        return turn

    @rule(turn=turns, ok=st.booleans())
    def the_claim_settles(self, turn: str, ok: bool) -> None:
        m = self.model[turn]
        if m.claim is None or m.claim.done:
            return
        if ok:
            m.claimed_at = self.step
        else:
            m.failed = True
        m.claim.settle(None if ok else OSError("disk full"))

    @rule(turn=turns, size=STEER)
    def steer(self, turn: str, size: int) -> None:
        m = self.model[turn]
        text = "s" * size
        waiting = m.worker is None and not self._reported(turn)
        try:
            self.table.signal(turn, SteerFrame(turn, Steer(text, "user", "u")))
        except InvalidParams:
            if not waiting:
                raise Broken(f"a steer to {turn}, which does not wait, was refused") from None
            held = sum(len(s) for s in m.steers) + size
            if held <= HELD_BYTES - 100 * (len(m.steers) + 1):
                raise Broken(f"{turn}: refused with {held} bytes held, under the bound") from None
            return
        if waiting:
            m.steers.append(text)
            if sum(len(s) for s in m.steers) > HELD_BYTES:
                raise Broken(f"{turn}: more than HELD_BYTES of steers wait")

    @rule(turn=turns)
    def cancel(self, turn: str) -> None:
        m = self.model[turn]
        waiting = m.worker is None and not self._reported(turn)
        self.table.signal(
            turn, CancelFrame(turn, Cancel(Stop("cancel", "user", "u", "r")))
        )  # never refused
        if waiting:
            m.cancelled = True

    @rule(turn=turns)
    def freeze(self, turn: str) -> None:
        m = self.model[turn]
        self.table.freeze(turn)
        if m.worker is None and not self._reported(turn):
            m.frozen = True

    @rule(turn=turns)
    def thaw(self, turn: str) -> None:
        self.model[turn].frozen = False
        self.table.thaw(turn)

    @rule(turn=turns)
    def kill(self, turn: str) -> None:
        m = self.model[turn]
        if not self._reported(turn):
            m.killed = True
        self.table.kill(turn)

    # -- what the workers do -------------------------------------------------------------

    @precondition(lambda self: len(self.workers) < 4)
    @rule()
    def a_worker_is_ready(self) -> None:
        w = FakeWorker(len(self.workers) + 1)
        self.workers.append(w)
        with self.table.lock:
            self.table.dispatch_locked()  # as a backend does when a worker comes up

    @rule(data=st.data())
    def a_worker_reports(self, data: st.DataObject) -> None:
        busy = [w for w in self.workers if w.turn is not None and not w.dead]
        if not busy:
            return
        w = data.draw(st.sampled_from(busy))
        assert w.turn is not None
        self.table.on_frame(w, Say(turn=w.turn, kind="assistant", text="hi"))

    @rule(data=st.data(), outcome=st.sampled_from(["completed", "cancelled"]))
    def a_worker_ends_its_turn(self, data: st.DataObject, outcome: str) -> None:
        busy = [w for w in self.workers if w.turn is not None and not w.dead]
        if not busy:
            return
        w = data.draw(st.sampled_from(busy))
        assert w.turn is not None
        # the end of a turn being killed is not its report: its tree's death is
        self.table.on_frame(w, TurnEnd(turn=w.turn, outcome=outcome))  # type: ignore[arg-type]

    @rule(data=st.data(), crashed=st.booleans())
    def a_tree_dies(self, data: st.DataObject, crashed: bool) -> None:
        """A kill the table asked for is done; or (``crashed``) a busy worker died."""
        dying = [w for w in self.workers if not w.dead and (w.killing or (crashed and w.turn))]
        if not dying:
            return
        w = data.draw(st.sampled_from(dying))
        if not w.killing:
            with self.table.lock:
                self.table.lost_locked(w)
        w.dead = True
        with self.table.lock:
            self.table.kill_facts_locked(w, "walk")
        self.table.dead(w, "the worker exited" if crashed else None)

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        with self.table.lock:
            waiting = self.table.close_locked()
        self.closed = True
        self.table.unstarted(waiting)
        for turn, m in self.model.items():
            if m.worker is None and not self._reported(turn):
                raise Broken(f"{turn} never started, and close did not report it")

    # -- the contract ------------------------------------------------------------------

    def _reported(self, turn: str) -> bool:
        return any(isinstance(x, TurnOver) for x in self.sink.log.get(turn, ()))

    @invariant()
    def each_turn_is_reported_once_and_last(self) -> None:
        for turn, log in self.sink.log.items():
            ends = [i for i, x in enumerate(log) if isinstance(x, TurnOver)]
            if len(ends) > 1:
                raise Broken(f"{turn} reported {len(ends)} times")
            if ends and ends[0] != len(log) - 1:
                raise Broken(f"{turn} said something after its report: {log[ends[0] :]}")

    @invariant()
    def a_turn_runs_only_once_claimed_and_thawed(self) -> None:
        self.step += 1
        for w in self.workers:
            if w.turn is None or w.run is None:
                continue
            m = self.model[w.turn]
            if m.worker is w:
                continue
            # newly started: check what it was started with
            if m.failed or m.claimed_at is None:
                raise Broken(f"{w.turn} reached a worker without a durable claim")
            if m.frozen:
                raise Broken(f"{w.turn} reached a worker while frozen")
            if m.killed:
                raise Broken(f"{w.turn} reached a worker after it was killed")
            held = [f.steer.text for f in w.run.held if isinstance(f, SteerFrame)]
            if held != m.steers:
                raise Broken(f"{w.turn} started with {len(held)} steers, {len(m.steers)} held")
            if m.cancelled != any(isinstance(f, CancelFrame) for f in w.run.held):
                raise Broken(f"{w.turn}'s held cancel did not ride in its start frame")
            log = self.sink.log.get(w.turn, [])
            if m.spec.watched != (log[:1] == ["started"]):
                raise Broken(f"{w.turn}: started said {log[:1]}, watched={m.spec.watched}")
            m.worker = w

    @invariant()
    def a_killed_turn_is_reported_once_its_tree_is_dead(self) -> None:
        for turn, m in self.model.items():
            if not self._reported(turn):
                continue
            over = next(x for x in self.sink.log[turn] if isinstance(x, TurnOver))
            w = m.worker
            if w is None:
                if over.end is not None:
                    raise Broken(f"{turn} never ran, yet reported an end")
                if not (m.killed or self.closed):
                    raise Broken(f"{turn} never ran, and was reported: {over.error}")
            elif over.end is None and not w.dead:
                raise Broken(f"{turn} reported killed while its tree lived")
            elif over.end is None and over.via != "walk":
                raise Broken(f"{turn}'s report lost how its tree was killed")
            elif over.end is not None and m.killed and w.killing:
                raise Broken(f"{turn} reported its end while its kill was under way")


TableContract.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_turn_tables_contract = TableContract.TestCase


# ---- single cases -----------------------------------------------------------------------


def test_a_turn_whose_claim_failed_waits_until_killed_and_never_runs() -> None:
    sink, w = Sink(), FakeWorker(1)
    table: TurnTable[FakeWorker] = TurnTable(NoTools(), lambda: w if w.turn is None else None)
    claim = Claim()
    table.submit(_spec("t_1", sink, claim, watched=False))
    claim.settle(OSError("disk full"))
    assert w.turn is None and not table.dispatched("t_1")
    table.kill("t_1")
    [over] = sink.log["t_1"]
    assert isinstance(over, TurnOver) and over.end is None
    assert over.error == "killed before a worker took it"


def test_a_closed_table_refuses_new_turns() -> None:
    table: TurnTable[FakeWorker] = TurnTable(NoTools(), lambda: None)
    with table.lock:
        table.close_locked()
    with pytest.raises(TetherError, match="closed"):
        table.submit(_spec("t_1", Sink(), None, watched=False))


def test_an_ended_turn_reports_what_its_cgroup_counted() -> None:
    sink, w = Sink(), FakeWorker(1)
    table: TurnTable[FakeWorker] = TurnTable(NoTools(), lambda: w if w.turn is None else None)
    table.submit(_spec("t_1", sink, None, watched=False))
    assert table.on_frame(w, TurnEnd(turn="t_1", outcome="completed", final="done"))
    [over] = sink.log["t_1"]
    assert isinstance(over, TurnOver) and over.end is not None and over.end.final == "done"
    assert over.resources == {"cpu_ms": 1.0}
