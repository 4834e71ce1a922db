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
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

import tether
from benchmarks import _procs, drivers
from benchmarks._case import Cfg, Samples, ms_since, poll_until, us_since

SCRIPTED = "tether:Scripted"
STAMPED = "benchmarks.drivers:Stamped"
PROBE = "benchmarks.drivers:CancelProbe"
HANG = {"steps": [{"op": "hang"}]}  # a turn that runs, boundary every 10 ms, until stopped
WAIT = 15.0  # deadline for any single thing a case waits on


def wedge(tag: str) -> dict[str, Any]:
    return {"steps": [{"op": "tool", "argv": _procs.wedge_argv(tag)}]}


class Events:
    """Runtime events of the given names, each with the time our callback received it."""

    def __init__(self, rt: tether.Runtime, names: set[str]) -> None:
        self._names = frozenset(names)
        self._cond = threading.Condition()
        self._seen: list[tuple[int, tether.Event]] = []
        rt.subscribe(self._on)  # for the runtime's life: each case closes its runtime

    def _on(self, ev: tether.Event) -> None:
        if ev.name in self._names:  # cheap filter first: this runs on the runtime's threads
            now = time.perf_counter_ns()
            with self._cond:
                self._seen.append((now, ev))
                self._cond.notify_all()

    def mark(self) -> int:
        """A position: `wait` looks only at events after it."""
        with self._cond:
            return len(self._seen)

    def wait(self, since: int, pred: Callable[[tether.Event], bool],
             timeout: float = WAIT) -> tuple[int, tether.Event]:
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
    poll_until(lambda: True if len(rt.worker_pids) >= workers + 1 else None, WAIT,
               "the pool to replace a killed worker")
    time.sleep(0.15)  # a counted worker may still be starting (forkserver fork + Ready)


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
    never woken by notices (SPEC §5), so the parent here is parked once, by a cancel.
    """
    root = rt.open_session(SCRIPTED)
    parent = str(rt.spawn(root, SCRIPTED))
    auth = tether.User(parent=root)
    rt.send(parent, "hang", data=HANG, authority=auth)
    rt.wait(parent, until="running", timeout=WAIT)
    rt.interrupt(parent, authority=auth, kind="cancel", reason="park")
    rt.wait(parent, until="parked", timeout=WAIT)
    # The root's one notice turn (for that cancel) ends before any sample starts.
    poll_until(lambda: True if [t for t in rt.turns(root) if t.outcome] else None, WAIT,
               "the root's notice turn")
    rt.wait(root, timeout=WAIT)
    return parent, tether.User(parent=parent)


def _quiet_child(rt: tether.Runtime, driver: str) -> tuple[str, tether.User]:
    parent, auth = _quiet_parent(rt)
    return str(rt.spawn(parent, driver)), auth


# ---------------------------------------------------------------- abort


def abort(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="abort")` on a turn wedged in the tree → worker, sh and both sleeps
    dead (pidfds) and the turn ended `aborted` (event); the later of the two."""
    with tether.Runtime(workers=2) as rt:
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
                    raise RuntimeError("a third turn started with two busy: the pool has more "
                                       "than 2 runnable workers; this case needs them all busy")
                t0 = time.perf_counter_ns()
                rt.interrupt(current, authority=auth, kind="abort", reason="bench")
                # Wait for the new tree, not the stamp: polling the transcript while the
                # runtime is respawning would load the host we are timing.
                _procs.find_tree(next_tag, WAIT)
                # The stamp was said before the tool started, but the host may not have
                # written it yet: the tree can be up before the Say frame is handled.
                started = poll_until(functools.partial(_said, rt, waiting, drivers.STARTED, 0),
                                     WAIT, "the start stamp")
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
                poll_until(functools.partial(_said_text, rt, child, drivers.POLLING, after),
                           WAIT, "the probe to start polling")
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


def turns(cfg: Cfg) -> Iterator[Samples]:
    """Trivial turns on a file store, 2 workers, 8 root sessions prompted round-robin
    (each session runs its queue one turn at a time; 8 keep both workers fed). Timed
    from the first prompt to the last `turn.ended`, so enqueueing is included."""
    n, sessions = cfg.n(2000, 10000), 8
    with tempfile.TemporaryDirectory(prefix="bench-turns-") as d, \
            tether.Runtime(Path(d) / "tether.db", workers=2) as rt:
        roots = [rt.open_session(SCRIPTED) for _ in range(sessions)]
        ended = _Countdown()
        rt.subscribe(ended.on_event)

        def rate(batch: int) -> float:
            ended.arm(batch)
            t0 = time.perf_counter()
            for i in range(batch):
                rt.prompt(roots[i % sessions], "x")
            got = ended.wait(60)
            elapsed = time.perf_counter() - t0
            if got < batch:
                cfg.note(f"only {got} of {batch} turns ended within 60 s")
            for root in roots:  # drain, so a short batch does not spill into the next
                rt.wait(root, timeout=WAIT)
            return got / elapsed

        _pool_steady(rt, 2)
        rate(200)  # warm-up: the first turns load the driver and grow the store
        while True:
            yield {"turns_per_s": [rate(n)]}


