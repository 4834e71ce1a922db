"""Issue 8: every stop holds under races and faults (regression tests for its findings).

Each test is named after the behaviour a user relies on, runs real worker processes and
real SQLite, and uses only the public API. Race tests loop the race many times with a
tiny GIL switch interval, and synchronize on state and events with deadlines (the only
sleeps are random jitter that moves a call across a race window, never a wait).

Tests reach their behaviour assertions on the v1 API as well: turn ids are read from
``rt.turns()``/the transcript, and v2-only shapes (``interrupt`` returning the turn id,
``send`` returning the message id, ``rt.inbox``) are collected as "API gaps" and asserted
after the behaviour, so a run on v1 says which failure is which.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import structlog

import tether
from drivers import (
    HANG,
    SCRIPTED,
    TESTS,
    alive,
    entries,
    eventually,
    refilled,
    runtime,
    sigkilled_host,
    spawn_child,
    steps,
    switching_fast,
    texts,
    wait_entry,
)
from tether import User

BAD = "\ud800"  # a lone surrogate: not encodable as UTF-8
STOP_ACTIONS = ("cancelled", "aborted")


# ---- helpers ------------------------------------------------------------------------------


@pytest.fixture
def switchy() -> Iterator[None]:
    """Switch threads as often as CPython allows, so that races interleave finely."""
    with switching_fast(1e-6):
        yield


def _race(*calls: Callable[[], Any], timeout: float = 15.0) -> list[tuple[str, Any]]:
    """Run ``calls`` at once from threads released by one barrier.

    Returns ``("ok", value)`` or ``("err", exception)`` per call; a call that does not
    return within ``timeout`` fails the test (a hung public call is a bug in itself).
    """
    barrier = threading.Barrier(len(calls))
    results: list[tuple[str, Any]] = [("hung", None)] * len(calls)

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            barrier.wait(timeout)
            results[i] = ("ok", fn())
        except BaseException as exc:
            results[i] = ("err", exc)

    threads = [
        threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(calls)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for i, t in enumerate(threads):
        t.join(max(deadline - time.monotonic(), 0.0))
        if t.is_alive():
            raise AssertionError(f"racing call #{i} did not return within {timeout:g}s")
    return results


def _spin(seconds: float) -> None:
    """Jitter: move the next call across a race window (busy, not a synchronization)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _open(rt: tether.Runtime, sid: str) -> set[str]:
    return {t.id for t in rt.turns(sid) if t.outcome is None}


def _stop_markers(rt: tether.Runtime, sid: str) -> list[tether.Entry]:
    return [e for e in entries(rt, sid, "marker") if e.action in STOP_ACTIONS]


def _overlaps(turns: list[tether.TurnRecord]) -> list[tuple[str, str]]:
    """Pairs of turns of one session that ran at the same time."""
    done = sorted(turns, key=lambda t: t.started_at)
    out = []
    for a, b in itertools.pairwise(done):
        if a.ended_at is None or a.ended_at > b.started_at:
            out.append((a.id, b.id))
    return out


class ApiGaps:
    """v2 API shapes that are missing or wrong, asserted after the behaviour."""

    def __init__(self) -> None:
        self.gaps: list[str] = []

    def note(self, text: str) -> None:
        if len(self.gaps) < 20:
            self.gaps.append(text)

    def inbox(self, rt: tether.Runtime, sid: str) -> list[Any] | None:
        fn = getattr(rt, "inbox", None)
        if fn is None:
            self.note("rt.inbox() does not exist")
            return None
        return list(fn(sid))

    def check(self) -> None:
        assert not self.gaps, "API (v2 shape) failures: " + "; ".join(self.gaps)


def _quiet(rt: tether.Runtime, sid: str, *, timeout: float = 10.0, what: str = "") -> None:
    """Wait until ``sid`` runs no turn (every turn has ended) and rests."""

    def rested() -> bool:
        info = rt.status(sid)
        return info.state in ("idle", "parked", "dormant", "settled") and not _open(rt, sid)

    try:
        eventually(rested, timeout=timeout, what=what or f"{sid} to rest")
    except AssertionError:
        info = rt.status(sid)
        raise AssertionError(
            f"{what}: {sid} never came to rest: {info.state}, turn={info.turn}, "
            f"open turns={sorted(_open(rt, sid))}, pending={info.pending}"
        ) from None


# ---- 1. release racing a waking send --------------------------------------------------------


def _release_and_look(rt: tether.Runtime, sid: str) -> tuple[str, set[str]]:
    """Release, then read the state between two looks at the open turns: a turn open in
    both looks was running while the state was read."""
    rt.release(sid)
    before = _open(rt, sid)
    state = rt.status(sid).state
    return state, before & _open(rt, sid)


@pytest.mark.timeout(120)
def test_release_racing_a_waking_send_never_leaves_an_ownerless_turn(
    rt: tether.Runtime, switchy: None
) -> None:
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    for i in range(200):
        c = spawn_child(rt, root, slug=f"c{i}")
        released, sent = _race(
            partial(_release_and_look, rt, c), partial(rt.send, c, "a", authority=me)
        )
        where = f"race {i}/200"
        assert sent[0] == "ok", f"{where}: the waking send failed: {sent[1]!r}"
        if released[0] == "err":
            assert isinstance(released[1], tether.InvalidParams), f"{where}: {released[1]!r}"
        # Every turn ends: none is left running with no actor to hear its end.
        _quiet(rt, c, timeout=10.0, what=f"{where}: a turn left running with no owner")
        if released[0] == "ok":
            state, running = released[1]
            assert not (state == "dormant" and running), (
                f"{where}: release returned and {c} read dormant while turn(s) "
                f"{sorted(running)} ran"
            )
        # A later waking send never starts a second turn beside an old one.
        rt.send(c, "b", authority=me)
        _quiet(rt, c, timeout=10.0, what=f"{where}: after the final waking send")
        turns = rt.turns(c)
        assert not _overlaps(turns), f"{where}: concurrent turns for one session: {turns}"
        assert [t.outcome for t in turns] == ["completed", "completed"], f"{where}: {turns}"


