"""The Tether measurements. Each case drives a real `tether.Runtime` through its public API.

Times are `perf_counter_ns()` readings: in the host for what the host sees (an interrupt
issued, an event received), in the worker for what only the worker sees (a flag observed,
a turn begun); both are CLOCK_MONOTONIC on Linux. Event times are taken in our subscriber
callback, i.e. when the runtime emits the event, after the record it describes is written.
"""

from __future__ import annotations

import functools
import gc
import math
import random
import resource
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

import tether
from benchmarks import _procs, drivers
from benchmarks._case import Cfg, Samples, Skip, ms_since, poll_until, us_since

SCRIPTED = "tether:Scripted"
STAMPED = "benchmarks.drivers:Stamped"
PROBE = "benchmarks.drivers:CancelProbe"
HANG = {"steps": [{"op": "hang"}]}  # a turn that runs, boundary every 10 ms, until stopped
WAIT = 15.0  # deadline for any single thing a case waits on


def wedge(tag: str) -> dict[str, Any]:
    return {"steps": [{"op": "tool", "argv": _procs.wedge_argv(tag)}]}


class Events:
    """Runtime events of the given names, each with the time our callback received it."""

    def __init__(
        self, rt: tether.Runtime, names: set[str], sessions: set[str] | None = None
    ) -> None:
        self._names = frozenset(names)
        self._sessions = None if sessions is None else frozenset(sessions)
        self._cond = threading.Condition()
        self._seen: list[tuple[int, tether.Event]] = []
        rt.subscribe(self._on)  # for the runtime's life: each case closes its runtime

    def _on(self, ev: tether.Event) -> None:
        # Cheap filters first: this runs on the runtime's threads.
        if ev.name in self._names and (self._sessions is None or ev.session in self._sessions):
            now = time.perf_counter_ns()
            with self._cond:
                self._seen.append((now, ev))
                self._cond.notify_all()

    def mark(self) -> int:
        """A position: `wait` looks only at events after it."""
        with self._cond:
            return len(self._seen)

    def wait(
        self, since: int, pred: Callable[[tether.Event], bool], timeout: float = WAIT
    ) -> tuple[int, tether.Event]:
        deadline = time.monotonic() + timeout
        with self._cond:
            i = since
            while True:
                for ns, ev in self._seen[i:]:
                    if pred(ev):
                        return ns, ev
                i = len(self._seen)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching event within {timeout:g}s")
                self._cond.wait(left)


def _on(session: str, name: str) -> Callable[[tether.Event], bool]:
    return lambda ev: ev.session == session and ev.name == name


def _pool_steady(rt: tether.Runtime, workers: int) -> None:
    """After a kill, wait until the pool is back to `workers` plus its warm spare, so that
    every sample starts from the steady state the targets are stated for."""
    poll_until(
        lambda: True if len(rt.worker_pids) >= workers + 1 else None,
        WAIT,
        "the pool to replace a killed worker",
    )
    time.sleep(0.15)  # a counted worker may still be starting (launcher fork + Ready)


def _said(rt: tether.Runtime, sid: str, prefix: str, after: int) -> int | None:
    """The integer a driver said after `prefix` in an entry past seq `after`, if any."""
    for e in rt.transcript(sid, after=after):
        if e.kind == "assistant" and e.text.startswith(prefix):
            return int(e.text.removeprefix(prefix))
    return None


def _said_text(rt: tether.Runtime, sid: str, text: str, after: int) -> bool | None:
    """True once an entry past seq `after` says exactly `text` (None until then)."""
    return any(e.text == text for e in rt.transcript(sid, after=after)) or None


def _last_seq(rt: tether.Runtime, sid: str) -> int:
    entries = rt.transcript(sid)
    return entries[-1].seq if entries else 0


def _quiet_parent(rt: tether.Runtime) -> tuple[str, tether.User]:
    """A parked parent for the sessions a case measures, and the authority over them.

    Every turn end sends the parent a ChildTurnEnded notice, which wakes an idle parent
    into a turn of its own: that turn would share the workers and the host with the next
    sample (in `respawn`, it would even take the freed worker first). A parked parent is
    never woken by notices (semantics §5), so the parent here is parked once, by a cancel.
    """
    root = rt.open_session(SCRIPTED)
    parent = str(rt.spawn(root, SCRIPTED))
    auth = tether.User(parent=root)
    rt.send(parent, "hang", data=HANG, authority=auth)
    rt.wait(parent, until="running", timeout=WAIT)
    rt.interrupt(parent, authority=auth, kind="cancel", reason="park")
    rt.wait(parent, until="parked", timeout=WAIT)
    # The root's one notice turn (for that cancel) ends before any sample starts.
    poll_until(
        lambda: True if [t for t in rt.turns(root) if t.outcome] else None,
        WAIT,
        "the root's notice turn",
    )
    rt.wait(root, timeout=WAIT)
    return parent, tether.User(parent=parent)


def _quiet_child(rt: tether.Runtime, driver: str) -> tuple[str, tether.User]:
    parent, auth = _quiet_parent(rt)
    return str(rt.spawn(parent, driver)), auth


# ---------------------------------------------------------------- abort