# ---------------------------------------------------------------- send throughput


def sends(cfg: Cfg) -> Iterator[Samples]:
    """Accepted durable sends (file store, `wake=False`) from one caller, round-robin over
    the inboxes of 100 children; each returns only once its message is committed."""
    n, inboxes = cfg.n(5000, 20000), 100
    with tempfile.TemporaryDirectory(prefix="bench-sends-") as d, \
            tether.Runtime(Path(d) / "tether.db", workers=2) as rt:
        root = rt.open_session(SCRIPTED)
        auth = tether.User(parent=root)
        kids = [str(rt.spawn(root, SCRIPTED)) for _ in range(inboxes)]
        for i in range(200):
            rt.send(kids[i % inboxes], "warm", authority=auth, wake=False)
        while True:
            t0 = time.perf_counter()
            for i in range(n):
                rt.send(kids[i % inboxes], "x", authority=auth, wake=False)
            yield {"sends_per_s": [n / (time.perf_counter() - t0)]}


# ---------------------------------------------------------------- many live sessions


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _session_tree(cfg: Cfg, live: int, lists: int, calls: int) -> Iterator[Samples]:
    """`live` sessions: a root, s-1 children with s grandchildren each (s = sqrt(live)),
    all continuable and idle. Measures spawning them, their memory, listing them, and the
    synchronous part of interrupt on one of them.

    The interrupt is a steer to a grandchild whose turn is wedged in a tool: every call
    then authorizes and issues a real frame to a running turn (a repeated cancel would be
    a no-op after the first), and no boundary delivers the steers meanwhile, so no
    transcript writes compete with the calls. The calls are 1 ms apart, as interrupts
    come in use, so each one finds the agent's thread idle rather than a backlog.
    """
    s = math.isqrt(live)
    assert s * s == live
    while True:
        with tether.Runtime(workers=2) as rt:
            root = rt.open_session(SCRIPTED)
            # The first child and grandchild warm the spawn paths (driver probe, first
            # allocations) outside the timing; they count among the `live` sessions.
            kids = [str(rt.spawn(root, SCRIPTED))]
            leaves = [str(rt.spawn(kids[0], SCRIPTED))]
            before = _rss()
            t0 = time.perf_counter()
            kids += [str(rt.spawn(root, SCRIPTED)) for _ in range(s - 2)]
            leaves += [str(rt.spawn(kids[0], SCRIPTED)) for _ in range(s - 1)]
            leaves += [str(rt.spawn(k, SCRIPTED)) for k in kids[1:] for _ in range(s)]
            spawn_s = time.perf_counter() - t0
            n = len(kids) + len(leaves) - 2  # spawned while timed
            time.sleep(0.2)  # let the new actors' threads settle into their inbox waits
            kib = (_rss() - before) / n / 1024
            list_ms = []
            for _ in range(lists):
                t0 = time.perf_counter()
                got = rt.list_agents(root, scope="descendants")
                list_ms.append((time.perf_counter() - t0) * 1e3)
            if len(got) != live - 1:
                raise RuntimeError(f"list_agents returned {len(got)} of {live - 1} sessions")
            target, auth = leaves[-1], tether.User(parent=kids[-1])
            tag = _procs.wedge_tag()
            rt.send(target, "wedge", data=wedge(tag), authority=auth)
            _procs.find_tree(tag, WAIT)
            call_us = []
            for i in range(calls):
                time.sleep(0.001)
                t0n = time.perf_counter_ns()
                rt.interrupt(target, authority=auth, kind="steer", reason=f"s{i}")
                call_us.append(us_since(t0n, time.perf_counter_ns()))
            rt.interrupt(target, authority=auth, kind="abort", reason="bench done")
            rt.wait(target, timeout=WAIT)
            yield {"spawn_per_s": [n / spawn_s], "idle_session_kib": [kib],
                   "list_ms": list_ms, "interrupt_call_us": call_us}


def sessions_100(cfg: Cfg) -> Iterator[Samples]:
    return _session_tree(cfg, 100, cfg.n(50, 200), cfg.n(500, 2000))


def sessions_10k(cfg: Cfg) -> Iterator[Samples]:
    return _session_tree(cfg, 10_000, cfg.n(10, 30), cfg.n(500, 2000))
