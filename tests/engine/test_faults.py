"""Issue 8, faults in the pool and the worker (semantics §14.3): none of them wedges the host.

Each test is named after the behaviour it proves and failed on the code before its fix.
Faults are real: descriptor and address-space limits set with ``setrlimit``/``prlimit``,
SIGSTOP and SIGKILL of real workers, tools that ``setsid`` under process churn. Escapees
leave our process tree (they re-parent to init), so the leak fixture cannot see them:
every escapee carries a unique token in its command line, and the tests look it up.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, MutableMapping
from typing import Any

import psutil
import pytest
import structlog

import tether
from drivers import (
    ESCAPEE,
    ESCAPEE_KILLS_WORKER,
    HANG,
    SCRIPTED,
    Recorder,
    alive,
    entries,
    eventually,
    family,
    kill_token,
    local_pool,
    refilled,
    runtime,
    steps,
    texts,
    token_procs,
    tree_of,
    worker_with_tool,
)
from tether import User

SH_TREE = ["sh", "-c", "sleep 30 & sleep 30; wait"]
MIB = 1024 * 1024


def _logged(logs: list[MutableMapping[str, Any]], event: str) -> bool:
    return any(e["event"] == event for e in list(logs))


def _wait_logged(logs: list[MutableMapping[str, Any]], event: str, timeout: float) -> bool:
    """Wait (with a deadline) for a log event; False if it never came."""
    try:
        eventually(lambda: _logged(logs, event), timeout=timeout, what=event)
    except AssertionError:
        return False
    return True


# ---- 5: descriptor exhaustion during an abort ------------------------------------------------


@contextlib.contextmanager
def _no_free_descriptors() -> Iterator[None]:
    """This process can open no file descriptor until the block ends (then all is restored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 16, hard))
    try:
        while True:  # fill every free slot below the new limit
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
                break
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_abort_that_fails_for_lack_of_descriptors_is_retried_until_the_tree_is_dead(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, slug="child")
    rt.send(child, "tree", authority=me, data=steps({"op": "tool", "argv": SH_TREE}))
    tree = tree_of(worker_with_tool(rt, "sleep", count=2))

    with structlog.testing.capture_logs() as logs, _no_free_descriptors():
        rt.interrupt(child, authority=me, kind="abort", reason="no fds")
        # the walk needs descriptors: the kill fails, and must be tried again later
        retried = _wait_logged(logs, "worker.kill_retry", timeout=3.0)

    ended = rec.turn_ended(child, timeout=10.0)
    assert ended["outcome"] == "aborted"
    assert not any(alive(p) for p in tree), "the turn was reported before its tree was dead"
    assert retried, "the kill never failed: the test did not exhaust descriptors"
    rt.send(child, "again", authority=me)
    assert rec.turn_ended(child, count=2, timeout=10.0)["outcome"] == "completed"
    refilled(rt)


# ---- 6: a failed respawn ----------------------------------------------------------------------


@contextlib.contextmanager
def _workers_cannot_start(rt: tether.Runtime) -> Iterator[None]:
    """New workers die before Ready: the launcher's address space has no room for a thread.

    Every worker starts a reader thread (an 8 MiB stack); with the launcher capped just
    above its own size, each child it forks fails there and exits.
    """
    fs = psutil.Process(local_pool(rt).launcher.pid)
    before = fs.rlimit(psutil.RLIMIT_AS)
    fs.rlimit(psutil.RLIMIT_AS, (fs.memory_info().vms + 2 * MIB, before[1]))
    try:
        yield
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            fs.rlimit(psutil.RLIMIT_AS, before)


def test_a_failed_respawn_is_retried_while_turns_wait() -> None:
    with runtime(workers=1, grace=1.0) as rt, structlog.testing.capture_logs() as logs:
        rec = Recorder(rt)
        root = rt.open_session(SCRIPTED)
        with _workers_cannot_start(rt):
            killed = set(rt.worker_pids)
            for pid in killed:  # active and spare die; every replacement fails
                os.kill(pid, signal.SIGKILL)
            # Both deaths seen (a worker whose end the pool has not read yet is still
            # idle to it, and would take the turn and crash it), and a failed respawn.
            eventually(lambda: killed.isdisjoint(rt.worker_pids), timeout=10.0, what="both deaths")
            eventually(
                lambda: (
                    _logged(logs, "worker.respawn_failed") or _logged(logs, "worker.start_failed")
                ),
                timeout=10.0,
                what="a failed respawn",
            )
            rt.prompt(root, "waits for a worker")
            info = rt.wait(root, until="running", timeout=5.0)
            assert not info.dispatched, "a turn with no worker reads as dispatched"
        end = rec.turn_ended(root, timeout=15.0)
        assert end["outcome"] == "completed", (end, rt.turns(root)[-1])
        refilled(rt, size=2)


# ---- 7: the thread limit ---------------------------------------------------------------------