def abort(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="abort")` on a turn wedged in the tree → worker, sh and both sleeps
    dead (pidfds) and the turn ended `aborted` (event); the later of the two. The walk
    (containment="walk"); `abort_cgroup` is the same under cgroup containment."""
    with tether.Runtime(workers=2, containment="walk") as rt:
        child, auth = _quiet_child(rt, SCRIPTED)
        events = Events(rt, {"turn.ended"})
        _pool_steady(rt, 2)
        while True:
            samples = []
            for _ in range(cfg.n(20, 60)):
                tag = _procs.wedge_tag()
                rt.send(child, "wedge", data=wedge(tag), authority=auth)
                tree = _procs.find_tree(tag, WAIT)
                mark = events.mark()
                with _procs.DeathWatch(tree.pids(with_starter=True)) as watch:
                    t0 = time.perf_counter_ns()
                    rt.interrupt(child, authority=auth, kind="abort", reason="bench")
                    dead = watch.wait(WAIT)
                    ended, ev = events.wait(mark, _on(child, "turn.ended"))
                if ev.data["outcome"] != "aborted" or rt.turns(child)[-1].outcome != "aborted":
                    raise RuntimeError(f"the wedged turn ended {ev.data['outcome']}, not aborted")
                samples.append(ms_since(t0, max(dead, ended)))
                _pool_steady(rt, 2)
            yield {"abort_ms": samples}


# ---------------------------------------------------------------- abort under load


class _Load:
    """A sender thread keeping one trivial turn outstanding per load session: it prompts
    the sessions round-robin, each prompt taking a slot that the turn's end gives back
    (`window` slots in all), so the host never runs out of turns to claim, record and
    dispatch, and no inbox grows without bound."""

    def __init__(self, rt: tether.Runtime, roots: list[str]) -> None:
        self._rt, self._roots, self._members = rt, roots, frozenset(roots)
        self._slots = threading.Semaphore(len(roots))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ended = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)
        rt.subscribe(self._on)

    def _on(self, ev: tether.Event) -> None:
        if ev.name == "turn.ended" and ev.session in self._members:
            with self._lock:
                self._ended += 1
            self._slots.release()

    def _run(self) -> None:
        i = 0
        try:
            while not self._stop.is_set():
                if self._slots.acquire(timeout=0.1):
                    self._rt.prompt(self._roots[i % len(self._roots)], "x")
                    i += 1
        except BaseException as e:  # reported by `ended`, which every repetition calls
            self.error = e

    @property
    def ended(self) -> int:
        """Load turns ended so far; raises if the sender thread failed."""
        if self.error is not None:
            raise RuntimeError(f"the load sender failed: {self.error!r}") from self.error
        with self._lock:
            return self._ended

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)


def abort_loaded(cfg: Cfg) -> Iterator[Samples]:
    """`abort_ms` of `abort`, with the host saturated: 1,000 root sessions kept busy with
    trivial turns by a sender thread (`_Load`), on a file store, 2 workers. The wedged turn
    holds one worker, the load takes the other and every host thread. Measured from the
    abort call to the later of: worker, sh and both sleeps dead, and the turn's `aborted`
    end event. The load's own turn rate while sampling goes to the notes."""
    with (
        tempfile.TemporaryDirectory(prefix="bench-abort-loaded-") as d,
        tether.Runtime(Path(d) / "tether.db", workers=2) as rt,
    ):
        child, auth = _quiet_child(rt, SCRIPTED)
        events = Events(rt, {"turn.ended"}, sessions={child})
        roots = [rt.open_session(SCRIPTED) for _ in range(cfg.sessions(1000))]
        _pool_steady(rt, 2)
        with _Load(rt, roots) as load:
            time.sleep(0.5)  # the backlog builds up to its window
            while True:
                samples = []
                ended0, t_start = load.ended, time.perf_counter()
                for _ in range(cfg.n(20, 60)):
                    tag = _procs.wedge_tag()
                    rt.send(child, "wedge", data=wedge(tag), authority=auth)
                    tree = _procs.find_tree(tag, WAIT)  # queued behind the load's backlog
                    mark = events.mark()
                    with _procs.DeathWatch(tree.pids(with_starter=True)) as watch:
                        t0 = time.perf_counter_ns()
                        rt.interrupt(child, authority=auth, kind="abort", reason="bench")
                        dead = watch.wait(WAIT)
                        ended, ev = events.wait(mark, _on(child, "turn.ended"))
                    if ev.data["outcome"] != "aborted":
                        raise RuntimeError(
                            f"the wedged turn ended {ev.data['outcome']}, not aborted"
                        )
                    samples.append(ms_since(t0, max(dead, ended)))
                    _pool_steady(rt, 2)
                rate = (load.ended - ended0) / (time.perf_counter() - t_start)
                cfg.note(
                    f"load while sampling: {rate:,.0f} trivial turns/s ended over "
                    f"{len(roots):,} sessions (last repetition)",
                    key="load",
                )
                yield {"abort_ms": samples}


# ---------------------------------------------------------------- respawn


def respawn(cfg: Cfg) -> Iterator[Samples]:
    """Both workers busy (a hanging turn, a wedged one) and a third turn waiting for a
    worker; abort the wedged one → the waiting turn starts on the warm spare. Measured
    from the abort call to the stamp the waiting turn's driver takes as it starts."""
    with tether.Runtime(workers=2) as rt:
        parent, auth = _quiet_parent(rt)

        def start(data: dict[str, Any]) -> str:
            sid = str(rt.spawn(parent, STAMPED))
            rt.send(sid, "turn", data=data, authority=auth)
            return sid

        _pool_steady(rt, 2)
        start(HANG)
        tag = _procs.wedge_tag()
        current = start(wedge(tag))
        while True:
            samples = []
            for _ in range(cfg.n(15, 40)):
                _procs.find_tree(tag, WAIT)  # the current turn is inside its tool
                _pool_steady(rt, 2)
                next_tag = _procs.wedge_tag()
                waiting = start(wedge(next_tag))
                time.sleep(0.03)
                if _said(rt, waiting, drivers.STARTED, 0) is not None:
                    raise RuntimeError(
                        "a third turn started with two busy: the pool has more "
                        "than 2 runnable workers; this case needs them all busy"
                    )
                t0 = time.perf_counter_ns()
                rt.interrupt(current, authority=auth, kind="abort", reason="bench")
                # Wait for the new tree, not the stamp: polling the transcript while the
                # runtime is respawning would load the host we are timing.
                _procs.find_tree(next_tag, WAIT)
                # The stamp was said before the tool started, but the host may not have
                # written it yet: the tree can be up before the Say frame is handled.
                started = poll_until(
                    functools.partial(_said, rt, waiting, drivers.STARTED, 0),
                    WAIT,
                    "the start stamp",
                )
                samples.append(ms_since(t0, started))
                current, tag = waiting, next_tag
            yield {"respawn_ms": samples}


# ---------------------------------------------------------------- cancel signal


def cancel_signal(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="cancel")` in the host → `ctx.cancel_requested` seen in the worker."""
    with tether.Runtime(workers=2) as rt:
        child, auth = _quiet_child(rt, PROBE)
        events = Events(rt, {"turn.ended"})
        _pool_steady(rt, 2)
        while True:
            samples = []
            for _ in range(cfg.n(100, 300)):
                after = _last_seq(rt, child)
                mark = events.mark()
                rt.send(child, "probe", authority=auth)
                poll_until(
                    functools.partial(_said_text, rt, child, drivers.POLLING, after),
                    WAIT,
                    "the probe to start polling",
                )
                time.sleep(0.002)  # past the say: the probe is in its poll loop
                t0 = time.perf_counter_ns()
                rt.interrupt(child, authority=auth, kind="cancel", reason="bench")
                events.wait(mark, _on(child, "turn.ended"))
                seen = _said(rt, child, drivers.SEEN, after)
                if seen is None:
                    raise RuntimeError("the probe ended without seeing the cancel")
                samples.append(us_since(t0, seen))
            yield {"signal_us": samples}


# ---------------------------------------------------------------- boundary stop


def boundary_stop(cfg: Cfg) -> Iterator[Samples]:
    """cancel → turn recorded `cancelled`, the driver reaching a boundary every 1 ms."""
    work = {"steps": [{"op": "work", "steps": 100_000, "every": 0.001}]}
    rng = random.Random(5)
    with tether.Runtime(workers=2) as rt:
        child, auth = _quiet_child(rt, SCRIPTED)
        events = Events(rt, {"turn.started", "turn.ended"})
        _pool_steady(rt, 2)
        while True:
            samples = []
            for _ in range(cfg.n(40, 120)):
                mark = events.mark()
                rt.send(child, "work", data=work, authority=auth)
                events.wait(mark, _on(child, "turn.started"))
                time.sleep(rng.uniform(0.01, 0.02))  # mid-turn, at a random phase of a step
                mark = events.mark()
                t0 = time.perf_counter_ns()
                rt.interrupt(child, authority=auth, kind="cancel", reason="bench")
                ended, ev = events.wait(mark, _on(child, "turn.ended"))
                if ev.data["outcome"] != "cancelled":
                    raise RuntimeError(f"the turn ended {ev.data['outcome']}, not cancelled")
                samples.append(ms_since(t0, ended))
            yield {"stop_ms": samples}


# ---------------------------------------------------------------- turn throughput


class _Countdown:
    """Counts `turn.ended` events (a subscriber callback); `wait` until `arm`'s goal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._count = self._goal = 0

    def arm(self, goal: int) -> None:
        with self._lock:
            self._count, self._goal = 0, goal
            self._done.clear()

    def on_event(self, ev: tether.Event) -> None:
        if ev.name == "turn.ended":
            with self._lock:
                self._count += 1
                if self._count >= self._goal:
                    self._done.set()

    def wait(self, timeout: float) -> int:
        """How many ended, once all did or `timeout` passed."""
        self._done.wait(timeout)
        with self._lock:
            return self._count