@pytest.mark.timeout(120)
def test_a_waking_send_racing_release_is_never_stranded_and_runs_once_in_fifo_order(
    rt: tether.Runtime, switchy: None
) -> None:
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    api = ApiGaps()
    for i in range(200):
        c = spawn_child(rt, root, slug=f"c{i}")
        _, first, second = _race(
            partial(rt.release, c),
            partial(rt.send, c, "a1", authority=me),
            partial(rt.send, c, "a2", authority=me),
        )
        where = f"race {i}/200"
        assert first[0] == "ok" and second[0] == "ok", f"{where}: {first!r} {second!r}"
        for r in (first, second):
            if not isinstance(r[1], str):
                api.note(f"send() returned {r[1]!r}, not the message id")
        # Both waking sends were accepted: both messages run, with no further send.

        def both_claimed(c: str = c) -> bool:
            return len(texts(rt, c, "user")) == 2

        try:
            eventually(
                both_claimed,
                timeout=10.0,
                what="both raced messages to be claimed",
            )
        except AssertionError:
            info = rt.status(c)
            raise AssertionError(
                f"{where}: a waking send was stranded: {c} is {info.state} with "
                f"{info.pending} pending, claimed {texts(rt, c, 'user')}"
            ) from None
        _quiet(rt, c, what=f"{where}: the raced turns")
        rt.send(c, "z", authority=me)  # the final waking send
        _quiet(rt, c, what=f"{where}: after the final waking send")
        users = entries(rt, c, "user")
        got = [e.text for e in users]
        assert sorted(got[:2]) == ["a1", "a2"] and got[2:] == ["z"], f"{where}: claimed {got}"
        turns = rt.turns(c)
        assert [t.id for t in turns] == [e.turn for e in users], f"{where}: one turn a message"
        assert all(t.outcome == "completed" for t in turns), f"{where}: {turns}"
        assert not _overlaps(turns), f"{where}: concurrent turns: {turns}"
        assert rt.status(c).pending == 0
    api.check()


# ---- 2. dispose racing a send ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_disposed_session_never_comes_back_or_runs_a_turn_after_dispose_returned(
    rt: tether.Runtime, switchy: None
) -> None:
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    for i in range(500):
        c = spawn_child(rt, root, slug=f"c{i}")

        def dispose_and_look(c: str = c) -> tuple[str, list[tether.TurnRecord]]:
            rt.dispose(c, authority=me)
            return rt.status(c).state, rt.turns(c)

        disposed, sent = _race(dispose_and_look, partial(rt.send, c, "x", authority=me))
        where = f"race {i}/500"
        assert disposed[0] == "ok", f"{where}: dispose raised {disposed[1]!r}"
        state, turns_at_return = disposed[1]
        assert state == "settled", f"{where}: dispose returned with {c} {state}"
        if sent[0] == "err":
            assert isinstance(sent[1], tether.InvalidParams), f"{where}: {sent[1]!r}"
        # status() first handles what was told to the session before it: a revival by the
        # racing send would show here.
        info = rt.status(c)
        assert info.state == "settled", f"{where}: {c} came back {info.state} after dispose"
        turns = rt.turns(c)
        assert [t.id for t in turns] == [t.id for t in turns_at_return], (
            f"{where}: a turn started after dispose returned: {turns}"
        )
        assert all(t.outcome is not None for t in turns), f"{where}: {turns}"
        for e in entries(rt, c, "user"):  # the message ran only in a turn dispose stopped
            assert e.turn in {t.id for t in turns_at_return}, f"{where}: {e}"
        assert info.pending == 0
        with pytest.raises(tether.InvalidParams):
            rt.send(c, "late", authority=me)
        assert rt.status(c).state == "settled"
    assert all(i.state == "settled" for i in rt.list_agents(root))


# ---- 3. a descendant ignoring cancel spawns during its parent's disposal --------------------