@contextlib.contextmanager
def _no_new_threads() -> Iterator[None]:
    """This process can start no thread (no room for a stack) until the block ends."""
    before = resource.getrlimit(resource.RLIMIT_AS)
    vms = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vms + 4 * MIB, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)


def test_an_abort_at_the_thread_limit_ends_the_turn_and_the_pool_refills_later() -> None:
    with runtime(workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _root, child, me = family(rt, slug="child")
        rt.send(child, "hang", authority=me, data=HANG)
        rt.wait(child, until="running", timeout=5.0)
        with _no_new_threads():
            rt.interrupt(child, authority=me, kind="abort", reason="no threads")
            ended = rec.turn_ended(child, timeout=10.0)
        assert ended["outcome"] == "aborted"
        rt.send(child, "after", authority=me)
        assert rec.turn_ended(child, count=2, timeout=15.0)["outcome"] == "completed"
        refilled(rt, size=2)


# ---- 8: escapees ------------------------------------------------------------------------------


def _churn_with_escapee(token: str) -> list[str]:
    """Three loops forking /bin/true, then (one level deeper) a setsid escapee that forks.

    A walk that stops at the first vanished ``true`` never reaches the escapee's child.
    """
    loop = "(while :; do /bin/true; done) &"
    esc = f"sh -c '{sys.executable} -c \"$0\" {token} & wait' '{ESCAPEE}' &"
    return ["sh", "-c", f"{loop} {loop} {loop} {esc} wait"]


@pytest.mark.timeout(90)
def test_abort_under_process_churn_kills_every_setsid_escapee_before_reporting_aborted(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, slug="child")
    survived: list[int] = []
    for i in range(30):
        token = f"tether-esc-{uuid.uuid4().hex}"
        try:
            rt.send(
                child,
                f"churn {i}",
                authority=me,
                data=steps({"op": "tool", "argv": _churn_with_escapee(token)}),
            )

            def both_escapees(t: str = token) -> bool:
                return len(token_procs(t)) == 2

            eventually(both_escapees, timeout=10.0, what="the escapees")
            rt.interrupt(child, authority=me, kind="abort", reason=f"churn {i}")
            assert rec.turn_ended(child, count=i + 1, timeout=10.0)["outcome"] == "aborted"
            if token_procs(token):
                survived.append(i)
        finally:
            kill_token(token)
    assert survived == [], f"escapees outlived {len(survived)} of 30 aborts"
    refilled(rt)


def test_an_escapee_dies_with_a_worker_that_was_sigkilled(rt: tether.Runtime) -> None:
    """Looped: a worker killed by its own tool is still handing its children to the
    launcher, thread by thread, when the reaper's first pass walks it; a pass that took
    that walk (or the launcher's children then) for the whole tree ended the turn with
    the escapee alive, about once in 300 tries without the test-walk's cgroup."""
    rec = Recorder(rt)
    _root, child, me = family(rt, slug="child")
    survived = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for i in range(150):
            token = f"tether-esc-{uuid.uuid4().hex}"
            try:
                argv = [sys.executable, "-c", ESCAPEE_KILLS_WORKER, token]
                rt.send(child, "die", authority=me, data=steps({"op": "tool", "argv": argv}))
                assert rec.turn_ended(child, count=i + 1, timeout=10.0)["outcome"] == "crashed"
                if token_procs(token):
                    survived.append(i)
            finally:
                kill_token(token)
    finally:
        sys.setswitchinterval(old)
    assert survived == [], f"escapees outlived {len(survived)} of 150 worker SIGKILLs"
    refilled(rt)


_HOST = """
import json, os, sys, threading
import tether
rt = tether.Runtime(workers=1, grace=1.0)
root = rt.open_session("tether:Scripted")
argv = [sys.executable, "-c", os.environ["ESCAPEE"], os.environ["TOKEN"]]
rt.prompt(root, "escape", data={"steps": [{"op": "tool", "argv": argv}]})
print(json.dumps({"host": os.getpid()}), flush=True)
threading.Event().wait(60.0)
"""


def test_an_escapee_dies_with_a_host_that_was_sigkilled() -> None:
    token = f"tether-esc-{uuid.uuid4().hex}"
    # the token goes by the environment: in the host's own argv it would mark the host
    env = {**os.environ, "ESCAPEE": ESCAPEE, "TOKEN": token}
    host = subprocess.Popen(
        [sys.executable, "-c", _HOST], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert host.stdout is not None
        json.loads(host.stdout.readline())
        eventually(lambda: len(token_procs(token)) == 2, timeout=10.0, what="the escapees")
        tree = tree_of(psutil.Process(host.pid))
        host.kill()
        host.wait(5.0)
        eventually(lambda: not token_procs(token), timeout=5.0, what="the escapees to die")
        eventually(lambda: not any(alive(p) for p in tree), timeout=5.0, what="the host's tree")
    finally:
        kill_token(token)
        host.kill()
        host.wait(5.0)
        if host.stdout is not None:
            host.stdout.close()


# ---- 9: a frame that fails to decode for any reason ------------------------------------------


def test_a_deeply_nested_worker_frame_crashes_that_turn_and_the_host_lives_on() -> None:
    with runtime(workers=1, grace=1.0) as rt, structlog.testing.capture_logs() as logs:
        rec = Recorder(rt)
        root = rt.open_session(SCRIPTED)
        me = User(parent=root)
        bad = rt.spawn(root, "drivers:DeepFrame")
        good = rt.spawn(root, SCRIPTED)
        assert isinstance(bad, str) and isinstance(good, str)
        rt.send(bad, "deep", authority=me)
        assert rec.turn_ended(bad, timeout=10.0)["outcome"] == "crashed"
        assert _logged(logs, "frame.rejected")
        rt.send(good, "still here", authority=me)
        assert rec.turn_ended(good, timeout=10.0)["outcome"] == "completed"
        rt.send(bad, "again", authority=me)
        assert rec.turn_ended(bad, count=2, timeout=10.0)["outcome"] == "completed"
        refilled(rt, size=2)


# ---- 10: a worker that stops reading its socket ----------------------------------------------


def _stopped_worker(rt: tether.Runtime) -> psutil.Process:
    def find() -> psutil.Process | None:
        for pid in rt.worker_pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_STOPPED:
                    return p
        return None

    return eventually(find, timeout=5.0, what="a stopped worker")


def test_a_stopped_worker_with_a_full_socket_is_aborted_at_once_and_the_host_stays_responsive(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    root, child, me = family(rt, slug="child")
    other = rt.spawn(root, SCRIPTED, slug="other")
    rt.send(
        child,
        "freeze",
        authority=me,
        data=steps({"op": "tool", "argv": ["sh", "-c", "kill -STOP $PPID; sleep 300"]}),
    )
    worker = _stopped_worker(rt)
    try:

        def steer() -> None:
            for i in range(400):  # ~800 KB of steers: far more than a socket buffer holds
                rt.interrupt(child, authority=me, kind="steer", reason=f"{i} " + "x" * 1990)

        steering = threading.Thread(target=steer, daemon=True)
        steering.start()
        steering.join(10.0)
        assert not steering.is_alive(), "steers block on a stopped worker's socket"

        aborted = threading.Event()

        def abort() -> None:
            rt.interrupt(child, authority=me, kind="abort")
            aborted.set()

        threading.Thread(target=abort, daemon=True).start()
        assert aborted.wait(5.0), "the abort call blocked"
        assert rec.turn_ended(child, timeout=5.0)["outcome"] == "aborted"
        assert not alive(worker)

        rt.send(other, "still here", authority=me)
        assert rec.turn_ended(other, timeout=10.0)["outcome"] == "completed"
        assert rt.status(other).state == "idle"
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.resume()  # unwedge the old pool so that teardown can finish
    refilled(rt)


# ---- 14: run_command and a background child that keeps the output open -----------------------


def test_run_command_returns_when_the_command_exits_though_a_background_child_holds_its_output(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, slug="child")
    rt.send(
        child,
        "bg",
        authority=me,
        data=steps(
            {"op": "tool", "argv": ["sh", "-c", "sleep 30 & echo hi"]},
            {"op": "say", "text": "after"},
        ),
    )
    ended = rec.turn_ended(child, timeout=5.0)
    assert ended["outcome"] == "completed"
    assert texts(rt, child, "tool") == ["exit 0: hi"]
    assert texts(rt, child, "assistant") == ["after"]


def test_a_preempt_after_the_command_exited_writes_no_preempted_marker(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, slug="child")
    for i in range(3):
        token = f"tether-bg-{uuid.uuid4().hex}"
        argv = ["sh", "-c", "sleep 31.7 & echo hi", token]
        rt.send(
            child, f"bg {i}", authority=me, data=steps({"op": "tool", "argv": argv}, {"op": "hang"})
        )

        def exited(t: str = token, n: int = i) -> bool:
            # the command (sh) is gone; its background sleep may still hold the pipe
            done = len(texts(rt, child, "tool")) > n
            return done or (bool(token_procs("31.7")) and not token_procs(t))

        eventually(exited, timeout=5.0, what="the command to exit")
        rt.interrupt(child, authority=me, kind="preempt", reason="late")

        def entered(n: int = i) -> bool:
            return len(texts(rt, child, "tool")) > n

        eventually(entered, timeout=5.0, what="the tool entry")
        rt.interrupt(child, authority=me, kind="cancel")
        rec.turn_ended(child, count=i + 1, timeout=5.0)
    assert [e.action for e in entries(rt, child, "marker")] == ["cancelled"] * 3
    assert texts(rt, child, "tool") == ["exit 0: hi"] * 3