def _alternated(base: Callable[[], float], other: Callable[[], float], rounds: int) -> list[float]:
    """``other``'s figure over ``base``'s, one ratio per round of batches in the order
    base, other, other, base: a drift in the machine's load (other processes on these 2
    cores) hits both sides alike, which one base-then-other pair per sample did not."""
    ratios = []
    for _ in range(rounds):
        b = base()
        o = other() + other()
        b += base()
        ratios.append(o / b)
    return ratios


def turns(cfg: Cfg) -> Iterator[Samples]:
    """Trivial turns on a file store, 2 workers, 8 root sessions prompted round-robin
    (each session runs its queue one turn at a time; 8 keep both workers fed). Timed
    from the first prompt to the last `turn.ended`, so enqueueing is included.

    Over the same span, the host's CPU time per turn: `time.process_time()`, i.e. user +
    sys of every thread of this process (the runtime's, and the caller's prompts, which
    run in the host too) and of no child, so the workers' CPU is not counted.
    """
    n, sessions = cfg.n(2000, 10000), 8
    with (
        tempfile.TemporaryDirectory(prefix="bench-turns-") as d,
        tether.Runtime(Path(d) / "tether.db", workers=2) as rt,
    ):
        roots = [rt.open_session(SCRIPTED) for _ in range(sessions)]
        ended = _Countdown()
        rt.subscribe(ended.on_event)

        def batch(size: int) -> Samples:
            ended.arm(size)
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(size):
                rt.prompt(roots[i % sessions], "x")
            got = ended.wait(60)
            t1, c1 = time.perf_counter(), time.process_time()
            if got < size:
                cfg.note(f"only {got} of {size} turns ended within 60 s")
            for root in roots:  # drain, so a short batch does not spill into the next
                rt.wait(root, timeout=WAIT)
            return {
                "turns_per_s": [got / (t1 - t0)],
                "host_cpu_us": [(c1 - c0) / max(got, 1) * 1e6],
            }

        _pool_steady(rt, 2)
        batch(200)  # warm-up: the first turns load the driver and grow the store
        while True:
            yield batch(n)


# ---------------------------------------------------------------- send throughput


