"""The turn table: one turn's life on any backend, from submit to its one report.

States CLAIMING -> QUEUED -> DISPATCHED -> (KILLING ->) DONE, each change under the table's
lock, which the backend shares. A turn waits in one place until a worker takes it: first
for its claim's commit, then for a free worker; a killed turn is reported only once its
tree is dead. The transitions and who calls them: docs/design.md, sections 4-6.
"""

from __future__ import annotations

import enum
import json
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import structlog

from tether.actors.ports import TurnOver, TurnSpec
from tether.runtime.backends._held import Held
from tether.wire.errors import FrameError, TetherError, error_from_code
from tether.wire.frames import (
    Delivered,
    Escalating,
    HostFrame,
    Preempt,
    ProbeReply,
    Progress,
    RunTurn,
    Say,
    SteerFrame,
    ToolCall,
    ToolKilled,
    ToolReply,
    TurnEnd,
    Usage,
    WorkerFrame,
)
from tether.wire.records import KillVia, ProcessFate

__all__ = [
    "DriverChecks",
    "TableBackend",
    "TurnState",
    "TurnTable",
    "Worker",
    "WorkerGone",
    "WorkerHost",
]

log = structlog.get_logger("tether.turns")


class WorkerHost:
    """What a backend asks of the runtime for a worker's frames (the runtime's HostTools).

    A driver's entries (``Say``) are not among them: they go to the turn's sink, in
    order with its other reports, so that the session's host writes them.
    """

    # The user a worker's tools run as (semantics §17.4); None: the worker's own.
    tool_user: str | None = None

    def on_tool_call(self, spec: TurnSpec, frame: ToolCall) -> ToolReply:
        raise NotImplementedError

    def turn_secrets(self, spec: TurnSpec) -> tuple[dict[str, str] | None, list[str]]:
        """The model keys ``spec``'s turn carries, and the secrets its worker must drop
        from its environment first (semantics §17.4)."""
        return None, []

    def worker_environ(self) -> dict[str, str]:
        """The environment a new worker starts with."""
        return dict(os.environ)


class TurnState(enum.Enum):
    CLAIMING = "claiming"  # its claim's commit is not settled: no worker may take it
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    KILLING = "killing"
    DONE = "done"


_NEXT: dict[TurnState, frozenset[TurnState]] = {
    TurnState.CLAIMING: frozenset({TurnState.QUEUED, TurnState.DONE}),
    TurnState.QUEUED: frozenset({TurnState.DISPATCHED, TurnState.DONE}),
    TurnState.DISPATCHED: frozenset({TurnState.KILLING, TurnState.DONE}),
    TurnState.KILLING: frozenset({TurnState.DONE}),
    TurnState.DONE: frozenset(),
}


class Worker(Protocol):
    """What the table asks of one worker (its backend's driver of it).

    ``start``, ``post`` and ``kill`` are called under the table's lock and must not
    block; ``freeze`` and ``thaw`` are called outside it and may wait (a remote call, the
    kernel's "frozen 1"): they check with ``TurnTable.runs_locked`` that the worker still
    runs ``turn``.
    """

    pid: int  # for the logs: the worker's process (Ray: its slot actor's)

    def start(self, spec: TurnSpec, run: RunTurn, rest: list[HostFrame]) -> None:
        """Begin ``spec``: post ``run`` and the frames held for it. Raise (FrameError, or
        anything) to refuse it before anything is sent: the turn then ends crashed."""

    def post(self, frame: HostFrame, *, bounded: bool) -> None:
        """Queue ``frame`` for the running turn, never blocking. FrameError over the cap;
        ``bounded``: InvalidParams where the worker cannot take more now (HELD_BYTES)."""

    def kill(self) -> None:
        """Start killing this worker's tree. Once nothing of it is alive the backend
        calls ``TurnTable.dead`` for it: the kill's done callback."""

    def freeze(self, turn: str) -> None:
        """Stop ``turn`` in place (its group and every escapee, or its cgroup)."""

    def thaw(self, turn: str) -> None:
        """Undo ``freeze``."""

    def turn_over(self, spec: TurnSpec) -> dict[str, float] | None:
        """``spec`` ended with its TurnEnd and is forgotten (called under the lock, before
        the worker may take another turn). Returns what its cgroup counted, if any."""

    def breached(self) -> bool:
        """At its turn's TurnEnd (under the lock): whether the turn hit a limit it must
        end for, which a watch has not acted on yet (a tool that hit its pids limit and
        finished by itself first). True: the worker is doomed, its reason set, and the
        turn ends as that kill says, as the watch would have ended it."""


