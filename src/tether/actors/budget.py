"""The governor (semantics §16.2): one home for every tree's budget and spent counters.

Sessions live on several host actors and their workers' usage arrives on the backends'
threads, but a budget covers a whole subtree: so the counters of every tree sit here,
behind one lock, and every change that can cross a threshold (a usage report, a turn's
start, a clock tick for turn seconds, a new budget) is decided inside it. A crossing is
then seen exactly once, by the one report that made it, and the stops it calls for are
issued by that report's thread as soon as the lock is let go: no actor hop between the
report and the stop.

What a session spent (``own``) is kept for every session: its own turns' tokens,
micro-dollars, ended seconds and turns started. A budgeted session also keeps its
subtree's sum (``_Tree.spent``), moved with every delta that reaches it, so a report
costs one dict walk over its lineage, not a walk of the tree. A running turn's seconds
are added when read (``turn_seconds`` counts running turns).

A stop is told to the session's host (``act``), bound to the turn that was running when
the crossing was decided; a turn is stopped by its budget at most once.

Most reports are far from every limit: a tree keeps the least value of tokens, cost and
turns at which a threshold could newly cross (``_Tree.marks``), so a report below them
all is decided in O(1), without a walk of its limits.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import structlog

from tether.actors.clock import SYSTEM_CLOCK, Clock, Timer
from tether.actors.ports import Durable
from tether.wire.budget import (
    Budget,
    BudgetState,
    BudgetStatus,
    limit_text,
    merge_usage,
    spent_text,
)
from tether.wire.errors import BudgetExhausted, InvalidParams

__all__ = ["Governor", "Spent", "SpentStore", "StateStep", "Step", "StepKind", "TurnStep"]

log = structlog.get_logger("tether.budget")

_SEVERITY = {"ok": 0, "soft": 1, "exhausted": 2}
# A running turn's reports kept unadded at most (``_Run.pending``): the store reads them
# within its usage window, but one that does not read must not let a long turn's pile up.
_PENDING_MOST = 256


@dataclass(slots=True)
class Spent:
    """What a session (or a tree) spent: tokens, micro-dollars, ended turns' seconds,
    turns started."""

    tokens: int = 0
    cost: int = 0
    seconds: float = 0.0
    turns: int = 0

    def add(self, other: Spent) -> None:
        self.tokens += other.tokens
        self.cost += other.cost
        self.seconds += other.seconds
        self.turns += other.turns


class SpentStore(Protocol):
    """What the governor needs from the store."""

    def usage_changed(self, *, soon: bool = False) -> None:
        """Running turns' usage changed since the store last took it (``take_usage``):
        to be written (a crashed turn's counts, semantics §16.2); ``soon``: a budget is
        near its limit, write it without delay. Called under the governor's lock, so it
        must not wait."""

    def set_budget(self, session: str, budget: Budget | None) -> Durable:
        """Replace the stored budget; durable once the returned ticket is done."""

    def spent_before(self) -> dict[str, Spent]:
        """What each session's turns of earlier hosts on this store spent."""


@dataclass(slots=True)
class _Run:
    session: str
    lineage: tuple[str, ...]
    started: float  # the clock's monotonic time
    own: Spent  # its session's (``Governor._own``)
    usage: dict[str, int] = field(default_factory=dict)  # reported, but for ``pending``
    # Reports not yet added into ``usage`` (``_merged``, when read): a report appends its
    # frame's dict, so its cost does not grow with its keys.
    pending: list[dict[str, int]] = field(default_factory=list)
    fresh: bool = False  # it reported since the store last took its usage
    chain: list[str] = field(default_factory=list)  # its budgeted lineage, as of ``gen``
    gen: int = -1
    stopped: bool = False  # a budget's hard step reached it: never twice
    paused: bool = False  # a budget's soft pause reached it
    # Since when it waits on approvals alone (semantics §17.2): its seconds stop there.
    held_at: float | None = None

    def seconds(self, now: float) -> float:
        """Its running time: up to ``now``, or to when it began to wait on approvals."""
        return max((now if self.held_at is None else self.held_at) - self.started, 0.0)


@dataclass(slots=True)
class _Tree:
    budget: Budget
    spent: Spent
    soft: set[str] = field(default_factory=set)  # limits past the soft threshold
    hard: set[str] = field(default_factory=set)  # limits reached: the tree is exhausted
    # (tokens, cost_usd, turns) below which no threshold newly crosses; None: look at
    # every limit (not known yet, or turn_seconds, which grows with the clock)
    marks: tuple[float, float, float] | None = None


StepKind = Literal["steer", "pause", "cancel", "abort"]


@dataclass(frozen=True, slots=True)
class TurnStep:
    """A budget's step (``on_soft`` or ``on_hard``) for ``turn`` of ``session``, origin
    ``budget``, told to the session's host; a no-op there if that turn is over."""

    session: str
    turn: str
    kind: StepKind
    text: str


@dataclass(frozen=True, slots=True)
class StateStep:
    """The budget state of ``session``'s tree changed: an event for observers."""

    session: str
    state: BudgetState


Step = TurnStep | StateStep


# A crossing found by ``_check_locked``: a limit reached (key, value, limit), or a soft
# threshold passed (key, limit).
_Hard = tuple[str, float, float]
_Soft = tuple[str, float]


def _below_marks(tree: _Tree) -> bool:
    """The tree's spent tokens, cost and turns are all below its marks: no threshold can
    newly cross (always False while the marks are unknown)."""
    marks = tree.marks
    if marks is None:
        return False
    spent = tree.spent
    return spent.tokens < marks[0] and spent.cost / 1_000_000 < marks[1] and spent.turns < marks[2]


def _merged(run: _Run) -> dict[str, int]:
    """``run``'s usage with its pending reports added (under the governor's lock)."""
    total = run.usage
    for delta in run.pending:
        merge_usage(total, delta)
    run.pending.clear()
    return total


def _marks(tree: _Tree, limits: dict[str, float]) -> tuple[float, float, float]:
    """The values (tokens, cost_usd, turns) at which ``_check_locked`` would next find a
    crossing: a limit's soft threshold until it is crossed, then the limit itself."""
    soft = tree.budget.soft
    out: list[float] = []
    for key in ("tokens", "cost_usd", "turns"):
        limit = limits.get(key)
        if limit is None or key in tree.hard:
            out.append(math.inf)
        elif key in tree.soft:
            out.append(limit)
        else:
            out.append(soft * limit)
    return out[0], out[1], out[2]


class Governor:
    def __init__(
        self,
        *,
        store: SpentStore,
        act: Callable[[Step], None],
        subtree: Callable[[str], list[str]],
        arm: Callable[[float, Callable[[], None]], Timer] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._store = store
        self._act = act
        self._subtree = subtree  # ids below a session, from the catalog
        self._arm = arm
        self._clock = clock
        self._lock = threading.Lock()
        self._own: dict[str, Spent] = {}
        self._trees: dict[str, _Tree] = {}
        self._runs: dict[str, _Run] = {}
        self._based = False  # the earlier hosts' spending is loaded (``_base``)
        self._basing = threading.Lock()  # one reader of it
        # The running turns' usage is kept here alone; the store takes what changed
        # (``take_usage``: the runs that reported since) when it writes. ``_told``: the
        # store knows a change is waiting.
        self._told = False
        self._timer: Timer | None = None
        self._timed = 0  # budgets with a turn_seconds limit: only then is a clock kept
        self._gen = 0  # bumped whenever a budget comes or goes: runs' chains are stale

    # ---- the hot paths: a turn starts, reports usage, ends ----------------------------

    def start(self, session: str, lineage: tuple[str, ...], turn: str) -> bool:
        """May ``turn`` of ``session`` start? False while a budget of its tree is
        exhausted or its ``turns`` limit is reached (the message stays parked). A turn
        allowed is counted at once, under the lock, so no two starts pass one limit."""
        steps: list[Step] = []
        allowed = True
        with self._lock:
            chain = self._chain(session, lineage)
            now = self._clock.monotonic()
            trees = self._trees
            for b in chain:
                tree = trees[b]
                if not _below_marks(tree):  # turn seconds, or not known yet
                    steps += self._check_locked(b, now)
                if tree.hard:
                    allowed = False
            if allowed:
                own = self._own_of(session)
                self._runs[turn] = _Run(session, lineage, now, own, chain=chain, gen=self._gen)
                own.turns += 1
                for b in chain:
                    tree = trees[b]
                    tree.spent.turns += 1
                    if not _below_marks(tree):
                        steps += self._check_locked(b, now)
                if self._timed:
                    self._reschedule_locked()
        self._issue(steps)
        return allowed

    def rejoin(self, session: str, lineage: tuple[str, ...], turn: str) -> None:
        """A turn a dead host left open recovers on this one (semantics §17.1): under
        its tree's budgets again, counted already (the store kept its spending), and
        timed from now, so the time the host was down counts toward no budget."""
        with self._lock:
            chain = self._chain(session, lineage)
            own = self._own_of(session)
            now = self._clock.monotonic()
            self._runs[turn] = _Run(session, lineage, now, own, chain=chain, gen=self._gen)
            if self._timed:
                self._reschedule_locked()

    def hold(self, turn: str, on: bool) -> None:
        """``turn`` waits on approvals alone (``on``), or goes on: the wait counts toward
        no ``turn_seconds`` (semantics §17.2)."""
        with self._lock:
            run = self._runs.get(turn)
            if run is None:
                return
            now = self._clock.monotonic()
            if on and run.held_at is None:
                run.held_at = now
            elif not on and run.held_at is not None:
                run.started += now - run.held_at  # the wait is cut out of its time
                run.held_at = None
            if self._timed:
                self._reschedule_locked()

    def usage(self, session: str, turn: str, delta: dict[str, int]) -> None:
        """One response's usage (a worker's frame), on the backend's thread. ``delta``'s
        values are ints (the frame's typed decode checked them) and it is not changed
        after: it is kept as it is until the store or the turn's end adds it up."""
        get = delta.get
        tokens = get("prompt_tokens", 0) + get("completion_tokens", 0)
        cost = get("cost_microusd", 0)
        steps: list[Step] | None = None
        with self._lock:
            run = self._runs.get(turn)
            if run is None or run.session != session:
                return  # not a turn this host runs (it ended): nothing to count
            run.fresh = True
            pending = run.pending
            pending.append(delta)
            if len(pending) >= _PENDING_MOST:  # a store that does not take (closing)
                _merged(run)
            own = run.own
            own.tokens += tokens
            own.cost += cost
            if run.gen != self._gen:
                run.chain, run.gen = self._chain(session, run.lineage), self._gen
            soon = False
            trees = self._trees
            for b in run.chain:
                tree = trees[b]
                spent = tree.spent
                spent.tokens += tokens
                spent.cost += cost
                # ``_below_marks``, inline (a call a report): the usual report is below
                # every mark; a report moves no turn count, so tokens and cost decide
                marks = tree.marks
                if marks is None or spent.tokens >= marks[0] or spent.cost / 1_000_000 >= marks[1]:
                    crossed = self._check_locked(b)
                    if crossed:
                        steps = crossed if steps is None else steps + crossed
                if tree.soft:
                    soon = True
            # near a limit, what was spent is written with the next batch, not at the end
            if soon or not self._told:
                self._told = True
                self._store.usage_changed(soon=soon)
        if steps is not None:
            self._issue(steps)

    def take_usage(self) -> dict[str, dict[str, int]]:
        """The usage of each running turn that reported since the last take (the
        store's, when it writes them)."""
        with self._lock:
            taken: dict[str, dict[str, int]] = {}
            for turn, run in self._runs.items():
                if run.fresh:
                    run.fresh = False
                    taken[turn] = _merged(run).copy()
            self._told = False
        return taken

    def ended(self, turn: str, usage: dict[str, int] | None = None) -> dict[str, int] | None:
        """``turn`` ended: its seconds count as ended. Returns its record's usage:
        ``usage``, its end's, when its worker sent an end; else what it reported as it
        went (a killed turn), so a tree's spent is the sum of its turns' records. The
        store takes it no more: the end's record writes it."""
        with self._lock:
            run = self._runs.pop(turn, None)
            if run is None:
                return usage
            seconds = run.seconds(self._clock.monotonic())
            run.own.seconds += seconds
            if run.gen != self._gen:
                run.chain, run.gen = self._chain(run.session, run.lineage), self._gen
            for b in run.chain:
                self._trees[b].spent.seconds += seconds
            if self._timed:
                self._reschedule_locked()
        if usage is not None:
            return usage  # its reports are not added up: nobody reads them now
        return _merged(run) or None  # popped under the lock: this thread's alone now

    # ---- budgets: set, changed, read --------------------------------------------------

    def admit(self, session: str, lineage: tuple[str, ...], budget: Budget | None) -> None:
        """A session is about to be created below ``lineage`` (its ancestors, root
        first): refused with BudgetExhausted when a budget above is exhausted, and with
        InvalidParams when its own ``budget`` does not fit in what an ancestor's has left.
        Its budget, if any, is in force from here on."""
        steps: list[Step] = []
        refused: Exception | None = None
        if budget is not None:
            self._base()  # with a budget above, it is loaded already
        with self._lock:
            chain = [b for b in lineage if b in self._trees]
            if not chain and budget is None:
                return
            now = self._clock.monotonic()
            for b in chain:
                steps += self._check_locked(b, now)
                tree = self._trees[b]
                if tree.hard and refused is None:
                    key = sorted(tree.hard)[0]
                    value = self._value_locked(b, tree, key, now)
                    refused = BudgetExhausted(
                        f"the budget of {b} is spent "
                        f"({spent_text(key, value, tree.budget.limits()[key])}): "
                        "no spawn below it until it is raised"
                    )
            if refused is None and budget is not None:
                try:
                    self._fits_locked(budget, chain, now)
                except InvalidParams as exc:
                    refused = exc
                else:
                    self._put_locked(session, budget)
        self._issue(steps)
        if refused is not None:
            raise refused

    def forget(self, session: str) -> None:
        """A session ``admit`` let through was not created after all."""
        with self._lock:
            self._drop_locked(session)

    def restore(self, budgets: Iterable[tuple[str, Budget]]) -> None:
        """The budgets of a store's sessions, at a host's start (no step is taken: no
        turn runs yet)."""
        items = list(budgets)
        if not items:
            return
        self._base()
        with self._lock:
            now = self._clock.monotonic()
            for session, budget in items:
                self._put_locked(session, budget)
                tree = self._trees[session]
                self._check_locked(session, now)
                tree.soft |= tree.hard
                tree.marks = None

    def set_budget(self, session: str, lineage: tuple[str, ...], budget: Budget | None) -> Durable:
        """Replace (or, with None, remove) ``session``'s own budget. It must fit in what
        each budgeted ancestor has left (InvalidParams). A limit now reached is acted on
        as a crossing; one raised lifts the exhaustion, and parked work runs again on a
        waking send."""
        steps: list[Step] = []
        self._base()
        with self._lock:
            now = self._clock.monotonic()
            if budget is None:
                self._drop_locked(session)
            else:
                chain = [b for b in lineage if b in self._trees]
                self._fits_locked(budget, chain, now)
                had = session in self._trees
                self._put_locked(session, budget)
                tree = self._trees[session]
                if had:  # what was crossed and still is stays crossed
                    limits = budget.limits()
                    tree.soft = {k for k in tree.soft if k in limits}
                    tree.hard = {k for k in tree.hard if k in limits}
                    for key in list(tree.hard):
                        if self._value_locked(session, tree, key, now) < limits[key]:
                            tree.hard.discard(key)
                    for key in list(tree.soft):
                        value = self._value_locked(session, tree, key, now)
                        if value < budget.soft * limits[key]:
                            tree.soft.discard(key)
                tree.marks = None
                steps += self._check_locked(session, now)
            mine = self._trees.get(session)
            state = "ok" if mine is None else self._state_locked(session, mine, now)
            steps.append(StateStep(session, state))
            if self._timed:
                self._reschedule_locked()
            ticket = self._store.set_budget(session, budget)  # queued in this order
        self._issue(steps)
        return ticket

    def status(self, session: str, lineage: tuple[str, ...]) -> BudgetStatus:
        """What ``session``'s subtree spent, against its own budget, and the tightest
        state of its own and its ancestors' budgets."""
        self._base()
        with self._lock:
            now = self._clock.monotonic()
            tree = self._trees.get(session)
            if tree is not None:
                spent = self._spent_dict(session, tree.spent, now)
            else:
                total = Spent()
                ids = [session, *self._subtree(session)]
                for sid in ids:
                    own = self._own.get(sid)
                    if own is not None:
                        total.add(own)
                spent = self._spent_dict(session, total, now, set(ids))
            limits = tree.budget.limits() if tree is not None else {}
            remaining = {k: max(limit - spent[k], 0.0) for k, limit in limits.items()}
            state: BudgetState = "ok"
            decided: str | None = None
            for b in (session, *reversed(lineage)):
                t = self._trees.get(b)
                if t is None:
                    continue
                s = self._state_locked(b, t, now)
                if _SEVERITY[s] > _SEVERITY[state]:
                    state, decided = s, b
            return BudgetStatus(
                session=session,
                limits=dict(limits),
                spent=spent,
                remaining=remaining,
                state=state,
                decided_by=decided,
                budget=tree.budget if tree is not None else None,
            )

    def left(self, session: str, lineage: tuple[str, ...]) -> dict[str, float]:
        """The least each budget above and on ``session`` has left, per limit: what its
        tree may still spend (the model tool ``budget``)."""
        with self._lock:
            now = self._clock.monotonic()
            out: dict[str, float] = {}
            for b in self._chain(session, lineage):
                tree = self._trees[b]
                for key, limit in tree.budget.limits().items():
                    left = max(limit - self._value_locked(b, tree, key, now), 0.0)
                    out[key] = min(out.get(key, left), left)
            return out

    # ---- internals ----------------------------------------------------------------

    def _chain(self, session: str, lineage: tuple[str, ...]) -> list[str]:
        trees = self._trees
        if not trees:
            return []
        return [b for b in (*lineage, session) if b in trees]

    def _own_of(self, session: str) -> Spent:
        own = self._own.get(session)
        if own is None:
            own = self._own[session] = Spent()
        return own

    def _base(self) -> None:
        """Add what earlier hosts' turns spent (read once, when a budget first needs it:
        a store with no budget never pays for the read). Not under the lock: a read
        commits the store's queue, and its usage write takes this lock."""
        if self._based:
            return
        with self._basing:
            if self._based:
                return
            before = self._store.spent_before()  # earlier hosts' rows: they do not change
            with self._lock:
                for session, spent in before.items():
                    self._own_of(session).add(spent)
                self._based = True

    def _put_locked(self, session: str, budget: Budget) -> None:
        old = self._trees.get(session)
        timed = old is not None and old.budget.turn_seconds is not None
        if old is not None:
            old.budget = budget
            old.marks = None
        else:
            self._gen += 1
            total = Spent()
            for sid in (session, *self._subtree(session)):
                own = self._own.get(sid)
                if own is not None:
                    total.add(own)
            self._trees[session] = _Tree(budget, total)
        self._timed += (budget.turn_seconds is not None) - timed

    def _drop_locked(self, session: str) -> None:
        tree = self._trees.pop(session, None)
        if tree is not None:
            self._gen += 1
            if tree.budget.turn_seconds is not None:
                self._timed -= 1

    def _fits_locked(self, budget: Budget, chain: list[str], now: float) -> None:
        """Carving: each limit of ``budget`` fits in what every budgeted ancestor with
        that limit has left (what the tree spent counts; siblings' budgets do not)."""
        for b in chain:
            tree = self._trees[b]
            theirs = tree.budget.limits()
            for key, value in budget.limits().items():
                if key not in theirs:
                    continue
                left = max(theirs[key] - self._value_locked(b, tree, key, now), 0.0)
                if value > left:
                    raise InvalidParams(
                        f"budget.{key} {limit_text(key, value)} does not fit in what the "
                        f"budget of {b} has left ({limit_text(key, left)})"
                    )

    def _running_seconds(self, inside: Callable[[_Run], bool], now: float) -> float:
        return sum(r.seconds(now) for r in self._runs.values() if inside(r))

    def _in_tree(self, b: str) -> Callable[[_Run], bool]:
        return lambda r: r.session == b or b in r.lineage

    def _value_locked(self, b: str, tree: _Tree, key: str, now: float) -> float:
        spent = tree.spent
        match key:
            case "tokens":
                return float(spent.tokens)
            case "cost_usd":
                return spent.cost / 1_000_000
            case "turns":
                return float(spent.turns)
            case _:
                return spent.seconds + self._running_seconds(self._in_tree(b), now)

    def _spent_dict(
        self, b: str, spent: Spent, now: float, ids: set[str] | None = None
    ) -> dict[str, float]:
        inside = self._in_tree(b) if ids is None else (lambda r: r.session in ids)
        return {
            "tokens": spent.tokens,
            "cost_usd": spent.cost / 1_000_000,
            "turn_seconds": spent.seconds + self._running_seconds(inside, now),
            "turns": spent.turns,
        }

    def _state_locked(self, b: str, tree: _Tree, now: float) -> BudgetState:
        state: BudgetState = "ok"
        for key, limit in tree.budget.limits().items():
            value = self._value_locked(b, tree, key, now)
            if value >= limit:
                return "exhausted"
            if value >= tree.budget.soft * limit:
                state = "soft"
        return state

    def _check_locked(self, b: str, now: float | None = None) -> list[Step]:
        """Note the thresholds ``b``'s tree has newly crossed; the steps they call for
        (``now``: the clock's time, read here when needed and not given)."""
        tree = self._trees[b]
        if _below_marks(tree):
            return []  # below every threshold still to cross: nothing can cross
        if now is None:
            now = self._clock.monotonic()
        hard, soft = self._cross_locked(b, tree, now)
        return self._crossed_steps(b, tree, hard, soft)

    def _cross_locked(self, b: str, tree: _Tree, now: float) -> tuple[list[_Hard], list[_Soft]]:
        """Mark the limits of ``b``'s tree newly past their soft threshold or reached, and
        the tree's new marks; returns the crossings, in the budget's limit order."""
        budget = tree.budget
        hard: list[_Hard] = []
        soft: list[_Soft] = []
        limits = budget.limits()
        for key, limit in limits.items():
            if key in tree.hard:
                continue
            value = self._value_locked(b, tree, key, now)
            if value >= limit:
                tree.hard.add(key)
                tree.soft.add(key)
                hard.append((key, value, limit))
            elif key not in tree.soft and value >= budget.soft * limit:
                tree.soft.add(key)
                soft.append((key, limit))
        tree.marks = None if budget.turn_seconds is not None else _marks(tree, limits)
        return hard, soft

    def _crossed_steps(
        self, b: str, tree: _Tree, hard: list[_Hard], soft: list[_Soft]
    ) -> list[Step]:
        """What new crossings call for: the tree's state change, then the hard action
        (a reached limit) or else the soft one."""
        budget = tree.budget
        stops = [h for h in hard if h[0] != "turns"]  # turns: no running turn is stopped
        changed: list[Step] = []
        if hard:
            key, value, limit = hard[0]
            log.warning("budget.exhausted", session=b, limit=key, spent=value, of=limit)
            changed = [StateStep(b, "exhausted")]
        elif soft:
            log.info("budget.soft", session=b, limit=soft[0][0])
            changed = [StateStep(b, "exhausted" if tree.hard else "soft")]
        if stops:
            key, value, limit = stops[0]
            where = spent_text(key, value, limit)
            return changed + self._targets(b, budget.on_hard, where, stop=True)
        if soft and budget.on_soft != "none" and not hard:
            key, limit = soft[0]
            text = f"{round(budget.soft * 100)}% of {limit_text(key, limit)}"
            return changed + self._targets(b, budget.on_soft, text, stop=False)
        return changed

    def _targets(self, b: str, kind: StepKind, what: str, *, stop: bool) -> list[Step]:
        """One step per running turn of ``b``'s tree (a stop: those not stopped yet)."""
        steps: list[Step] = []
        for turn, r in self._runs.items():
            if r.session != b and b not in r.lineage:
                continue
            if r.stopped or (kind == "pause" and r.paused):
                continue
            if stop:
                r.stopped = True
            elif kind == "pause":
                r.paused = True
            where = "this tree" if r.session == b else f"the tree of {b}"
            text = f"{what} spent in {where}" + ("" if stop else "; wrap up")
            steps.append(TurnStep(r.session, turn, kind, text))
        return steps

    def _issue(self, steps: list[Step]) -> None:
        for step in steps:
            try:
                self._act(step)
            except Exception:  # one host gone (closing) must not spare the others
                log.exception("budget.step_failed", step=step)

    def _reschedule_locked(self) -> None:
        """Arm the one clock for the next turn-seconds threshold of any tree."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._timed or self._arm is None:
            return
        now = self._clock.monotonic()
        due: float | None = None
        for b, tree in self._trees.items():
            limit = tree.budget.turn_seconds
            if limit is None or "turn_seconds" in tree.hard:
                continue
            inside = self._in_tree(b)
            n = sum(1 for r in self._runs.values() if inside(r))
            if not n:
                continue
            value = self._value_locked(b, tree, "turn_seconds", now)
            mark = limit if "turn_seconds" in tree.soft else tree.budget.soft * limit
            wait = max((mark - value) / n, 0.0)
            due = wait if due is None else min(due, wait)
        if due is not None:
            self._timer = self._arm(due + 0.001, self._tick)

    def _tick(self) -> None:
        """The turn-seconds clock (on the timer thread): check every timed tree."""
        steps: list[Step] = []
        with self._lock:
            self._timer = None
            now = self._clock.monotonic()
            for b, tree in list(self._trees.items()):
                if tree.budget.turn_seconds is not None:
                    steps += self._check_locked(b, now)
            self._reschedule_locked()
        self._issue(steps)