def sends(cfg: Cfg) -> Iterator[Samples]:
    """Accepted durable sends (file store, `wake=False`) from one caller, round-robin over
    the inboxes of 100 children; each returns only once its message is committed."""
    n, inboxes = cfg.n(5000, 20000), 100
    with (
        tempfile.TemporaryDirectory(prefix="bench-sends-") as d,
        tether.Runtime(Path(d) / "tether.db", workers=2) as rt,
    ):
        root = rt.open_session(SCRIPTED)
        auth = tether.User(parent=root)
        kids = [str(rt.spawn(root, SCRIPTED)) for _ in range(inboxes)]
        for i in range(200):
            rt.send(kids[i % inboxes], "warm", authority=auth, wake=False)
        callers = 8

        def caller(k: int) -> None:
            for i in range(k, n, callers):
                rt.send(kids[i % inboxes], "x", authority=auth, wake=False)

        while True:
            t0 = time.perf_counter()
            for i in range(n):
                rt.send(kids[i % inboxes], "x", authority=auth, wake=False)
            one = n / (time.perf_counter() - t0)
            # The same sends from 8 threads at once: group commit lets them share commits.
            threads = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            yield {"sends_per_s": [one], "sends_8_per_s": [n / (time.perf_counter() - t0)]}


# ---------------------------------------------------------------- many live sessions


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _tree_shape(live: int) -> list[int]:
    """Grandchildren per child for `live` sessions in all: a root, isqrt(live) - 1
    children, the rest spread evenly below them (live = s*s gives s-1 children of s)."""
    kids = math.isqrt(live) - 1
    leaves = live - 1 - kids
    return [leaves // kids + (i < leaves % kids) for i in range(kids)]


@dataclass
class _Tree:
    """A wide tree of live idle continuable sessions, as `_grow_tree` spawned it."""

    root: str
    kids: list[str]
    leaves: list[str]  # in the order of their parents in `kids`
    timed: int  # sessions spawned inside the timing
    spawn_per_s: float
    kib: float  # host RSS growth per timed session

    @property
    def live(self) -> int:
        return 1 + len(self.kids) + len(self.leaves)


def _grow_tree(rt: tether.Runtime, live: int, budget_s: float) -> _Tree:
    """Spawn `live` sessions as a root → children → grandchildren tree (`_tree_shape`).

    Timed from the first timed spawn to the last spawn's return; memory is the host's RSS
    (after a gc) just before the first timed spawn and 0.2 s after the last, so it also
    counts the caller's list of the new ids (about 0.1 KiB a session). The first
    child and grandchild warm the spawn paths (driver probe, first allocations) outside
    both; they count among the `live` sessions. Raises once spawning overruns `budget_s`
    (a core that cannot reach the count at all fails fast instead of at the deadline).
    """
    shape = _tree_shape(live)
    root = rt.open_session(SCRIPTED)
    kids = [str(rt.spawn(root, SCRIPTED))]
    leaves = [str(rt.spawn(kids[0], SCRIPTED))]
    before = _rss()
    t0 = time.perf_counter()
    kids += [str(rt.spawn(root, SCRIPTED)) for _ in range(len(shape) - 1)]
    for i, (kid, count) in enumerate(zip(kids, shape, strict=True)):
        leaves += [str(rt.spawn(kid, SCRIPTED)) for _ in range(count - (i == 0))]
        if time.perf_counter() - t0 > budget_s:
            done = 1 + len(kids) + len(leaves)
            raise RuntimeError(
                f"spawned only {done:,} of {live:,} sessions within "
                f"{budget_s:g} s ({done / budget_s:,.0f}/s)"
            )
    spawn_s = time.perf_counter() - t0
    timed = len(kids) + len(leaves) - 2
    time.sleep(0.2)  # let the new sessions settle (a v1 actor's thread into its inbox wait)
    kib = (_rss() - before) / timed / 1024
    return _Tree(root, kids, leaves, timed, timed / spawn_s, kib)


def _list_ms(rt: tether.Runtime, tree: _Tree, lists: int) -> list[float]:
    """`list_agents(root, scope="descendants")`, call to return, each listing checked
    complete (every session but the root)."""
    times = []
    for _ in range(lists):
        t0 = time.perf_counter()
        got = rt.list_agents(tree.root, scope="descendants")
        times.append((time.perf_counter() - t0) * 1e3)
        if len(got) != tree.live - 1:
            raise RuntimeError(f"list_agents returned {len(got):,} of {tree.live - 1:,} sessions")
        del got
    return times


def _interrupt_calls(rt: tether.Runtime, tree: _Tree, calls: int) -> list[float]:
    """The synchronous part of interrupt: call to return, for a steer to the last
    grandchild while its turn is wedged in a tool; the turn is aborted afterwards, so
    every session is idle again.

    A steer to a wedged turn makes every call authorize and issue a real frame to a
    running turn (a repeated cancel would be a no-op after the first), and no boundary
    delivers the steers meanwhile, so no transcript writes compete with the calls. The
    calls are 1 ms apart, as interrupts come in use, so each one finds the session's
    actor idle rather than a backlog.
    """
    target, auth = tree.leaves[-1], tether.User(parent=tree.kids[-1])
    tag = _procs.wedge_tag()
    rt.send(target, "wedge", data=wedge(tag), authority=auth)
    _procs.find_tree(tag, WAIT)
    call_us = []
    for i in range(calls):
        time.sleep(0.001)
        t0 = time.perf_counter_ns()
        rt.interrupt(target, authority=auth, kind="steer", reason=f"s{i}")
        call_us.append(us_since(t0, time.perf_counter_ns()))
    rt.interrupt(target, authority=auth, kind="abort", reason="bench done")
    rt.wait(target, timeout=WAIT)
    return call_us


def _session_tree(
    cfg: Cfg, live: int, lists: int, calls: int, budget_s: float = 600
) -> Iterator[Samples]:
    """`live` continuable sessions on a file store (`_grow_tree`), all idle: spawning
    them, their memory, listing them (`_list_ms`), the synchronous part of interrupt on
    one of them (`_interrupt_calls`), and `close()` with all of them live and idle (call
    to return; the store's temp dir is removed after).

    Every session count uses a file store, as a durable host does, so the interrupt
    figures compare like with like and memory does not count an in-memory database.
    """
    while True:
        with tempfile.TemporaryDirectory(prefix="bench-tree-") as d:
            rt = tether.Runtime(Path(d) / "tether.db", workers=2)
            try:
                tree = _grow_tree(rt, live, budget_s)
                list_ms = _list_ms(rt, tree, lists)
                call_us = _interrupt_calls(rt, tree, calls)
                t0 = time.perf_counter()
                rt.close()
                close_s = time.perf_counter() - t0
            finally:
                rt.close()  # a no-op after the timed close
        yield {
            "spawn_per_s": [tree.spawn_per_s],
            "idle_session_kib": [tree.kib],
            "list_ms": list_ms,
            "interrupt_call_us": call_us,
            "close_s": [close_s],
        }


def sessions_100(cfg: Cfg) -> Iterator[Samples]:
    return _session_tree(cfg, 100, cfg.n(50, 200), cfg.n(500, 2000))


def sessions_10k(cfg: Cfg) -> Iterator[Samples]:
    return _session_tree(cfg, cfg.sessions(10_000), cfg.n(10, 30), cfg.n(500, 2000))


def sessions_100k(cfg: Cfg) -> Iterator[Samples]:
    return _session_tree(
        cfg, cfg.sessions(100_000), cfg.n(5, 20), cfg.n(500, 2000), budget_s=cfg.n(120, 900)
    )


def sessions_1m(cfg: Cfg) -> Iterator[Samples]:
    """1,000,000 live idle continuable sessions in one host (`_grow_tree`, file store):
    the host process's whole RSS (after a gc) once all are spawned and one descendants
    listing has returned complete and been dropped; the listing's time; the synchronous
    part of interrupt on one of them (`_interrupt_calls`, next to the 100-session run's).
    Spawn rate, peak RSS and `close()` time go to the notes."""
    live = cfg.sessions(1_000_000)
    while True:
        with tempfile.TemporaryDirectory(prefix="bench-1m-") as d:
            rt = tether.Runtime(Path(d) / "tether.db", workers=2)
            try:
                tree = _grow_tree(rt, live, budget_s=1200)
                (list_ms,) = _list_ms(rt, tree, 1)
                rss_gib = _rss() / 2**30
                call_us = _interrupt_calls(rt, tree, cfg.n(500, 2000))
                t0 = time.perf_counter()
                rt.close()
                close_s = time.perf_counter() - t0
            finally:
                rt.close()
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        cfg.note(
            f"{tree.live:,} sessions: spawned at {tree.spawn_per_s:,.0f}/s, listed in "
            f"{list_ms:,.0f} ms, closed in {close_s:.1f} s; peak RSS {peak_gib:.2f} GiB",
            key="1m",
        )
        yield {"rss_gib": [rss_gib], "list_ms": [list_ms], "interrupt_call_us": call_us}


# ---------------------------------------------------------------- pause / resume


def _proc_state(pid: int) -> str:
    """The one-letter state of /proc/<pid>/stat ("T" stopped, "Z" zombie, ...)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "X"
    return stat[stat.rindex(b")") + 2 :][:1].decode()


def _until(pids: list[int], pred: Callable[[str], bool]) -> int:
    """Spin until every pid's state satisfies `pred`; the perf_counter_ns() it did."""
    deadline = time.monotonic() + WAIT
    while not all(pred(_proc_state(p)) for p in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"states {[_proc_state(p) for p in pids]} after {WAIT:g}s")
    return time.perf_counter_ns()


def pause_resume(cfg: Cfg) -> Iterator[Samples]:
    """`pause` call → every process of the wedged turn's tree (worker, sh, both sleeps)
    stopped (state T in /proc); `resume` call → none of them stopped. Spins on /proc from
    the calling thread, so the figure includes the host's whole path to the signals. The
    walk's pause (SIGSTOP); `pause_cgroup` is cgroup containment's."""
    with tether.Runtime(workers=2, containment="walk") as rt:
        child, auth = _quiet_child(rt, SCRIPTED)
        _pool_steady(rt, 2)
        tag = _procs.wedge_tag()
        rt.send(child, "wedge", data=wedge(tag), authority=auth)
        pids = _procs.find_tree(tag, WAIT).pids(with_starter=True)
        while True:
            paused, resumed = [], []
            for _ in range(cfg.n(30, 100)):
                t0 = time.perf_counter_ns()
                if not rt.pause(child, authority=auth):
                    raise RuntimeError("pause froze no turn")
                paused.append(ms_since(t0, _until(pids, lambda s: s == "T")))
                t0 = time.perf_counter_ns()
                rt.resume(child, authority=auth)
                resumed.append(ms_since(t0, _until(pids, lambda s: s != "T")))
            yield {"pause_ms": paused, "resume_ms": resumed}


# ---------------------------------------------------------------- watchdog overhead


def watchdog_overhead(cfg: Cfg) -> Iterator[Samples]:
    """Trivial turns per second with a stall policy on every session vs none, the two
    runtimes measured alternately in the same process (as `turns`: file store, 2
    workers, 8 roots). The figure is the relative loss, in percent; a sample is one
    round of ``_alternated`` batches (half a batch of the single-pair sample it replaced
    each, so a repetition still runs ``n`` turns a side)."""
    n, sessions = cfg.n(1500, 6000), 8
    with (
        tempfile.TemporaryDirectory(prefix="bench-watchdog-") as d,
        tether.Runtime(Path(d) / "plain.db", workers=2) as plain,
        tether.Runtime(Path(d) / "watched.db", workers=2) as watched,
    ):
        setups = []
        for rt, stall in ((plain, None), (watched, {"after": 60.0})):
            roots = [rt.open_session(SCRIPTED, stall=stall) for _ in range(sessions)]
            ended = _Countdown()
            rt.subscribe(ended.on_event)
            _pool_steady(rt, 2)
            setups.append((rt, roots, ended))

        def rate(rt: tether.Runtime, roots: list[str], ended: _Countdown, size: int) -> float:
            ended.arm(size)
            t0 = time.perf_counter()
            for i in range(size):
                rt.prompt(roots[i % sessions], "x")
            got = ended.wait(60)
            elapsed = time.perf_counter() - t0
            for root in roots:
                rt.wait(root, timeout=WAIT)
            return got / elapsed

        for rt, roots, ended in setups:
            rate(rt, roots, ended, 200)  # warm-up
        plain_batch = functools.partial(rate, *setups[0], n // 2)
        watched_batch = functools.partial(rate, *setups[1], n // 2)
        while True:
            ratios = _alternated(plain_batch, watched_batch, 1)
            yield {"overhead_pct": [(1 - r) * 100 for r in ratios]}


# ---------------------------------------------------------------- telemetry (issue 30)

# An OTLP/HTTP sink in a process of its own (it answers 200 and drops the spans), so that
# none of its work is counted as the host's CPU.
_SINK = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def telemetry_overhead(cfg: Cfg) -> Iterator[Samples]:
    """Host CPU per trivial turn with telemetry on (spans exported over OTLP/HTTP to a
    sink on loopback) vs off, the two runtimes measured alternately in the same process
    (as ``watchdog_overhead``). The figure is the extra host CPU, in percent. Skipped
    without the extra tether-runtime[otel].

    Each sample is one round of ``_alternated`` short batches (off, on, on, off); a
    repetition is several rounds, and the figure their pooled median. A round's
    ratio moves by ±10-20 % on a quiet machine (the host's batching follows the workers'
    timing), so a repetition takes 12 rounds (20 in a full run), not 6: the median of 6
    straddled the 5 % target run to run (0.71 % then 6.16 %)."""
    import subprocess
    import sys

    try:
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        raise Skip("needs the extra tether-runtime[otel]") from None
    n, rounds, sessions = cfg.n(150, 300), cfg.n(12, 20), 8
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        url = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
        with (
            tempfile.TemporaryDirectory(prefix="bench-telemetry-") as d,
            tether.Runtime(Path(d) / "plain.db", workers=2, telemetry=False) as plain,
            tether.Runtime(Path(d) / "traced.db", workers=2, telemetry={"endpoint": url}) as traced,
        ):
            setups = []
            for rt in (plain, traced):
                roots = [rt.open_session(SCRIPTED) for _ in range(sessions)]
                ended = _Countdown()
                rt.subscribe(ended.on_event)
                _pool_steady(rt, 2)
                setups.append((rt, roots, ended))

            def cpu_per_turn(
                rt: tether.Runtime, roots: list[str], ended: _Countdown, size: int
            ) -> float:
                ended.arm(size)
                cpu = time.process_time()  # every thread of this (the host) process
                for i in range(size):
                    rt.prompt(roots[i % sessions], "x")
                got = ended.wait(60)
                for root in roots:
                    rt.wait(root, timeout=WAIT)
                return (time.process_time() - cpu) / max(got, 1)

            for setup in setups:
                cpu_per_turn(*setup, 100)  # warm-up
            plain_batch = functools.partial(cpu_per_turn, *setups[0], n)
            traced_batch = functools.partial(cpu_per_turn, *setups[1], n)
            while True:
                ratios = _alternated(plain_batch, traced_batch, rounds)
                yield {"overhead_pct": [(r - 1) * 100 for r in ratios]}
    finally:
        sink.kill()
        sink.wait()


def telemetry_abort(cfg: Cfg) -> Iterator[Samples]:
    """`abort_ms` of `abort` with telemetry off and on (spans exported to the sink), the
    two runtimes taking turns, abort for abort, in the same process: a traced worker is
    killed as fast (no export stands in the abort's way; the host then makes the turn's
    span). Skipped without the extra tether-runtime[otel]."""
    import subprocess
    import sys

    try:
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        raise Skip("needs the extra tether-runtime[otel]") from None
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        url = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
        with (
            tether.Runtime(workers=2, containment="walk", telemetry=False) as plain,
            tether.Runtime(workers=2, containment="walk", telemetry={"endpoint": url}) as traced,
        ):
            setups = []
            for rt in (plain, traced):
                child, auth = _quiet_child(rt, SCRIPTED)
                setups.append((rt, child, auth, Events(rt, {"turn.ended"})))
                _pool_steady(rt, 2)

            def one(rt: tether.Runtime, child: str, auth: tether.User, events: Events) -> float:
                tag = _procs.wedge_tag()
                rt.send(child, "wedge", data=wedge(tag), authority=auth)
                tree = _procs.find_tree(tag, WAIT)
                mark = events.mark()
                with _procs.DeathWatch(tree.pids(with_starter=True)) as watch:
                    t0 = time.perf_counter_ns()
                    rt.interrupt(child, authority=auth, kind="abort", reason="bench")
                    dead = watch.wait(WAIT)
                    ended, ev = events.wait(mark, _on(child, "turn.ended"))
                if ev.data["outcome"] != "aborted":
                    raise RuntimeError(f"the wedged turn ended {ev.data['outcome']}, not aborted")
                _pool_steady(rt, 2)
                return ms_since(t0, max(dead, ended))

            while True:
                off, on = [], []
                for _ in range(cfg.n(15, 40)):
                    off.append(one(*setups[0]))
                    on.append(one(*setups[1]))
                yield {"abort_ms": off, "abort_traced_ms": on}
    finally:
        sink.kill()
        sink.wait()


# ---------------------------------------------------------------- cgroup containment


def _cgroup_runtime() -> tether.Runtime:
    try:
        return tether.Runtime(workers=2, containment="cgroup")
    except tether.InvalidParams as exc:  # no writable cgroup v2 here: say why
        raise Skip(exc.message) from None


def _escapee_wedge(tag: str) -> dict[str, Any]:
    """The wedge plus issue 19's escapee: a double-forked sleep that left the session and
    cleared its environment (`sleep <tag>1`)."""
    script = f"( ( exec env -i setsid sleep {tag}1 ) & ) & sleep {tag} & sleep {tag}; wait"
    return {"steps": [{"op": "tool", "argv": ["sh", "-c", script]}]}


def _escapee_pid(tag: str) -> int:
    def find() -> int | None:
        for p in psutil.Process().children(recursive=True):
            try:
                if p.cmdline() == ["sleep", f"{tag}1"]:
                    return p.pid
            except psutil.Error:
                continue
        return None

    return poll_until(find, WAIT, "the escapee")


def abort_cgroup(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="abort")` under containment="cgroup" on a wedged turn with an
    env-cleared `setsid` escapee → worker, sh, both sleeps and the escapee dead (pidfds)
    and the turn ended `aborted` (event); the later of the two."""
    with _cgroup_runtime() as rt:
        child, auth = _quiet_child(rt, SCRIPTED)
        events = Events(rt, {"turn.ended"})
        _pool_steady(rt, 2)
        while True:
            samples = []
            for _ in range(cfg.n(20, 60)):
                tag = _procs.wedge_tag()
                rt.send(child, "wedge", data=_escapee_wedge(tag), authority=auth)
                tree = _procs.find_tree(tag, WAIT)
                pids = [*tree.pids(with_starter=True), _escapee_pid(tag)]
                mark = events.mark()
                with _procs.DeathWatch(pids) as watch:
                    t0 = time.perf_counter_ns()
                    rt.interrupt(child, authority=auth, kind="abort", reason="bench")
                    dead = watch.wait(WAIT)
                    ended, ev = events.wait(mark, _on(child, "turn.ended"))
                if ev.data["outcome"] != "aborted" or rt.turns(child)[-1].outcome != "aborted":
                    raise RuntimeError(f"the wedged turn ended {ev.data['outcome']}, not aborted")
                samples.append(ms_since(t0, max(dead, ended)))
                _pool_steady(rt, 2)
            yield {"abort_ms": samples}


def _cgroup_events(pid: int) -> Path:
    with open(f"/proc/{pid}/cgroup") as f:
        rel = next(line[3:].strip() for line in f if line.startswith("0::"))
    from tether.contain.cgroup import v2_mount

    mount = v2_mount()
    if mount is None:
        raise RuntimeError("no cgroup v2 hierarchy")
    return Path(mount, rel.lstrip("/"), "cgroup.events")


def _until_frozen(events: Path, frozen: bool) -> int:
    want = "frozen 1" if frozen else "frozen 0"
    deadline = time.monotonic() + WAIT
    while want not in events.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{events} not {want!r} after {WAIT:g}s")
    return time.perf_counter_ns()


def pause_cgroup(cfg: Cfg) -> Iterator[Samples]:
    """`pause` under containment="cgroup" → the wedged turn's leaf says `frozen 1` (every
    process in it frozen, escapees included); `resume` → `frozen 0`."""
    with _cgroup_runtime() as rt:
        child, auth = _quiet_child(rt, SCRIPTED)
        _pool_steady(rt, 2)
        tag = _procs.wedge_tag()
        rt.send(child, "wedge", data=_escapee_wedge(tag), authority=auth)
        tree = _procs.find_tree(tag, WAIT)
        events = _cgroup_events(tree.starter)
        while True:
            paused, resumed = [], []
            for _ in range(cfg.n(30, 100)):
                t0 = time.perf_counter_ns()
                if not rt.pause(child, authority=auth):
                    raise RuntimeError("pause froze no turn")
                paused.append(ms_since(t0, _until_frozen(events, True)))
                t0 = time.perf_counter_ns()
                rt.resume(child, authority=auth)
                resumed.append(ms_since(t0, _until_frozen(events, False)))
            yield {"pause_ms": paused, "resume_ms": resumed}


# ---------------------------------------------------------------- subtree abort


SUBTREE_TURNS = 100  # the root, 9 children, 90 grandchildren: every one running


def _running_subtree(rt: tether.Runtime) -> tuple[str, tether.User, dict[str, str]]:
    """A fresh three-level tree of SUBTREE_TURNS sessions, each in a running turn (a hang
    that reaches a boundary every 10 ms), every turn dispatched to a worker."""
    root = rt.open_session(SCRIPTED)
    auth = tether.User(parent=root)
    rt.send(root, "hang", data=HANG, authority=auth)
    sessions = [root]
    for _ in range(9):
        child = str(rt.spawn(root, SCRIPTED, prompt="hang", data=HANG))
        sessions.append(child)
        sessions += [str(rt.spawn(child, SCRIPTED, prompt="hang", data=HANG)) for _ in range(10)]
    running: dict[str, str] = {}
    for sid in sessions:
        turn = rt.wait(sid, until="running", timeout=WAIT).turn
        if turn is None:
            raise RuntimeError(f"{sid} is not running")
        running[sid] = turn
    poll_until(
        lambda: True if all(rt.status(s).dispatched for s in sessions) else None,
        WAIT,
        "every turn of the subtree on a worker",
    )
    return root, auth, running


def _ends_one_of(turns: set[str], ev: tether.Event) -> bool:
    return ev.data.get("turn") in turns


def subtree_abort_100(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(root, kind="abort", scope="subtree")` on a tree of 100 running turns
    (root, 9 children, 90 grandchildren, each on a worker of its own) → every one of the
    100 turns recorded `aborted` (its turn.ended event); the call's return is checked to
    name all 100. A fresh tree each sample (an aborted session is parked)."""
    with tether.Runtime(workers=SUBTREE_TURNS) as rt:
        events = Events(rt, {"turn.ended"})
        while True:
            samples = []
            for _ in range(cfg.n(2, 4)):
                _pool_steady(rt, SUBTREE_TURNS)
                root, auth, running = _running_subtree(rt)
                mark = events.mark()
                wanted = set(running.values())
                t0 = time.perf_counter_ns()
                stopped = rt.interrupt(
                    root, authority=auth, kind="abort", reason="bench", scope="subtree"
                )
                last, left = t0, set(wanted)
                while left:
                    ns, ev = events.wait(mark, functools.partial(_ends_one_of, left))
                    left.discard(ev.data["turn"])
                    last = max(last, ns)
                if set(stopped) != wanted:
                    raise RuntimeError(f"the subtree abort named {len(stopped)} of {len(wanted)}")
                bad = [
                    (sid, t) for sid, t in running.items() if rt.turns(sid)[-1].outcome != "aborted"
                ]
                if bad:
                    raise RuntimeError(f"turns not recorded aborted: {bad[:3]}")
                samples.append(ms_since(t0, last))
            yield {"abort_ms": samples}


# ---------------------------------------------------------------- budgets (issue 29)

CROSSER = "benchmarks.drivers:BudgetCrosser"
RESPONDER = "benchmarks.drivers:Responder"


def _all_dispatched(rt: tether.Runtime, tree: list[str]) -> bool | None:
    return all(rt.status(s).dispatched for s in tree) or None


def budget_stop(cfg: Cfg) -> Iterator[Samples]:
    """A 10-session tree (a root and nine children) under one token budget, every turn
    running (a boundary every 1 ms): one turn reports the usage that crosses the limit
    (stamped in its worker just before) → every turn of the tree recorded stopped (the
    last `turn.ended`, on_hard cancel). A fresh tree each sample."""
    size = 10
    with tether.Runtime(workers=size, grace=2.0) as rt:
        events = Events(rt, {"turn.ended"})
        _pool_steady(rt, size)
        while True:
            samples = []
            for _ in range(cfg.n(10, 30)):
                root = rt.open_session(CROSSER, budget={"tokens": 1000, "on_soft": "none"})
                kids = [str(rt.spawn(root, CROSSER)) for _ in range(size - 1)]
                tree = [root, *kids]
                mark = events.mark()
                rt.prompt(root, "cross", data={"tokens": 1000})
                for kid in kids:
                    rt.send(kid, "run", authority=tether.User(root))
                poll_until(
                    functools.partial(_all_dispatched, rt, tree),
                    WAIT,
                    "every turn of the tree running",
                )
                rt.interrupt(root, authority=tether.User(root), kind="steer", reason="cross")
                last = 0
                for sid in tree:
                    ns, _ = events.wait(mark, _on(sid, "turn.ended"))
                    last = max(last, ns)
                crossed = _said(rt, root, drivers.CROSSED, 0)
                if crossed is None:
                    raise RuntimeError("the crossing report was never stamped")
                samples.append((last - crossed) / 1e6)
                for sid in tree:
                    rt.wait(sid, until=("parked", "idle"), timeout=WAIT)
            yield {"stop_ms": samples}


def usage_overhead(cfg: Cfg) -> Iterator[Samples]:
    """Host CPU per turn (as `turns`: file store, 2 workers, 8 roots, process CPU of
    this process only) for turns of 3 model-like replies (a boundary and an assistant
    entry each) with a usage report per reply, under a budget, vs the same turns
    reporting none: two runtimes measured alternately in the same process. The figure is
    the relative extra CPU, in percent; a sample is one round of ``_alternated``
    batches of ``n / 2`` turns (``usage_cpu_us``: the usage side's CPU per turn in it)."""
    n, sessions = cfg.n(1500, 6000), 8
    with (
        tempfile.TemporaryDirectory(prefix="bench-usage-") as d,
        tether.Runtime(Path(d) / "plain.db", workers=2) as plain,
        tether.Runtime(Path(d) / "usage.db", workers=2) as counted,
    ):
        setups = []
        for rt, usage in ((plain, False), (counted, True)):
            budget = {"tokens": 10**15} if usage else None
            roots = [rt.open_session(RESPONDER, budget=budget) for _ in range(sessions)]
            ended = _Countdown()
            rt.subscribe(ended.on_event)
            _pool_steady(rt, 2)
            setups.append((rt, roots, ended, {"responses": 3, "usage": usage}))

        def cpu(
            rt: tether.Runtime,
            roots: list[str],
            ended: _Countdown,
            data: dict[str, Any],
            size: int,
        ) -> float:
            ended.arm(size)
            c0 = time.process_time()
            for i in range(size):
                rt.prompt(roots[i % sessions], "x", data=data)
            got = ended.wait(60)
            c1 = time.process_time()
            for root in roots:
                rt.wait(root, timeout=WAIT)
            return (c1 - c0) / max(got, 1) * 1e6

        for setup in setups:
            cpu(*setup, 200)  # warm-up
        seen: list[float] = []

        def counted_batch() -> float:
            seen.append(cpu(*setups[1], n // 2))
            return seen[-1]

        plain_batch = functools.partial(cpu, *setups[0], n // 2)
        while True:
            seen.clear()
            ratios = _alternated(plain_batch, counted_batch, 1)
            yield {
                "overhead_pct": [(r - 1) * 100 for r in ratios],
                "usage_cpu_us": [sum(seen) / len(seen)],
            }