W = TypeVar("W", bound=Worker)


@dataclass(eq=False)
class _Entry(Generic[W]):
    """One turn in the table: the session's spec and everything the table learns."""

    spec: TurnSpec
    state: TurnState
    worker: W | None = None
    held: Held = field(default_factory=Held)  # until a worker takes it
    frozen: bool = False  # paused before a worker took it: passed over until thawed
    reason: str | None = None  # why it is being killed, when the kill was asked for
    # the kill's facts, for its report (set by the backend once the tree is dead)
    via: KillVia | None = None
    processes: tuple[ProcessFate, ...] = ()
    resources: dict[str, float] | None = None

    def to(self, state: TurnState) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"turn {self.spec.turn}: no way from {self.state} to {state}")
        self.state = state

    def over(self, end: TurnEnd | None, error: str | None, crashed: bool = False) -> TurnOver:
        return TurnOver(
            self.spec.turn,
            end,
            error,
            via=self.via,
            processes=self.processes,
            resources=self.resources,
            crashed=crashed,
        )


class TurnTable(Generic[W]):
    """Every turn a backend holds, from submit to its one report.

    ``idle`` (called under the lock) names a worker that may take a turn now, or None.
    The methods of :class:`~tether.actors.ports.Executor` are here; a backend exposes
    them (``submit`` ... ``dispatched``) and adds its workers.
    """

    def __init__(self, host: WorkerHost, idle: Callable[[], W | None]) -> None:
        self.host = host
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.closed = False  # no new turns (set under the lock)
        self.draining = False
        self._idle = idle
        self._turns: dict[str, _Entry[W]] = {}
        self._queue: deque[_Entry[W]] = deque()
        self._on: dict[W, _Entry[W]] = {}  # worker -> the turn it runs (or whose tree dies)
        # the turn each worker ran last: a late frame of it (an answer crossing its end)
        # is dropped without a warning
        self._last: weakref.WeakKeyDictionary[W, str] = weakref.WeakKeyDictionary()

    # ---- the Executor --------------------------------------------------------------

    def submit(self, spec: TurnSpec) -> None:
        claim = spec.claim
        with self.lock:
            if self.closed:
                raise TetherError("the runtime is closed")
            first = TurnState.QUEUED if claim is None else TurnState.CLAIMING
            rec: _Entry[W] = _Entry(spec, first)
            self._turns[spec.turn] = rec
            if claim is None:
                self._queue.append(rec)
                self.dispatch_locked()
                return
        # outside the lock: a settled claim calls back at once
        claim.then(lambda error: self._claimed(rec, error))

    def _claimed(self, rec: _Entry[W], error: BaseException | None) -> None:
        """The claim's commit is settled (on the committing thread)."""
        with self.lock:
            if rec.state is not TurnState.CLAIMING:
                return  # killed, or the runtime closed, while its claim was on its way
            if error is not None:
                # Never durable: the turn must not run (a restart would run its message
                # again). It waits, as a turn waiting for a worker, until stopped.
                spec = rec.spec
                log.error("turn.unclaimed", session=spec.session, turn=spec.turn, why=str(error))
                return
            rec.to(TurnState.QUEUED)
            self._queue.append(rec)
            self.dispatch_locked()

    def dispatched(self, turn: str) -> bool:
        """True once a worker took ``turn``; False while it waits for one (or is unknown)."""
        rec = self._turns.get(turn)  # one dict read: no lock needed
        return rec is not None and rec.worker is not None

    def accepting(self) -> bool:
        return not self.draining

    def drain(self) -> None:
        """Take no new turns (the runtime is closing); running ones go on."""
        self.draining = True

    def signal(self, turn: str, frame: HostFrame) -> None:
        """InvalidParams for a steer or preempt past what may wait for ``turn`` (see
        HELD_BYTES); a cancel, an escalation or an answer is never refused."""
        with self.lock:
            rec = self._turns.get(turn)
            if rec is None:
                return
            if rec.worker is None:
                rec.held.hold(frame)
            elif rec.state is TurnState.DISPATCHED:
                rec.worker.post(frame, bounded=isinstance(frame, SteerFrame | Preempt))

    def kill(self, turn: str) -> None:
        with self.lock:
            rec = self._turns.get(turn)
            if rec is None or rec.state is TurnState.KILLING:
                return  # gone, or dying already: its end reports it
            if rec.state is TurnState.DISPATCHED:
                assert rec.worker is not None
                rec.to(TurnState.KILLING)
                rec.reason = "killed"
                rec.worker.kill()
                return
            if rec.state is TurnState.QUEUED:
                self._queue.remove(rec)
            self._forget_locked(rec)
        self._report(rec.spec, rec.over(None, "killed before a worker took it"))

    def freeze(self, turn: str) -> None:
        with self.lock:
            rec = self._turns.get(turn)
            if rec is None or rec.state is TurnState.KILLING:
                return
            if rec.worker is None:
                rec.frozen = True  # dispatch passes it over until thawed
                return
            w = rec.worker
        w.freeze(turn)

    def thaw(self, turn: str) -> None:
        with self.lock:
            rec = self._turns.get(turn)
            if rec is None or rec.state is TurnState.KILLING:
                return  # being killed: it stays frozen until it is dead
            if rec.worker is None:
                rec.frozen = False
                self.dispatch_locked()
                return
            w = rec.worker
        w.thaw(turn)

    # ---- for the backends ----------------------------------------------------------

    def spec(self, turn: str) -> TurnSpec | None:
        """The spec of a turn still in the table (waiting, running or dying)."""
        rec = self._turns.get(turn)
        return None if rec is None else rec.spec

    def worker(self, turn: str) -> W | None:
        """The worker running ``turn`` (or killing its tree); None while it waits."""
        rec = self._turns.get(turn)
        return None if rec is None else rec.worker

    def spec_of_locked(self, w: W) -> TurnSpec | None:
        """The turn ``w`` runs (or whose tree it is killing)."""
        rec = self._on.get(w)
        return None if rec is None else rec.spec

    def kill_facts_locked(
        self,
        w: W,
        via: KillVia,
        processes: tuple[ProcessFate, ...] = (),
        resources: dict[str, float] | None = None,
    ) -> None:
        """How ``w``'s tree was killed, what died, what its cgroup counted: reported with
        its turn's end."""
        rec = self._on.get(w)
        if rec is not None:
            rec.via, rec.processes = via, processes
            if resources is not None:
                rec.resources = resources

    def runs_locked(self, w: W, turn: str) -> bool:
        """``w`` runs ``turn`` and nothing is killing it."""
        rec = self._on.get(w)
        return rec is not None and rec.spec.turn == turn and rec.state is TurnState.DISPATCHED

    def dispatch_locked(self) -> None:
        """Hand queued turns to idle workers, first come first served, a frozen one
        passed over. Never raises: it runs inside the handling of other turns' ends,
        which must go on; a turn that cannot start ends here."""
        while self._queue:
            w = self._idle()
            if w is None:
                return
            rec = next((r for r in self._queue if not r.frozen), None)
            if rec is None:
                return
            self._queue.remove(rec)
            spec = rec.spec
            run, rest = rec.held.start(spec, *self.host.turn_secrets(spec))
            rec.to(TurnState.DISPATCHED)
            rec.worker = w
            self._on[w] = rec
            self._last[w] = spec.turn
            if spec.watched:  # before its worker can say anything of it
                spec.sink.started(spec.turn)
            try:
                w.start(spec, run, rest)
            except Exception as exc:  # FrameError (over the cap), or unencodable input
                detail = exc.message if isinstance(exc, FrameError) else repr(exc)
                log.error("turn.unstartable", turn=spec.turn, error=detail)
                self._forget_locked(rec)
                self._report(spec, rec.over(None, f"the turn is too large to start: {detail}"))

    def lost_locked(self, w: W) -> None:
        """The backend is killing ``w``'s tree (it crashed, spoke nonsense, is shut
        down): its turn is KILLING, and ends when ``dead`` is called for ``w``."""
        rec = self._on.get(w)
        if rec is not None and rec.state is TurnState.DISPATCHED:
            rec.to(TurnState.KILLING)

    def fail(self, w: W, turn: str, error: str) -> None:
        """``w`` is faulty while it runs ``turn``: kill its tree as an abort does, and
        end the turn crashed with ``error`` once the tree is dead."""
        with self.lock:
            rec = self._on.get(w)
            if rec is None or rec.spec.turn != turn or rec.state is not TurnState.DISPATCHED:
                return
            rec.to(TurnState.KILLING)
            rec.reason = error
            w.kill()

    def dead(
        self, w: W, error: str | None, *, turn: str | None = None, crashed: bool = False
    ) -> TurnSpec | None:
        """``w``'s tree is dead: end its turn (``turn``: only if it is that one) with
        ``error``, else the kill's reason, and forget it. ``crashed``: it died of
        something Tether did not do. Returns the spec it reported, None when ``w`` had
        no turn left to report."""
        with self.lock:
            rec = self._on.get(w)
            if rec is None or (turn is not None and rec.spec.turn != turn):
                return None
            crashed = crashed and rec.reason is None  # a kill of Tether's is no crash
            self._forget_locked(rec)
            self.dispatch_locked()
        why = error or rec.reason or "the worker ended"
        self._report(rec.spec, rec.over(None, why, crashed))
        return rec.spec

    def close_locked(self) -> list[TurnSpec]:
        """No new turns; those waiting for a worker (or for their claim) are forgotten
        and returned, for ``unstarted``."""
        self.closed = True
        waiting = [rec for rec in self._turns.values() if rec.worker is None]
        for rec in waiting:
            self._forget_locked(rec)
        self._queue.clear()
        return [rec.spec for rec in waiting]

    def unstarted(self, specs: list[TurnSpec]) -> None:
        """Report the turns that ``close_locked`` took (outside the lock)."""
        for spec in specs:
            self._report(
                spec, TurnOver(spec.turn, None, "the runtime closed before a worker took it")
            )

    # ---- a worker's frames ---------------------------------------------------------

    def on_frame(self, w: W, frame: WorkerFrame) -> bool:
        """Handle one frame of ``w``'s turn; True once that turn is over for ``w`` (its
        TurnEnd). A worker's own frames (Ready, ProbeReply) are its backend's."""
        match frame:
            case TurnEnd():
                return self._end(w, frame)
            case (
                Say()
                | ToolCall()
                | Delivered()
                | Progress()
                | Usage()
                | Escalating()
                | ToolKilled()
            ):
                spec = self._spec_of(w, frame.turn)
            case _:
                return False
        if spec is None:
            return False
        sink = spec.sink
        match frame:
            case Say():
                if frame.usage:
                    sink.usage(frame.turn, frame.usage)
                sink.said(frame)
            case ToolCall(name="begin_call"):
                # a tool call's write-ahead goes through its session, in its reports'
                # order, and is answered once durable, off this thread
                sink.begin_call(frame, lambda reply: self._answer(w, spec, reply))
            case ToolCall():
                self._answer(w, spec, self.host.on_tool_call(spec, frame))
            case Delivered():
                sink.delivered(frame)
            case Progress():
                sink.progress(frame)
            case Usage():
                sink.usage(frame.turn, frame.usage)
            case Escalating():
                sink.escalating(frame)
            case ToolKilled():
                sink.tool_killed(frame)
        return False

    def _spec_of(self, w: W, turn: str) -> TurnSpec | None:
        """The turn a frame from ``w`` names. A frame for any other turn is dropped (a
        worker never speaks for another session's turn); only a late one for the turn it
        just ran (an answer crossing its end) goes unlogged."""
        rec = self._on.get(w)  # one dict read: the frame's turn is checked below
        if rec is not None and rec.spec.turn == turn:
            return rec.spec
        if turn != self._last.get(w):
            log.warning("frame.rejected", pid=w.pid, turn=turn, error="not this worker's turn")
        return None

    def _end(self, w: W, frame: TurnEnd) -> bool:
        with self.lock:
            rec = self._on.get(w)
            if rec is None or rec.spec.turn != frame.turn:
                return False
            if rec.state is not TurnState.DISPATCHED:
                return True  # a kill is under way: the tree's death reports this turn
            if w.breached():
                return True  # doomed now: the tree's death reports this turn
            self._forget_locked(rec)
            resources = w.turn_over(rec.spec)
            if resources is not None:
                rec.resources = resources
            self.dispatch_locked()
        rec.spec.sink.ended(rec.over(frame, None))
        return True

    def _answer(self, w: W, spec: TurnSpec, reply: ToolReply) -> None:
        with self.lock:
            if not self.runs_locked(w, spec.turn):
                return  # its tree is being killed: nobody waits for the answer
            try:
                w.post(reply, bounded=False)
            except FrameError as exc:  # the driver waits for an answer: one it can read
                w.post(
                    ToolReply(
                        turn=reply.turn,
                        call=reply.call,
                        code="invalid-params",
                        message=f"the result is too large to return: {exc.message}",
                    ),
                    bounded=False,
                )

    # ---- internals -----------------------------------------------------------------

    def _forget_locked(self, rec: _Entry[W]) -> None:
        rec.to(TurnState.DONE)
        self._turns.pop(rec.spec.turn, None)
        if rec.worker is not None and self._on.get(rec.worker) is rec:
            del self._on[rec.worker]

    @staticmethod
    def _report(spec: TurnSpec, over: TurnOver) -> None:
        try:
            spec.sink.ended(over)
        except Exception:
            log.exception("worker.report_failed", turn=spec.turn)