def test_no_child_stays_live_under_a_settled_parent_even_one_spawned_during_disposal(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    for round_ in range(3):
        a = spawn_child(rt, root, slug=f"a{round_}")
        spawns = [
            op
            for j in range(1, 200)
            for op in (
                {"op": "work", "steps": 1, "every": 0.01},
                {"op": "spawn", "slug": f"k{j}"},
            )
        ]
        script = steps(
            {"op": "ignore_cancel"},
            {"op": "spawn", "slug": "k0", "data": HANG},
            {"op": "say", "text": "ready"},
            *spawns,
            {"op": "hang"},
        )
        rt.send(a, "spawn forever", authority=me, data=script)
        wait_entry(rt, a, "assistant", "ready", timeout=10.0)
        k0 = next(i.id for i in rt.list_agents(a) if i.slug == "k0")
        rt.wait(k0, until="running", timeout=10.0)

        began = time.time()
        rt.dispose(a, authority=me)
        # The scenario happened: the session kept calling spawn while it was disposed.
        late = [e for e in entries(rt, a, "tool") if "spawn" in e.text and e.created_at > began]
        assert late, "the disposed session made no spawn call during its disposal"

        walk = rt.list_agents(a, scope="descendants")
        live = [(i.slug, i.state) for i in walk if i.state != "settled"]
        assert not live, f"round {round_}: live under a settled parent: {live[:10]}"
        assert rt.status(a).state == "settled"
        for info in walk:
            assert not _open(rt, info.id), f"round {round_}: {info.slug} still has a turn"
    refilled(rt)


# ---- 4. a stop racing a turn's natural end --------------------------------------------------


class _Starts:
    """turn.started events per session, with a wait (events are pushed, not polled)."""

    def __init__(self, rt: tether.Runtime) -> None:
        self._cond = threading.Condition()
        self._started: dict[str, list[str]] = {}
        self.unsubscribe = rt.subscribe(self._on)

    def _on(self, ev: tether.Event) -> None:
        if ev.name == "turn.started":
            with self._cond:
                self._started.setdefault(ev.session, []).append(ev.data["turn"])
                self._cond.notify_all()

    def first(self, sid: str, *, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._started.get(sid):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no turn started in {sid} within {timeout:g}s")
                self._cond.wait(left)
            return self._started[sid][0]


def _queue_three(rt: tether.Runtime, c: str, me: User) -> None:
    """m1 starts T1 (a short turn), m2 and m3 queue behind it (auto-drain takes them)."""
    rt.send(c, "m1", authority=me, wake=False)
    rt.send(c, "m2", authority=me, wake=False)
    rt.send(c, "m3", authority=me)


def _check_stop_bound(
    rt: tether.Runtime,
    c: str,
    kind: str,
    ret: Any,
    returned_at: float,
    api: ApiGaps,
    where: str,
    *,
    guard: str | None = None,
) -> str | None:
    """The checks shared by the stop races; returns the turn the stop landed on."""
    _quiet(rt, c, what=where)
    turns = {t.id: t for t in rt.turns(c)}
    order = list(turns)
    markers = _stop_markers(rt, c)
    assert len(markers) <= 1, f"{where}: more than one stop marker: {markers}"
    landed = markers[0].turn if markers else None
    if landed is not None:
        t = turns[landed]
        assert t.started_at < returned_at, (
            f"{where}: the {kind} landed on {landed}, which started after interrupt() "
            f"returned (turn order {order})"
        )
        if guard is not None:
            assert landed == guard, f"{where}: guarded by turn={guard}, it stopped {landed}"
        want = ("aborted",) if kind == "abort" else ("cancelled", "aborted")
        assert t.outcome in want, f"{where}: the {kind} marker is on {landed}, which ended {t}"
        # The queue behind the stopped turn stays parked: nothing drained after it.
        after = order[order.index(landed) + 1 :]
        assert not after, f"{where}: the queue drained after the stopped turn: {after}"
        info = rt.status(c)
        assert info.state == "parked", f"{where}: {info}"
        assert info.pending == 3 - len(order), f"{where}: {info}"
    # A turn that no stop landed on ended by itself.
    for tid, t in turns.items():
        if tid != landed:
            assert t.outcome == "completed", f"{where}: {tid} ended {t.outcome} with no marker"
    if landed is None:
        assert len(order) == 3 and rt.status(c).state == "idle", f"{where}: {order}"
    # v2: interrupt() names the turn the stop was bound to, or None when it changed nothing.
    if ret != landed:
        api.note(f"{where}: interrupt() returned {ret!r}, the stop landed on {landed!r}")
    return landed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["abort", "cancel"])
def test_a_stop_racing_a_turns_natural_end_lands_on_that_turn_or_changes_nothing(
    rt: tether.Runtime, switchy: None, kind: str
) -> None:
    """A stop issued while T1 runs never lands on T2; one accepted for T1 shows on T1
    (marker and outcome) and the queue behind it stays parked."""
    starts = _Starts(rt)
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    api = ApiGaps()
    rng = random.Random(8)
    landed_on: dict[str, int] = {}
    for i in range(200):
        c = spawn_child(rt, root, slug=f"c{i}")
        _queue_three(rt, c, me)
        t1 = starts.first(c)
        _spin(rng.uniform(0.0, 0.004))
        ret = rt.interrupt(c, authority=me, kind=kind, reason=f"r{i}")
        returned_at = time.time()
        landed = _check_stop_bound(rt, c, kind, ret, returned_at, api, f"race {i}/200")
        which = "none" if landed is None else "T1" if landed == t1 else "later"
        landed_on[which] = landed_on.get(which, 0) + 1
    starts.unsubscribe()
    print(f"{kind}: landed on {landed_on}")
    api.check()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["abort", "cancel"])
def test_a_stop_guarded_by_turn_never_stops_the_next_turn(
    rt: tether.Runtime, switchy: None, kind: str
) -> None:
    """Stop clicked on turn 7 never stops turn 8: ``interrupt(..., turn=T1)``."""
    starts = _Starts(rt)
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)

    # Plainly: T1 has ended, T2 runs; the guard for T1 is a no-op that changes nothing.
    c = spawn_child(rt, root, slug="plain")
    rt.send(c, "quick", authority=me)
    rt.wait(c, until="idle", timeout=10.0)
    [t1] = [t.id for t in rt.turns(c)]
    rt.send(c, "long", authority=me, data=HANG)
    t2 = rt.wait(c, until="running", timeout=10.0).turn
    assert rt.interrupt(c, authority=me, kind=kind, turn=t1) is None
    info = rt.status(c)
    assert (info.state, info.turn, info.stopping) == ("running", t2, None)
    assert _stop_markers(rt, c) == []
    assert rt.interrupt(c, authority=me, kind=kind, turn=t2) == t2
    _quiet(rt, c)
    stopped = "aborted" if kind == "abort" else "cancelled"
    assert [t.outcome for t in rt.turns(c)] == ["completed", stopped]

    api = ApiGaps()
    rng = random.Random(7)
    for i in range(200):
        c = spawn_child(rt, root, slug=f"c{i}")
        _queue_three(rt, c, me)
        t1 = starts.first(c)
        _spin(rng.uniform(0.0, 0.004))
        ret = rt.interrupt(c, authority=me, kind=kind, reason=f"r{i}", turn=t1)
        returned_at = time.time()
        _check_stop_bound(rt, c, kind, ret, returned_at, api, f"race {i}/200", guard=t1)
    starts.unsubscribe()
    api.check()


# ---- a spawn racing a subtree stop or pause (issue 26, item 8) --------------------------------


_SUBTREE_TRIES = 200


class _SupervisorOrder:
    """The order in which the supervisor handled spawns and walk marks, read on its own
    thread (it handles one message at a time): the one order that says whether a spawn
    fell before the walk's mark, inside the walk, or after it ended. The test thread's
    clocks cannot: a stop returns, and is timed, only after its walk has ended."""

    def __init__(self, rt: tether.Runtime) -> None:
        actor = rt._sup._actor_weakref()
        assert actor is not None
        self.seen: list[tuple[str, str]] = []
        create, walk = actor._create, actor._walk

        def spied_create(c: Any) -> Any:
            out = create(c)  # raises, and records nothing, when refused
            self.seen.append(("create", c.header.id))
            return out

        def spied_walk(w: Any) -> Any:
            self.seen.append(("on" if w.on else "off", w.root))
            return walk(w)

        # spies on the actor's own calls, for this test's actor only
        actor._create, actor._walk = spied_create, spied_walk  # type: ignore[method-assign]

    def where(self, sid: str, root: str) -> str:
        """``before`` the walk of ``root`` began, ``inside`` it, or ``after`` it ended."""
        at = self.seen.index(("create", sid))
        on = max(i for i, e in enumerate(self.seen) if e == ("on", root))
        off = max(i for i, e in enumerate(self.seen) if e == ("off", root))
        return "before" if at < on else "inside" if at < off else "after"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["cancel", "abort", "pause"])
