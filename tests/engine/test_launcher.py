"""The pool's launcher (issue 17, item 6): workers start from a small forkserver of our
own (``runtime/_launcher.py``), on public APIs, not CPython's private forkserver.

Real processes throughout: the launcher is a child of the test process, its workers are
its children, and a fault is a real SIGKILL. The pool's own objects are read only to
find the launcher's pid and to hold the reaper for a moment (see the orphans test).
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid

import psutil
import pytest

import tether
from drivers import (
    HANG,
    SCRIPTED,
    Recorder,
    escapee,
    escapee_procs,
    eventually,
    family,
    local_pool,
    refilled,
    runtime,
    steps,
    turn_reports,
)
from tether.testing.escapee import escapee_loop

pytestmark = pytest.mark.timeout(90)


def _launcher(rt: tether.Runtime) -> psutil.Process:
    pool = local_pool(rt)
    pid = eventually(lambda: pool.launcher.pid, what="the launcher started")
    return psutil.Process(pid)


def _shared_descriptors(a: int, b: int) -> set[str]:
    """Pipes and sockets (past stdin, stdout and stderr) that both processes hold."""

    def held(pid: int) -> set[str]:
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if int(fd) > 2 and target.startswith(("pipe:", "socket:")):
                    out.add(target)
        return out

    return held(a) & held(b)


def test_a_worker_forked_by_the_launcher_runs_a_turn_in_a_session_of_its_own() -> None:
    with runtime(workers=1) as rt:
        root = rt.open_session(SCRIPTED)
        rt.prompt(root, "hello", data=steps({"op": "say", "text": "hi"}))
        rt.wait(root, until="idle", timeout=20.0)
        assert [t.outcome for t in rt.turns(root)] == ["completed"]
        launcher = _launcher(rt)
        assert launcher.ppid() == os.getpid()
        assert launcher.num_threads() == 1  # a fork copies only the forking thread
        assert os.getsid(launcher.pid) == launcher.pid  # the host's terminal signals miss it
        refilled(rt, size=2)
        for pid in rt.worker_pids:
            assert psutil.Process(pid).ppid() == launcher.pid
            assert os.getsid(pid) == pid and os.getpgid(pid) == pid
            # none of the launcher's channels: its host's EOF reaches it alone
            assert _shared_descriptors(pid, launcher.pid) == set()
            # the host's import path went over the launcher's socket, not the environment
            assert psutil.Process(pid).environ().get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def test_a_workers_own_exit_code_reaches_the_turns_error() -> None:
    with runtime(workers=1) as rt:
        sid = rt.open_session("drivers:Exiter")
        rt.prompt(sid, "die")
        rt.wait(sid, until=("idle", "parked"), timeout=20.0)
        [rec] = rt.turns(sid)
        assert rec.outcome == "crashed"
        assert rec.error == "the worker exited with code 3"
        refilled(rt, size=2)


def test_a_sigkilled_workers_orphans_go_to_the_launcher_and_are_killed_from_there() -> None:
    """The launcher is a child subreaper: the env-cleared ``setsid`` escapee of a worker
    that was SIGKILLed re-parents to it, and the reaper finds it as a launcher child that
    is no worker, and kills it before the turn's end is reported."""
    token = f"tether-orphan-{uuid.uuid4().hex[:10]}"
    try:
        with runtime(workers=1, grace=1.0, containment="walk") as rt, turn_reports() as overs:
            _, child, me = family(rt)
            rt.send(
                child,
                "go",
                authority=me,
                data=steps({"op": "tool", "argv": ["sh", "-c", escapee(token)]}),
            )
            turn = rt.wait(child, until="running", timeout=10.0).turn
            assert turn is not None
            found = eventually(lambda: escapee_procs(token), what="the escapee running")
            [esc] = escapee_loop(found, token)
            pool = local_pool(rt)
            launcher = _launcher(rt)
            worker = eventually(lambda: pool.turns.worker(turn), what="the turn on a worker")
            # The pool's lock held: the worker's end is not handled (no walk of its tree
            # while it is still dying) until the launcher has reaped it and adopted its
            # orphan; then the reaper can only find the escapee as a launcher child.
            with pool._lock:
                os.kill(worker.pid, signal.SIGKILL)
                eventually(lambda: esc.ppid() == launcher.pid, what="the escapee adopted")
                eventually(lambda: not psutil.pid_exists(worker.pid), what="the launcher reaping")
            rt.wait(child, until=("idle", "parked"), timeout=15.0)
            rec = next(t for t in rt.turns(child) if t.id == turn)
            assert rec.outcome == "crashed"
            assert not esc.is_running() or esc.status() == psutil.STATUS_ZOMBIE
            assert escapee_procs(token) == []
            over = overs[turn]  # the turn's end says how its tree was killed, and what died
            assert over.via == "walk" and esc.pid in {f.pid for f in over.processes}
            refilled(rt, size=2)
    finally:
        for p in escapee_procs(token):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_a_sigkilled_launcher_is_replaced_and_the_next_turns_run_with_nothing_left() -> None:
    with runtime(workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = family(rt)
        refilled(rt, size=2)
        old = _launcher(rt)
        seen = {*rt.worker_pids}
        old.kill()  # the pool reaps it (its child), not us
        rt.send(child, "on a worker already running", authority=me)
        assert rec.turn_ended(child, timeout=15.0)["outcome"] == "completed"
        # an abort dooms the worker: the spare takes the next turn, and the replacement
        # comes from a new launcher
        rt.send(child, "hang", authority=me, data=HANG)
        eventually(lambda: rt.status(child).dispatched, what="the turn on a worker")
        rt.interrupt(child, authority=me, kind="abort", reason="test")
        assert rec.turn_ended(child, count=2, timeout=15.0)["outcome"] == "aborted"
        rt.send(child, "after", authority=me)
        assert rec.turn_ended(child, count=3, timeout=15.0)["outcome"] == "completed"
        pool = local_pool(rt)
        eventually(lambda: pool.launcher.pid != old.pid, what="a new launcher")
        new = _launcher(rt)
        eventually(
            lambda: any(psutil.Process(pid).ppid() == new.pid for pid in rt.worker_pids),
            what="a worker from the new launcher",
        )
        refilled(rt, size=2)
        seen.update(rt.worker_pids)
        seen.add(new.pid)
        assert pool.launcher.starts == 2
    # the old launcher reaped; its workers (re-parented away from us) gone too
    assert old.pid not in {c.pid for c in psutil.Process().children()}
    left = []
    for pid in seen:
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
    assert left == [], f"processes outlived the runtime: {left}"