class TableBackend(Generic[W]):
    """The :class:`~tether.actors.ports.Executor` of a backend whose turns live in
    ``self.turns``: every method is the table's."""

    turns: TurnTable[W]

    def submit(self, spec: TurnSpec) -> None:
        self.turns.submit(spec)

    def dispatched(self, turn: str) -> bool:
        return self.turns.dispatched(turn)

    def accepting(self) -> bool:
        return self.turns.accepting()

    def drain(self) -> None:
        self.turns.drain()

    def signal(self, turn: str, frame: HostFrame) -> None:
        self.turns.signal(turn, frame)

    def kill(self, turn: str) -> None:
        self.turns.kill(turn)

    def freeze(self, turn: str) -> None:
        self.turns.freeze(turn)

    def thaw(self, turn: str) -> None:
        self.turns.thaw(turn)

    def waiting(self, turn: str, on: bool) -> None:
        """A turn waiting on approvals keeps its slot here (a backend that gives it up
        overrides this: the pool)."""


class WorkerGone(Exception):
    """The worker asked to check a driver died meanwhile: ask another."""


_CONFIGS_KEPT = 1024  # configs remembered as passed per backend; the oldest is forgotten


class DriverChecks:
    """Each driver is checked once per backend (a worker imports it: the host never
    runs driver code), and, for a driver whose class checks its config
    (``check_config``), each new config once too; a check whose worker died is asked
    again, twice at most."""

    def __init__(self) -> None:
        self._checked: set[str] = set()
        self._recoverable: set[str] = set()  # of those, the drivers that recover (§17.1)
        self._hooked: set[str] = set()  # of those, the drivers that check their config
        self._configs: OrderedDict[tuple[str, str], None] = OrderedDict()  # passed
        self._lock = threading.Lock()

    def check(
        self,
        driver: str,
        config: dict[str, Any] | None,
        ask: Callable[[str, dict[str, Any] | None], ProbeReply],
    ) -> bool:
        """``ask(driver, config)``: a worker's answer; raises WorkerGone when that worker
        died. The answer's error as its code's TetherError (DriverNotFound, mostly).
        Returns whether the driver's class continues a crashed turn (``recoverable``)."""
        if driver in self._checked and driver not in self._hooked:
            return driver in self._recoverable
        key = (driver, json.dumps(config, sort_keys=True, default=str))
        with self._lock:
            if driver in self._checked and (driver not in self._hooked or key in self._configs):
                if key in self._configs:
                    self._configs.move_to_end(key)
                return driver in self._recoverable
            for _ in range(3):
                try:
                    reply = ask(driver, config)
                except WorkerGone:
                    continue
                if reply.checks_config:
                    self._hooked.add(driver)
                if reply.error is not None:
                    raise error_from_code(reply.code, reply.error)
                self._checked.add(driver)
                if reply.recoverable:
                    self._recoverable.add(driver)
                if reply.checks_config:
                    self._configs[key] = None
                    while len(self._configs) > _CONFIGS_KEPT:
                        self._configs.popitem(last=False)
                return reply.recoverable
        raise TetherError("workers kept dying while checking the driver")