def test_a_spawn_racing_a_subtree_stop_is_stopped_with_the_subtree_or_refused(
    rt: tether.Runtime, switchy: None, op: str
) -> None:
    """A subtree stop (or pause) reaches every session in the subtree when it returns: a
    child spawned while it walks the tree either landed before (its turn is among those
    stopped) or is refused, saying why. Only a spawn that returned after the stop did may
    run on: it came after."""
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    order = _SupervisorOrder(rt)
    landed = refused = 0
    for i in range(_SUBTREE_TRIES):
        where = f"{op} race {i}/{_SUBTREE_TRIES}"
        kid = spawn_child(rt, root, slug=f"kid{i}")
        for j in range(4):  # idle sessions: the walk takes a few steps
            spawn_child(rt, kid, slug=f"idle{j}")

        def spawn(kid: str = kid) -> str:
            return spawn_child(rt, kid, slug="late", prompt="go", data=HANG)

        def stop(kid: str = kid) -> list[str]:
            _spin(random.uniform(0, 0.003))
            if op == "pause":
                return rt.pause(kid, authority=me, scope="subtree", reason="hold")
            return rt.interrupt(kid, authority=me, kind=op, reason="all", scope="subtree")

        spawned, stopped = _race(spawn, stop)
        assert stopped[0] == "ok", f"{where}: the stop raised {stopped[1]!r}"
        turns = stopped[1]
        if spawned[0] == "err":
            exc = spawned[1]
            assert isinstance(exc, tether.InvalidParams), f"{where}: {exc!r}"
            assert "being stopped" in exc.message or "being paused" in exc.message, exc.message
            refused += 1
        else:
            late = spawned[1]
            first = eventually(partial(rt.turns, late), what=f"{where}: a turn")[0]
            fell = order.where(late, kid)
            assert fell != "inside", f"{where}: {late} was spawned while the {op} walked"
            if fell == "before":
                assert first.id in turns, (
                    f"{where}: {late} was spawned before the {op} marked the subtree and "
                    f"runs on: its turn {first.id} is not among {turns}"
                )
                landed += 1
        if op == "pause":
            rt.resume(kid, authority=me, scope="subtree")
        rt.dispose(kid, authority=me)
    print(f"\n{op}: landed {landed}, refused {refused}, of {_SUBTREE_TRIES}")
    # The race was run: some spawns came during or before the walk.
    assert landed + refused > _SUBTREE_TRIES // 10, (landed, refused)
    refilled(rt)


# ---- the suspected timer races ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_grace_timer_racing_a_natural_end_records_forced_only_when_it_killed(
    rt: tether.Runtime, switchy: None
) -> None:
    """The driver takes the cancel, then ends on its own right about when grace runs out.
    A forced end (``forced=True``) means the worker was killed; a natural one, that it
    was not. A reader thread keeps the store busy, as on a loaded host."""
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    big = spawn_child(rt, root, slug="big")  # a long transcript: reading it holds the store
    rt.send(big, "say a lot", authority=me, data=steps(*[{"op": "say", "text": "x" * 80}] * 400))
    rt.wait(big, until="idle", timeout=30.0)
    stop_load = threading.Event()
    reads = [0]

    def load() -> None:  # a reader that keeps the store busy, without growing it
        while not stop_load.is_set():
            rt.transcript(big)
            reads[0] += 1

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    rng = random.Random(5)
    grace = 0.05
    seen = {"forced": 0, "natural": 0}
    n = 200
    try:
        for i in range(n):
            c = rt.spawn(root, "drivers:GraceRacer")
            rt.send(c, "race the grace", authority=me, data={"linger": rng.uniform(0.03, 0.07)})
            said = wait_entry(rt, c, "assistant", "pid ", timeout=10.0)
            proc = psutil.Process(int(said.text.split()[1]))
            rt.interrupt(c, authority=me, kind="cancel", reason="wrap up", grace=grace)
            _quiet(rt, c, what=f"race {i}")
            [turn] = rt.turns(c)
            where = f"race {i}/{n}: {turn}"
            assert turn.outcome == "cancelled", where
            killed = not alive(proc)
            if turn.forced:
                seen["forced"] += 1
                assert killed, f"{where}: recorded forced=True but its worker was not killed"
            else:
                seen["natural"] += 1
                assert not killed, f"{where}: its worker was killed but forced=False"
                assert "finished on my own" in texts(rt, c, "assistant"), where
            if killed:
                refilled(rt)
    finally:
        stop_load.set()
        loader.join(10.0)
    print(f"grace races: {seen}, {reads[0]} transcript reads beside them")


@pytest.mark.timeout(120)
def test_a_deadline_never_escalates_a_cancel_whose_boundary_came_before_it(
    rt: tether.Runtime, switchy: None
) -> None:
    """The driver reaches its boundary just before the deadline, so the deadline fires
    while the cancel's delivery is on its way to the host: that must not escalate."""
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    rng = random.Random(6)
    deadline = 0.05
    lags: list[float] = [0.002]  # how long a cancel takes to reach the worker
    seen = {"escalated": 0, "cancelled": 0, "inconclusive": 0, "in window": 0}
    n = 150
    for i in range(n):
        c = rt.spawn(root, "drivers:LateBoundary")
        lag = sorted(lags)[len(lags) // 2]
        # aim the boundary into the last ~1.5 ms before the deadline
        delay = max(deadline - lag - rng.uniform(-0.0005, 0.0015), 0.0)
        rt.send(c, "late", authority=me, data={"delay": delay, "chatter": 30})
        wait_entry(rt, c, "assistant", "ready", timeout=10.0)
        issued = time.time()
        rt.interrupt(c, authority=me, kind="cancel", reason="stop", deadline=deadline, grace=5.0)
        _quiet(rt, c, what=f"race {i}")
        [turn] = rt.turns(c)
        where = f"race {i}/{n}: {turn}"
        said = [t for t in texts(rt, c, "assistant") if t.startswith("boundary ")]
        if not said:
            seen["inconclusive"] += 1  # killed before it could say when its boundary was
            assert turn.outcome == "aborted" and turn.escalated, where
            continue
        _, _t0, t1, got, *_ = said[0].split()
        lags.append(float(got) - issued)
        # The deadline fires no earlier than `issued + deadline`: a boundary before that
        # came first, whatever the host had heard of it by then.
        before_deadline = float(t1) < issued + deadline
        seen["in window"] += before_deadline and float(t1) > issued + deadline - 0.002
        if turn.escalated:
            seen["escalated"] += 1
            assert not before_deadline, (
                f"{where}: escalated although the boundary that took the cancel was reached "
                f"{(issued + deadline - float(t1)) * 1000:.2f} ms before the deadline"
            )
        else:
            seen["cancelled"] += 1
            assert turn.outcome == "cancelled", where
    refilled(rt)
    print(f"deadline races: {seen}")


# ---- 12. unencodable text -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cancel", "abort", "steer"])
def test_an_unencodable_reason_is_invalid_params_and_records_nothing(
    rt: tether.Runtime, kind: str
) -> None:
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    c = spawn_child(rt, root)
    rt.send(c, "work", authority=me, data=HANG)
    turn = rt.wait(c, until="running", timeout=10.0).turn
    before = rt.transcript(c)

    raised: BaseException | None = None
    try:
        rt.interrupt(c, authority=me, kind=kind, reason=f"stop {BAD} now")
    except BaseException as exc:
        raised = exc
    # Nothing was recorded: the turn runs on, with no stop and no marker.
    info = rt.status(c)
    assert (info.state, info.turn, info.stopping) == ("running", turn, None), info
    assert rt.transcript(c) == before
    # Nothing half-applied either: a proper stop afterwards works as if none came before.
    rt.interrupt(c, authority=me, kind="cancel", reason="proper")
    _quiet(rt, c)
    [t] = rt.turns(c)
    assert (t.outcome, t.reason) == ("cancelled", "proper"), t
    assert [(m.action, m.reason) for m in entries(rt, c, "marker")] == [("cancelled", "proper")]
    assert isinstance(raised, tether.InvalidParams), f"raised {raised!r}"


def test_unencodable_content_data_or_slug_is_invalid_params_and_records_nothing(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    c = spawn_child(rt, root, slug="kid")
    rt.send(c, "first", authority=me)
    rt.wait(c, until="idle", timeout=10.0)
    # The child's turn-end notice wakes the idle root: let that turn end too, or it
    # writes to the root's transcript between two snapshots.
    eventually(lambda: len(rt.turns(root)) == 1 or None, what="the root's notice turn")
    rt.wait(root, until="idle", timeout=10.0)

    def snapshot() -> Any:
        return (
            [(i.id, i.slug, i.state, i.pending) for i in rt.list_agents(root, scope="descendants")],
            rt.transcript(c),
            rt.transcript(root),
            rt.turns(c),
        )

    cases: dict[str, Callable[[], Any]] = {
        "open_session slug": lambda: rt.open_session(SCRIPTED, slug=BAD),
        "open_session config": lambda: rt.open_session(SCRIPTED, config={"k": BAD}),
        "spawn slug": lambda: rt.spawn(root, SCRIPTED, slug=BAD),
        "spawn prompt": lambda: rt.spawn(root, SCRIPTED, prompt=BAD),
        "spawn data": lambda: rt.spawn(root, SCRIPTED, prompt="p", data={"k": BAD}),
        "spawn config": lambda: rt.spawn(root, SCRIPTED, config={BAD: 1}),
        "send content": lambda: rt.send(c, f"x{BAD}", authority=me),
        "send content, no wake": lambda: rt.send(c, BAD, authority=me, wake=False),
        "send data value": lambda: rt.send(c, "x", authority=me, data={"k": BAD}),
        "send data key": lambda: rt.send(c, "x", authority=me, data={BAD: 1}),
        "prompt content": lambda: rt.prompt(root, BAD),
        "steer an idle session": lambda: rt.interrupt(c, authority=me, kind="steer", reason=BAD),
    }
    failures = []
    for name, call in cases.items():
        before = snapshot()
        try:
            call()
            raised: BaseException | None = None
        except BaseException as exc:
            raised = exc
        if not isinstance(raised, tether.InvalidParams):
            failures.append(f"{name}: raised {raised!r}")
        if snapshot() != before:
            failures.append(f"{name}: recorded something")
    assert not failures, "\n".join(failures)
    # The host carries on.
    rt.send(c, "after", authority=me)
    rt.wait(c, until="idle", timeout=10.0)
    assert texts(rt, c, "user") == ["first", "after"]


# ---- 13. permissions narrow down the tree ---------------------------------------------------


def test_a_session_denied_run_command_cannot_get_a_child_that_runs_commands(
    rt: tether.Runtime, tmp_path: Path
) -> None:
    deny = {"run_command": "deny"}
    marker = tmp_path / "ran"

    # Through the Scripted spawn op (the tool, with the session's own authority).
    boss = rt.open_session(SCRIPTED, slug="boss", permissions=deny)
    kid_script = steps({"op": "tool", "argv": ["touch", str(marker)]}, {"op": "say", "text": "k"})
    rt.prompt(
        boss,
        "delegate",
        data=steps(
            {"op": "spawn", "slug": "kid", "data": kid_script},
            {
                "op": "spawn",
                "slug": "kid2",
                "driver": "drivers:Obedient",
                "data": {"path": str(marker)},
            },
        ),
    )
    rt.wait(boss, until=("idle", "parked"), timeout=10.0)
    kids = rt.list_agents(boss)
    # the Scripted spawn op cannot name a driver: kid2 runs the caller's own (Scripted)
    assert {k.slug for k in kids} == {"kid", "kid2"}, texts(rt, boss, "tool")
    for k in kids:
        _quiet(rt, k.id, what=f"{k.slug}'s turn")
    assert not marker.exists(), "a child of a session denied run_command ran a command"
    kid = next(i.id for i in rt.list_agents(boss) if i.slug == "kid")
    assert any("subagent-unauthorized" in t for t in texts(rt, kid, "tool")), texts(rt, kid, "tool")

    # Through the host API: asking for "allow" under a deny does not widen it.
    boss2 = rt.open_session(SCRIPTED, slug="boss2", permissions=deny)
    widened = spawn_child(rt, boss2, slug="w", permissions={"run_command": "allow"})
    grandkid = spawn_child(rt, widened, slug="g")
    for sid, parent in ((widened, boss2), (grandkid, widened)):
        rt.send(sid, "try", authority=User(parent=parent), data=kid_script)
        _quiet(rt, sid)
        assert not marker.exists(), f"{sid} ran a command under a deny above it"
        assert any("subagent-unauthorized" in t for t in texts(rt, sid, "tool"))


def test_a_spawn_tool_call_cannot_choose_driver_config_or_permissions(
    rt: tether.Runtime, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    boss = rt.open_session("drivers:Escalator", slug="boss", permissions={"run_command": "deny"})
    rt.prompt(boss, "spawn", data={"path": str(marker)})
    rt.wait(boss, until=("idle", "parked"), timeout=10.0)
    kids = rt.list_agents(boss)
    for k in kids:
        _quiet(rt, k.id)
    wrong = []
    if marker.exists():
        wrong.append("the tool call's permissions widened a deny: the child ran a command")
    for k in kids:  # refused outright, or made with the caller's driver and no config
        finals = texts(rt, k.id, "assistant")
        reports = [json.loads(t) for t in finals if t.startswith("{")]
        if not reports:
            wrong.append(f"the child said {finals}")
        for r in reports:
            if r["driver"] != "Escalator":
                wrong.append(f"the tool call chose the driver: {r}")
            if r["config"] != {}:
                wrong.append(f"the tool call chose the config: {r}")
            if not r["command"].startswith("refused"):
                wrong.append(f"the child's command was not refused: {r}")
    assert not wrong, "\n".join(wrong)


# ---- 15. epochs never repeat across host restarts ------------------------------------------------

_FIRST_HOST = """
import json, sys, tether
with tether.Runtime(sys.argv[1], workers=1, grace=1.0) as rt:
    root = rt.open_session("tether:Scripted", slug="root")
    kid = rt.spawn(root, "tether:Scripted", slug="kid")
    ref = rt.agent_ref(root)
    print(json.dumps({"root": root, "kid": kid, "epoch": ref.epoch}), flush=True)
"""

_SECOND_HOST = """
import json, sys, tether
path, root, kid, epoch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
HANG = {"steps": [{"op": "hang"}]}
with tether.Runtime(path, workers=1, grace=1.0) as rt:
    me = tether.User(parent=root)
    stale = tether.Ancestor(tether.AgentRef(root, epoch))
    out = {"fresh_epoch": rt.agent_ref(root).epoch}
    rt.send(kid, "work", authority=me, data=HANG)
    turn = rt.wait(kid, until="running", timeout=10.0).turn
    calls = {
        "interrupt": lambda: rt.interrupt(kid, authority=stale, kind="cancel", reason="stale"),
        "send": lambda: rt.send(kid, "from the past", authority=stale, wake=False),
        "dispose": lambda: rt.dispose(kid, authority=stale),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except tether.TetherError as exc:
            out[name] = exc.code
    info = rt.status(kid)
    out["state"], out["stopping"], out["turn_same"] = info.state, info.stopping, info.turn == turn
    out["markers"] = [e.action for e in rt.transcript(kid) if e.kind == "marker"]
    out["pending"] = info.pending
    print(json.dumps(out), flush=True)
"""


def _run_host(script: str, *args: str, timeout: float = 60.0) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=TESTS,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_an_agent_ref_from_before_a_host_restart_is_stale(db_path: str) -> None:
    first = _run_host(_FIRST_HOST, db_path)
    second = _run_host(_SECOND_HOST, db_path, first["root"], first["kid"], str(first["epoch"]))
    refused = "subagent-unauthorized"
    assert (second["interrupt"], second["send"], second["dispose"]) == (refused,) * 3, (
        f"a ref from the previous host (epoch {first['epoch']}; this host's is "
        f"{second['fresh_epoch']}) was accepted: {second}"
    )
    assert (second["state"], second["stopping"], second["markers"]) == ("running", None, [])
    assert second["turn_same"] and second["pending"] == 0


# ---- 16. a turn crashed at recovery still notifies its parent ------------------------------------

_DYING_HOST = """
import json, sys, threading, time, tether
rt = tether.Runtime(sys.argv[1], workers=1, grace=1.0)
root = rt.open_session("tether:Scripted", slug="root")
kid = rt.spawn(root, "tether:Scripted", slug="kid", prompt="dig",
               data={"steps": [{"op": "say", "text": "partial work"}, {"op": "hang"}]})
turn = rt.wait(kid, until="running", timeout=10.0).turn
deadline = time.monotonic() + 10.0
while not any(e.text == "partial work" for e in rt.transcript(kid)):
    assert time.monotonic() < deadline
    time.sleep(0.01)
print(json.dumps({"root": root, "kid": kid, "turn": turn}), flush=True)
threading.Event().wait(60.0)  # SIGKILLed long before this
sys.exit(1)
"""


def test_a_turn_crashed_at_recovery_still_gives_its_parent_the_notice(db_path: str) -> None:
    with sigkilled_host(
        [sys.executable, "-c", textwrap.dedent(_DYING_HOST), db_path], cwd=TESTS, timeout=30.0
    ) as (ready, _tree):
        pass
    root, kid, turn = ready["root"], ready["kid"], ready["turn"]
    api = ApiGaps()
    with runtime(db_path, workers=1, grace=1.0) as rt:
        [t] = rt.turns(kid)
        assert (t.id, t.outcome, t.cause) == (turn, "crashed", "system")
        # The notice is in the parent's inbox (it does not wake the parked root).
        eventually(lambda: rt.status(root).pending == 1, timeout=5.0, what="the notice")
        inbox = api.inbox(rt, root)
        if inbox is not None:
            assert [m.kind for m in inbox] == ["notice"], inbox
        rt.prompt(root, "carry on")
        _quiet(rt, root)
        rt.wait(root, until="idle", timeout=10.0)
        [notice] = entries(rt, root, "notice")
        assert "crashed" in notice.text and "partial work" in notice.text, notice
        assert notice.data is not None and notice.data["notice"]["child"] == kid
        assert notice.data["notice"]["turn"] == turn
        assert texts(rt, root, "user") == ["carry on"]
    api.check()


_HOST_DYING_IN_RECOVERY = """
import os, signal, sys
from tether.actors import supervisor
# The fault: this host is SIGKILLed once the store has closed the crashed turns and
# before the supervisor takes the catalog; a crash between two commits of recovery
# would leave the turn closed and its parent never told.
supervisor.SupervisorActor._recover = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
import tether
tether.Runtime(sys.argv[1], workers=1, grace=1.0)
sys.exit(1)
"""


def _host_killed_by_its_fault(script: str, db_path: str) -> str:
    """Run a host ``script`` on ``db_path`` that SIGKILLs itself at its fault; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), db_path],
        cwd=TESTS,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    return done.stdout


def test_a_host_killed_during_recovery_loses_no_crashed_turns_notice(db_path: str) -> None:
    with sigkilled_host(
        [sys.executable, "-c", textwrap.dedent(_DYING_HOST), db_path], cwd=TESTS, timeout=30.0
    ) as (ready, _tree):
        pass
    root, kid, turn = ready["root"], ready["kid"], ready["turn"]
    _host_killed_by_its_fault(_HOST_DYING_IN_RECOVERY, db_path)
    with runtime(db_path, workers=1, grace=1.0) as rt:
        [t] = rt.turns(kid)
        assert (t.id, t.outcome) == (turn, "crashed")
        eventually(lambda: rt.status(root).pending == 1, timeout=5.0, what="the notice")
        rt.prompt(root, "carry on")
        _quiet(rt, root)
        rt.wait(root, until="idle", timeout=10.0)
        [notice] = entries(rt, root, "notice")
        assert notice.data is not None and notice.data["notice"]["turn"] == turn
        assert "partial work" in notice.text, notice


_HOST_DYING_IN_A_DISPOSAL = """
import json, os, signal, sys, time, tether
from tether.runtime.store import Store
from tether import User
at = sys.argv[2]  # "first": the host dies at the disposal's first settle; "p": at p's
rt = tether.Runtime(sys.argv[1], workers=2, grace=1.0)
root = rt.open_session("tether:Scripted", slug="root")
# p's turn takes no stop until its grace runs out (a model call that hangs), so its
# disposal settles it only after k's turn, which stops at once, has ended
p = rt.spawn(root, "tether:Scripted", slug="p", prompt="work",
             data={"steps": [{"op": "sleep", "seconds": 60, "say": "in the call"}]})
k = rt.spawn(p, "tether:Scripted", slug="k", prompt="dig", data={"steps": [{"op": "hang"}]})
deadline = time.monotonic() + 10.0
while not (rt.status(k).dispatched and any(e.text == "in the call" for e in rt.transcript(p))):
    assert time.monotonic() < deadline  # k on its worker, p inside its hung call
    time.sleep(0.01)
rt.send(p, "queued", authority=User(parent=root))  # waits in p's inbox behind its turn
turn = rt.status(p).turn
settle = Store.settle
def accepted():  # the disposal's mark is committed: read from a connection of our own
    import sqlite3
    db = sqlite3.connect(sys.argv[1])
    try:
        return db.execute("SELECT disposing FROM sessions WHERE id=?", (p,)).fetchone()[0] == 1
    finally:
        db.close()
def dying(self, session):  # the fault: the host dies as the disposal settles a session
    if at == "first" or session == p:
        # once the disposal is accepted (its mark durable, queued before any settle):
        # a host killed before the mark's commit never accepted it, another case
        deadline = time.monotonic() + 10.0
        while not accepted():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)
    return settle(self, session)
Store.settle = dying
print(json.dumps({"root": root, "p": p, "k": k, "turn": turn}), flush=True)
rt.dispose(p, authority=User(parent=root))
sys.exit(1)
"""


def _killed_in_a_disposal(db_path: str, at: str) -> dict[str, str]:
    script = textwrap.dedent(_HOST_DYING_IN_A_DISPOSAL)
    done = subprocess.run(
        [sys.executable, "-c", script, db_path, at],
        cwd=TESTS,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    ready: dict[str, str] = json.loads(done.stdout.splitlines()[0])
    return ready


def _message_states(db_path: str, session: str) -> list[tuple[str, str]]:
    """(kind, state) of every message ever in ``session``'s inbox, from the store itself."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db_path)) as db:
        rows = db.execute(
            "SELECT kind, state FROM messages WHERE session=? ORDER BY id", (session,)
        ).fetchall()
    return [(str(k), str(s)) for k, s in rows]


def test_a_disposal_cut_short_by_a_host_kill_is_finished_by_the_next_host(
    db_path: str,
) -> None:
    """An accepted disposal is durable (the subtree's mark, in one commit): a host
    killed before any of its settles leaves the next host to finish it, as the
    disposal would have: p and its child k settled, p's queued message closed with its
    inbox, p's open turn closed (crashed: its host stopped) and p's parent told of it.
    Before, both came back unsettled, p parked with its message pending, as if never
    disposed."""
    ready = _killed_in_a_disposal(db_path, "first")
    root, p, k = ready["root"], ready["p"], ready["k"]
    with runtime(db_path, workers=1, grace=1.0) as rt:
        assert rt.status(p).state == "settled" and rt.status(k).state == "settled"
        assert rt.status(p).pending == 0 and rt.inbox(p) == [] and rt.inbox(k) == []
        [t] = rt.turns(p)
        assert (t.id, t.outcome, t.cause) == (ready["turn"], "crashed", "system")
        assert all(t.outcome is not None for t in rt.turns(k))
        assert [s.id for s in rt.list_agents(root)] == [p]
        assert rt.status(root).state != "settled"
        eventually(lambda: rt.status(root).pending == 1, timeout=5.0, what="root's notice")
        [msg] = rt.inbox(root)
        assert msg.kind == "notice" and msg.sender == p, msg
        with pytest.raises(tether.InvalidParams):  # a settled session takes nothing
            rt.send(p, "again", authority=User(parent=root))
    # the turn's own message stays claimed by it; the queued one is closed, and so is the
    # notice of k's stopped turn when it was committed before the kill
    states = _message_states(db_path, p)
    assert states[:2] == [("user", "claimed"), ("user", "closed")], states
    assert states[2:] in ([], [("notice", "closed")]), states


def test_a_disposal_cut_by_a_host_kill_at_its_last_settle_closes_the_childs_notice(
    db_path: str,
) -> None:
    """A disposal marks the subtree disposing, ends the child's turn, and settles the
    parent last; a host killed just before that settle: the next host settles the
    parent, and the notice of its child's turn end, committed into its inbox with that
    end, is closed with the inbox (as the settle would have), never lost pending."""
    ready = _killed_in_a_disposal(db_path, "p")
    p, k = ready["p"], ready["k"]
    with runtime(db_path, workers=1, grace=1.0) as rt:
        [t] = rt.turns(k)
        assert (t.outcome, t.cause) != ("crashed", "system"), "k's turn was open at the kill"
        assert rt.status(p).state == "settled" and rt.status(k).state == "settled"
        assert rt.inbox(p) == []
    states = _message_states(db_path, p)
    assert states[1:] == [("user", "closed"), ("notice", "closed")], states


# ---- 17. a child's end after its parent settled --------------------------------------------------


@pytest.mark.timeout(120)
def test_a_childs_turn_ending_during_its_parents_disposal_never_raises_or_strands_a_notice(
    rt: tether.Runtime, switchy: None
) -> None:
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    api = ApiGaps()
    rng = random.Random(17)
    bad_events: list[MutableMapping[str, Any]] = []
    for i in range(120):
        where = f"race {i}/120"
        busy_parent = rng.random() < 0.5
        busy: dict[str, Any] = {"prompt": "p", "data": HANG} if busy_parent else {}
        p = spawn_child(rt, root, slug=f"p{i}", **busy)
        k = spawn_child(rt, p, slug="k", prompt="k", data=HANG)
        rt.wait(k, until="running", timeout=10.0)
        if busy_parent:
            rt.wait(p, until="running", timeout=10.0)
        with structlog.testing.capture_logs() as logs:
            rt.dispose(p, authority=me)
            rt.list_agents(root)  # handled after every notice told before it
        bad = [e for e in logs if e.get("log_level") in ("error", "critical", "exception")]
        bad_events += bad
        assert not bad, f"{where}: the runtime logged an error: {bad[:3]}"
        assert rt.status(p).state == "settled" and rt.status(k).state == "settled", where
        assert rt.status(p).pending == 0, where
        inbox = api.inbox(rt, p)
        if inbox is not None:
            assert inbox == [], f"{where}: a notice pending in a closed inbox: {inbox}"
    api.check()


# ---- no OS thread per session -----------------------------------------------------------------


@pytest.mark.timeout(600)
def test_fifty_thousand_idle_sessions_need_no_thread_each() -> None:
    me = psutil.Process()
    limit = 64
    with runtime(workers=1, grace=1.0) as rt:
        roots = [rt.open_session(SCRIPTED, slug=f"root{r}") for r in range(5)]
        made = 0
        for n in range(50_000):
            spawn_child(rt, roots[n % 5])
            made += 1
            if n % 500 == 0:
                threads = (threading.active_count(), me.num_threads())
                assert max(threads) < limit, (
                    f"{threads} threads (Python, OS) with {made} sessions live"
                )
        threads = (threading.active_count(), me.num_threads())
        assert max(threads) < limit, f"{threads} threads with {made} sessions"
        kids = rt.list_agents(roots[0])
        assert len(kids) == 10_000 and all(k.state == "idle" for k in kids[::997])
        # They are live sessions: one takes a turn at once.
        rt.send(kids[0].id, "hello", authority=User(parent=roots[0]))
        rt.wait(kids[0].id, until="idle", timeout=10.0)
        assert texts(rt, kids[0].id, "assistant") == ["ok: hello"]


def test_data_with_integers_past_64_bits_is_invalid_params(rt: tether.Runtime) -> None:
    """Found by the RPC fuzzer: msgpack cannot hold them, and the Python API must say so
    as InvalidParams before anything is recorded, as RPC does."""
    root = rt.open_session(SCRIPTED)
    for value in (2**64, -(2**63) - 1):
        with pytest.raises(tether.InvalidParams):
            rt.prompt(root, "x", data={"n": value})
        with pytest.raises(tether.InvalidParams):
            rt.spawn(root, SCRIPTED, config={"n": value})
    assert rt.inbox(root) == [] and rt.list_agents(root) == []


def test_steers_sent_before_dispatch_are_in_force_at_the_first_boundary(
    rt: tether.Runtime,
) -> None:
    """A steer (and then a cancel) issued while the turn waits for a worker must be there
    at the driver's very first boundary: sent after RunTurn, they could reach the worker
    only once the driver had passed it."""
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    blockers = [spawn_child(rt, root, slug=f"b{i}") for i in range(2)]
    for b in blockers:
        rt.send(b, "hold", authority=me, data=steps({"op": "hang"}))
        rt.wait(b, until="running", timeout=10.0)
    for i in range(20):
        c = spawn_child(rt, root, slug=f"late{i}")
        rt.send(c, "go", authority=me, data=steps({"op": "say", "text": "first step"}))
        assert rt.status(c).dispatched is False
        turn = rt.interrupt(c, authority=me, kind="steer", reason=f"before dispatch {i}")
        assert turn is not None
        # free a worker: a blocker's turn is aborted and it hangs again behind the others
        b = blockers[i % 2]
        rt.interrupt(b, authority=me, kind="abort")
        rt.wait(c, until="idle", timeout=10.0)
        said = texts(rt, c, "assistant")
        assert said[0].startswith("<steer") and f"before dispatch {i}" in said[0], said
        rt.wait(b, until="parked", timeout=10.0)
        rt.send(b, "hold", authority=me, data=steps({"op": "hang"}))
        rt.wait(b, until="running", timeout=10.0)

        def dispatched(b: str = b) -> bool:
            return rt.status(b).dispatched

        eventually(dispatched, what="the blocker back on a worker")
    for b in blockers:
        rt.interrupt(b, authority=me, kind="abort")
        rt.wait(b, timeout=10.0)
