"""Containment (semantics §15.5, issue 19): a turn's processes die with its stop, whatever
they did to their ancestry, session, environment or name.

Each test that applies to both paths runs on ``containment`` = ``cgroup`` (a leaf per
worker, ``cgroup.kill`` / ``cgroup.freeze``) and ``walk`` (the process-tree walk, with
the pool's launcher as subreaper for a dead worker's orphans); the cgroup case skips, with the
reason, where no writable cgroup v2 hierarchy is available. The escapee is the one of
issue 19's repro: double-forked, ``setsid``, ``env -i``, renamed with ``exec -a``,
ignoring SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from drivers import (
    SCRIPTED,
    TESTS,
    cgroup_probe,
    ended_turn,
    escapee,
    escapee_procs,
    eventually,
    family,
    frozen,
    host_cgroups,
    leaf_of,
    local_pool,
    runtime,
    steps,
    still_running,
    turn_reports,
)
from tether import InvalidParams, User
from tether.contain import cgroup, hooks, procs
from tether.contain.cgroup import LIMIT_CONTROLLERS, Cgroups, Leaf, kill_leaf

pytestmark = pytest.mark.timeout(90)


CGROUP_MISSING, _CONTROLLERS = cgroup_probe()
needs_cgroup = pytest.mark.skipif(
    CGROUP_MISSING is not None, reason=f"no cgroup containment here: {CGROUP_MISSING}"
)


def _argv0(p: psutil.Process) -> str | None:
    with contextlib.suppress(psutil.Error, IndexError):
        return p.cmdline()[0]
    return None


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


def _escapee_loop(found: list[psutil.Process], token: str) -> psutil.Process:
    """The escapee's loop itself: its ``sleep`` forks carry its name until they exec."""
    named = [p for p in found if _argv0(p) == token]
    pids = {p.pid for p in named}

    def top(p: psutil.Process) -> bool:
        try:
            return p.ppid() not in pids
        except psutil.Error:  # a fork that exited meanwhile
            return False

    [loop] = [p for p in named if top(p)]
    return loop


def _run_tool(rt: tether.Runtime, child: str, me: User, script: str) -> str:
    """Start a turn whose tool runs ``script``; its id, once a worker runs it."""
    rt.send(child, "go", authority=me, data=steps({"op": "tool", "argv": ["sh", "-c", script]}))
    turn = rt.wait(child, until="running").turn
    assert turn is not None
    pool = local_pool(rt)
    # a claimed turn reaches a worker once its claim is durable
    eventually(lambda: pool.turns.worker(turn), what="the turn on a worker")
    return turn


def _worker_pid(rt: tether.Runtime, turn: str) -> int:
    pool = local_pool(rt)
    pid: int = eventually(lambda: pool.turns.worker(turn), what="the turn on a worker").pid
    return pid


# ---- aborts ------------------------------------------------------------------------


def test_an_abort_kills_a_renamed_env_cleared_setsid_escapee_that_ignores_sigterm(
    containment: str, token: str
) -> None:
    with runtime(workers=1, grace=1.0, containment=containment) as rt:
        assert rt.containment == containment
        _, child, me = family(rt)
        turn = _run_tool(rt, child, me, escapee(token))
        found = eventually(lambda: escapee_procs(token), what="the escapee running")
        esc = _escapee_loop(found, token)
        assert os.getsid(esc.pid) == esc.pid  # it left the worker's session
        assert b"TETHER_TREE" not in Path(f"/proc/{esc.pid}/environ").read_bytes()
        if containment == "cgroup":
            assert leaf_of(esc.pid) == leaf_of(_worker_pid(rt, turn))

        assert rt.interrupt(child, authority=me, kind="abort") == turn
        rec = ended_turn(rt, child, turn)

        assert rec.outcome == "aborted"
        assert still_running(found) == [] and escapee_procs(token) == []
        # what the stop report shows: how, and every process with its fate
        report = eventually(lambda: rt.stop_report(turn), what="the stop report")
        assert report.via == containment
        fates = {f.pid: f for f in report.processes}
        assert fates[esc.pid].argv[0] == token and fates[esc.pid].fate == "dead"
        assert fates[esc.pid].started == pytest.approx(esc.create_time())
        assert all(f.fate == "dead" and f.signal == "SIGKILL" for f in report.processes)
        if containment == "cgroup":
            assert rec.resources is not None and rec.resources["cpu_ms"] > 0
        else:
            assert rec.resources is None
        group = None if rt._cgroups is None else rt._cgroups.base
    if group is not None:  # closed: every leaf and the host's group are removed
        assert not os.path.exists(group)


BOMB = textwrap.dedent(
    """
    import os, sys, time
    token, sleep, go, count = sys.argv[1:5]
    with open(count, "ab", buffering=0) as counted:
        for i in range(200):
            if i == 20:  # the rest only once the test is about to abort
                while not os.path.exists(go):
                    time.sleep(0.01)
            if os.fork() == 0:
                os.setsid()
                os.execv(sleep, [token, "60"])
            counted.write(b".")
            time.sleep(0.01)
    time.sleep(60)
    """
)


def test_an_abort_racing_a_fork_bomb_of_200_forks_leaves_nothing(
    containment: str, token: str, tmp_path: Path
) -> None:
    script, go, count = tmp_path / "bomb.py", tmp_path / "go", tmp_path / "count"
    script.write_text(BOMB)
    sleep = shutil.which("sleep")
    assert sleep is not None
    with runtime(workers=1, grace=1.0, containment=containment) as rt:
        _, child, me = family(rt)
        argv = f"exec {sys.executable} {script} {token} {sleep} {go} {count}"
        turn = _run_tool(rt, child, me, argv)
        eventually(lambda: len(escapee_procs(token)) >= 20, what="the bomb under way")
        go.touch()  # 180 more forks, 10 ms apart: the abort lands among them
        rt.interrupt(child, authority=me, kind="abort")
        assert ended_turn(rt, child, turn).outcome == "aborted"
        assert escapee_procs(token) == []
        assert 20 <= count.stat().st_size < 200  # the abort raced the forks


# ---- deaths ------------------------------------------------------------------------


def test_sigkill_of_the_turns_worker_leaves_no_process_of_the_turn(
    containment: str, token: str
) -> None:
    """Issue 19's repro: before, the walk lost the env-cleared escapee once its worker
    was gone, and it ran forever."""
    with runtime(workers=1, grace=1.0, containment=containment) as rt, turn_reports() as overs:
        _, child, me = family(rt)
        turn = _run_tool(rt, child, me, escapee(token))
        found = eventually(lambda: escapee_procs(token), what="the escapee running")
        esc = _escapee_loop(found, token)
        os.kill(_worker_pid(rt, turn), signal.SIGKILL)
        rec = ended_turn(rt, child, turn)
        assert rec.outcome == "crashed"
        assert still_running(found) == [] and escapee_procs(token) == []  # reported only once dead
        # the turn's end says how its tree was killed, and that the escapee was among it
        assert overs[turn].via == containment
        assert esc.pid in {f.pid for f in overs[turn].processes}


@contextlib.contextmanager
def _killed_host(
    db: str, containment: str, token: str, *, pause: bool = False, guard: bool = True
) -> Iterator[dict[str, Any]]:
    """``containment_host.py`` on ``db``, SIGKILLed once its turn's escapee runs.
    ``guard=False``: its cgroup guard is SIGKILLed first (as by a kill of everything)."""
    argv = [
        sys.executable,
        str(TESTS / "containment_host.py"),
        db,
        containment,
        token,
        escapee(token),
        *(["pause"] if pause else []),
    ]
    tree: list[psutil.Process] = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, "the host printed nothing"
            ready: dict[str, Any] = json.loads(line)
            tree = psutil.Process(proc.pid).children(recursive=True)
            if not guard:
                guards = [p for p in tree if "contain/guard.py" in " ".join(_cmdline(p))]
                assert guards, "no cgroup guard under the host"
                for p in guards:  # the host's child: dead once a zombie
                    p.kill()
                    deadline = time.monotonic() + 10.0
                    while p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        assert time.monotonic() < deadline, "the guard did not die"
                        time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10.0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    try:
        yield ready
    finally:
        for p in tree:  # the old host's processes are not our children: the leak check
            with contextlib.suppress(psutil.NoSuchProcess):  # would not see them
                p.kill()


def test_sigkill_of_the_host_leaves_no_process_of_the_turn(
    containment: str, token: str, db_path: str
) -> None:
    with _killed_host(db_path, containment, token) as ready:
        assert ready["containment"] == containment
        # the worker sees its channel end and takes its tree (its leaf) down with it
        eventually(lambda: not escapee_procs(token), timeout=5.0, what="the escapee gone")
        with runtime(db_path, workers=1, containment=containment) as rt:
            [rec] = rt.turns(ready["child"])
            assert rec.outcome == "crashed"
            assert escapee_procs(token) == []
            if ready["group"] is not None:  # the old host's leaves are gone
                old = ready["leaves"]
                assert old and not any(os.path.exists(f"{ready['group']}/{n}") for n in old)
                assert _only_this_hosts(rt, ready["group"])


def _only_this_hosts(rt: tether.Runtime, group: str) -> bool:
    """The group's leaves are the new host's own workers' and its mark (the old ones are
    gone)."""
    leaves = {n for n in os.listdir(group) if os.path.isdir(os.path.join(group, n))}
    mine = {os.path.basename(leaf_of(pid) or "") for pid in rt.worker_pids}
    mark = host_cgroups(rt).prefix + "owner"
    return leaves <= mine | {mark}


def _children(group: str) -> list[str]:
    return sorted(n for n in os.listdir(group) if os.path.isdir(os.path.join(group, n)))


@needs_cgroup
def test_a_later_host_of_another_store_removes_the_empty_group_a_sigkilled_host_left(
    token: str, db_path: str, tmp_path: Path
) -> None:
    """Every SIGKILLed host left its store's group behind (``tether/s-<hash>/``): its
    workers emptied their leaves, its guard (when it lived) removed them, but nobody
    removed the group unless a host reopened that very store, so they piled up. Here
    even the guard died: the dead host's mark and empty leaves are left, and a host of
    another store removes them and the group."""
    with _killed_host(db_path, "cgroup", token, guard=False) as ready:
        group, old = ready["group"], ready["leaves"]
        assert any(n.endswith("-owner") for n in old), old  # the dead host's mark
        eventually(lambda: not escapee_procs(token), timeout=5.0, what="the escapee gone")
        eventually(
            lambda: not any(Leaf(os.path.join(group, n), frozenset()).populated() for n in old),
            what="the dead host's leaves emptied by its workers",
        )
        assert _children(group) == old
        with runtime(str(tmp_path / "other.db"), workers=1, containment="cgroup") as rt:
            assert host_cgroups(rt).base != group
            assert not os.path.exists(group), _children(group)


@needs_cgroup
def test_a_host_making_its_store_group_while_another_host_sweeps_it_keeps_it() -> None:
    """The sweep's ``rmdir`` of an empty group races a host making that group: the host
    makes the group again until its mark is in it, and from then on the kernel refuses
    the sweep. 300 tries, the sweeper in a tight loop."""

    with runtime(workers=1, containment="cgroup") as rt:
        top = os.path.dirname(host_cgroups(rt).base)
    group = os.path.join(top, f"s-race{uuid.uuid4().hex[:12]}")
    prefix = cgroup._owner_prefix()
    mark = os.path.join(group, prefix + "owner")
    stop = threading.Event()
    swept = [0]

    def sweeper() -> None:
        while not stop.is_set():
            cgroup._sweep_store_group(group)
            swept[0] += not os.path.exists(group)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=sweeper)
    thread.start()
    try:
        for i in range(300):
            cgroup._own_store_group(group, prefix)
            assert os.path.isdir(mark), f"try {i}: the host's mark is gone"
            time.sleep(0.0005)  # the sweeper looks at a live host's group meanwhile
            assert os.path.isdir(mark), f"try {i}: a sweep removed a live host's mark"
            os.rmdir(mark)  # this host closes: its group is the sweep's now
    finally:
        stop.set()
        thread.join(10.0)
        sys.setswitchinterval(old)
        with contextlib.suppress(OSError):
            os.rmdir(mark)
        with contextlib.suppress(OSError):
            os.rmdir(group)
    assert swept[0] > 0  # the sweep did remove the group between the tries


@needs_cgroup
def test_a_later_host_of_another_store_never_removes_a_live_hosts_group(
    db_path: str, tmp_path: Path
) -> None:
    with runtime(db_path, workers=1, containment="cgroup") as live:
        group = host_cgroups(live).base
        root = live.open_session(SCRIPTED)
        before = _children(group)
        assert host_cgroups(live).prefix + "owner" in before
        with runtime(str(tmp_path / "other.db"), workers=1, containment="cgroup"):
            assert _children(group) == before
        live.prompt(root, "still here")
        assert live.wait(root, until="idle", timeout=30.0).state == "idle"
        assert [t.outcome for t in live.turns(root)] == ["completed"]
    assert not os.path.exists(group)  # closed: its mark and leaves went, then the group


@needs_cgroup
def test_the_next_host_kills_and_removes_the_cgroups_a_sigkilled_host_left_frozen(
    token: str, db_path: str
) -> None:
    """A paused turn cannot sweep itself when its host dies (its worker is frozen). Its
    host's guard kills it (below); where even the guard died with the host, its
    processes stay, frozen, until the next host on the same store starts."""
    with _killed_host(db_path, "cgroup", token, pause=True, guard=False) as ready:
        group = ready["group"]
        left = escapee_procs(token)
        assert left and all(frozen(p) for p in left)  # nothing else would ever kill it
        old = ready["leaves"]
        assert old and all(os.path.isdir(f"{group}/{n}") for n in old)
        with runtime(db_path, workers=1, containment="cgroup") as rt:
            assert escapee_procs(token) == []
            assert not any(os.path.exists(os.path.join(group, n)) for n in old)
            assert _only_this_hosts(rt, group)
            [rec] = rt.turns(ready["child"])
            assert rec.outcome == "crashed"


def test_a_sigkilled_hosts_guard_kills_its_paused_turns_frozen_cgroup_at_once(
    token: str, db_path: str
) -> None:
    """Before the guard, a SIGKILLed host's paused turn stayed frozen (its worker cannot
    run its sweep) until a next host started on the same store, if ever: the soak saw
    the host's forkserver and resource tracker outlive it too."""
    with _killed_host(db_path, "cgroup", token, pause=True) as ready:
        group, old = ready["group"], ready["leaves"]
        assert old

        def left() -> list[str]:
            return [n for n in old if os.path.isdir(os.path.join(group, n))]

        deadline = time.monotonic() + 10.0
        while (escapee_procs(token) or left()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert escapee_procs(token) == [], "the paused turn's processes outlived their host"
        assert left() == [], "the host's leaves were not removed"


@needs_cgroup
def test_a_dead_hosts_guard_never_touches_the_next_hosts_leaves_on_the_same_store(
    token: str, db_path: str
) -> None:
    """One group per store, one prefix per host. A SIGKILLed host's guard once cleared
    the whole group, so when the next host on the store had started meanwhile it killed
    that host's workers and removed their leaves (a CI run: 'worker processes fail to
    start'). Here the old guard is held stopped until the new host runs."""
    argv = [sys.executable, str(TESTS / "containment_host.py"), db_path, "cgroup", token]
    argv += [escapee(token)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline(), "the host printed nothing"
            tree = psutil.Process(proc.pid).children(recursive=True)
            # a short-lived child of the host may be a zombie by now: no command line
            [guard] = [p for p in tree if "contain/guard.py" in " ".join(_cmdline(p))]
            guard.suspend()
        finally:
            proc.kill()
            proc.wait(10.0)
    try:
        with runtime(db_path, workers=1, containment="cgroup") as rt:
            root = rt.open_session(SCRIPTED)
            me = User(parent=root)
            rt.send(root, "before", authority=me)
            assert rt.wait(root, until="idle", timeout=30.0).state == "idle"
            mine = {leaf_of(pid) for pid in rt.worker_pids}
            guard.resume()  # the old host's guard sees its pipe closed and clears
            deadline = time.monotonic() + 10.0
            while guard.is_running() and guard.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, "the old guard did not finish"
                time.sleep(0.02)
            assert all(leaf is not None and os.path.isdir(leaf) for leaf in mine)
            rt.send(root, "after", authority=me)
            assert rt.wait(root, until="idle", timeout=30.0).state == "idle"
            assert [t.outcome for t in rt.turns(root)] == ["completed", "completed"]
    finally:
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


# ---- pause -------------------------------------------------------------------------

TICKER = textwrap.dedent(
    """
    import os, sys, time
    out = sys.argv[1]
    while True:  # a new process every few ms, each appending to the file until killed
        if os.fork() == 0:
            os.setsid()
            while True:
                with open(out, "a") as f:
                    f.write(".")
                time.sleep(0.01)
        time.sleep(0.003)
    """
)


def test_a_pause_freezes_every_process_of_the_turn_even_one_forked_just_before(
    containment: str, tmp_path: Path
) -> None:
    out = tmp_path / "ticks"
    out.touch()
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    with runtime(workers=1, grace=1.0, containment=containment) as rt:
        _, child, me = family(rt)
        turn = _run_tool(rt, child, me, f"exec {sys.executable} {script} {out}")
        eventually(lambda: out.stat().st_size > 50, what="the ticker ticking")
        worker = psutil.Process(_worker_pid(rt, turn))

        assert rt.pause(child, authority=me) == [turn]
        tree = worker.children(recursive=True)
        assert len(tree) > 5
        if containment == "cgroup":
            leaf = leaf_of(worker.pid)
            assert leaf is not None
            assert "frozen 1" in Path(leaf, "cgroup.events").read_text()
        eventually(lambda: all(frozen(p) for p in still_running(tree)), what="every process frozen")
        size = out.stat().st_size
        time.sleep(0.3)  # a frozen tree writes nothing: a window to show it, not a sync
        assert out.stat().st_size == size

        assert rt.resume(child, authority=me) == [turn]
        eventually(lambda: out.stat().st_size > size + 20, what="the ticker ticking again")

        rt.pause(child, authority=me)
        rt.interrupt(child, authority=me, kind="abort")  # of a frozen turn
        assert ended_turn(rt, child, turn).outcome == "aborted"
        assert still_running([worker, *tree]) == []


# ---- accounting and limits ------------------------------------------------------------


@needs_cgroup
def test_a_turns_resources_are_recorded_from_its_cgroup() -> None:
    burn = [
        sys.executable,
        "-c",
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass",
    ]
    with runtime(workers=1, containment="cgroup") as rt:
        _, child, me = family(rt)
        rt.send(child, "burn", authority=me, data=steps({"op": "tool", "argv": burn}))
        rt.wait(child, until="idle", timeout=15.0)
        rt.send(child, "rest", authority=me, data=steps({"op": "say", "text": "hi"}))
        rt.wait(child, until="idle", timeout=15.0)
        burnt, rested = rt.turns(child)
        assert burnt.resources is not None and rested.resources is not None
        assert burnt.resources["cpu_ms"] >= 250  # the tool's CPU, counted in the leaf
        assert rested.resources["cpu_ms"] < burnt.resources["cpu_ms"] / 2  # per turn
        assert ("processes" in burnt.resources) == ("pids" in _CONTROLLERS)
        assert ("memory_peak_mb" in burnt.resources) == ("memory" in _CONTROLLERS)


def test_a_limit_the_kernel_cannot_enforce_here_is_invalid_params(containment: str) -> None:
    with runtime(workers=1, containment=containment) as rt:
        root = rt.open_session(SCRIPTED)
        before = rt.list_agents(root, scope="descendants")
        refused = 0
        for key, controller in LIMIT_CONTROLLERS.items():
            if containment == "cgroup" and controller in _CONTROLLERS:
                continue
            limits: dict[str, float] = {key: 1}
            with pytest.raises(InvalidParams) as exc:
                rt.spawn(root, SCRIPTED, limits=limits)
            expected = controller if containment == "cgroup" else "cgroup containment"
            assert expected in exc.value.message
            with pytest.raises(InvalidParams):
                rt.open_session(SCRIPTED, limits=limits)
            refused += 1
        assert rt.list_agents(root, scope="descendants") == before  # nothing was opened
        if containment == "walk" or not set(LIMIT_CONTROLLERS.values()) <= _CONTROLLERS:
            assert refused > 0


@pytest.mark.parametrize(
    "limits",
    [{"memory": 5}, {"pids": 0}, {"cpu": -1}, {"memory_mb": True}, {"pids": 2.5}, [1]],
)
def test_malformed_limits_are_invalid_params(limits: Any) -> None:
    with runtime(workers=1) as rt, pytest.raises(InvalidParams):
        rt.open_session(SCRIPTED, limits=limits)


@pytest.mark.skipif("memory" not in _CONTROLLERS, reason="no cgroup v2 memory controller here")
def test_a_turn_killed_by_its_memory_limit_ends_crashed_memory_limit() -> None:
    hog = [sys.executable, "-c", "b = []\nwhile True: b.append(bytearray(2**20))"]
    with runtime(workers=1, containment="cgroup") as rt:
        _, child, me = family(rt, limits={"memory_mb": 64})
        rt.send(child, "hog", authority=me, data=steps({"op": "tool", "argv": hog}))
        rt.wait(child, until=("idle", "parked"), timeout=30.0)
        [rec] = rt.turns(child)
        assert (rec.outcome, rec.error) == ("crashed", "memory limit")


@pytest.mark.skipif("pids" not in _CONTROLLERS, reason="no cgroup v2 pids controller here")
def test_a_pids_limit_stops_a_fork_bomb_inside_the_turn_which_ends_crashed_pids_limit() -> None:
    # A real fork bomb: every process forks, forever, and tries again when refused. The
    # kernel holds it at the limit (it only refuses forks); the breach ends the turn,
    # whose tree dies with it. (A shell bomb, `b() { b & b & wait; }; b`, collapses by
    # itself within ~30 ms of its first refused fork, since sh exits on one: it raced
    # the watch, and a loaded CI run saw the turn complete first.)
    bomb = textwrap.dedent("""
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.001)
    """)
    with runtime(workers=1, containment="cgroup") as rt:
        _, child, me = family(rt, limits={"pids": 40})
        argv = [sys.executable, "-c", bomb]
        rt.send(child, "bomb", authority=me, data=steps({"op": "tool", "argv": argv}))
        turn = rt.wait(child, until="running").turn
        assert turn is not None
        worker = psutil.Process(_worker_pid(rt, turn))
        leaf = leaf_of(worker.pid)
        ended = ended_turn(rt, child, turn)
        assert (ended.outcome, ended.error) == ("crashed", "pids limit")
        eventually(lambda: not Path(leaf).exists(), what="the bomb's leaf emptied and removed")
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
        # the session lives on: its next turn runs on a new worker, and completes
        rt.send(child, "after", authority=me, data=steps({"op": "say", "text": "fine"}))
        if rt.wait(child, until=("idle", "parked"), timeout=15.0).state == "parked":
            rt.resume(child, authority=me)
        rt.wait(child, until="idle", timeout=15.0)
        assert [t.outcome for t in rt.turns(child)] == ["crashed", "completed"]


REFUSED = textwrap.dedent("""
    import os, sys
    # Children up to the limit, none reaped (a zombie still counts against pids.max),
    # until a fork is refused: the tool then exits 0 at once, so the turn's end races
    # the limit watch's notice of the refusal.
    for _ in range(int(sys.argv[1])):
        try:
            pid = os.fork()
        except OSError:
            print("refused")
            sys.stdout.flush()
            os._exit(0)
        if pid == 0:
            os._exit(0)
    os._exit(1)
""")


@pytest.mark.skipif("pids" not in _CONTROLLERS, reason="no cgroup v2 pids controller here")
def test_a_turn_whose_tool_hit_its_pids_limit_and_exited_ends_crashed_pids_limit() -> None:
    """A tool whose forks the pids limit refused, which then finished by itself, and a
    driver that returned at once: the turn's end is checked against the leaf's refused
    forks, so it ends as the limit watch ends a breach, whichever comes first (before,
    a turn that beat the watch's notice ended as its driver said: completed). Looped:
    each turn races the watch."""
    tool = [sys.executable, "-c", REFUSED, "60"]
    with runtime(workers=1, containment="cgroup") as rt:
        _, child, me = family(rt, limits={"pids": 24})
        for i in range(10):
            rt.send(child, f"fork {i}", authority=me, data=steps({"op": "tool", "argv": tool}))
            # idle had it completed; crashed, it parks until the next waking send
            rt.wait(child, until=("idle", "parked"), timeout=30.0)
            turns = rt.turns(child)
            assert len(turns) == i + 1
            last = turns[-1]
            assert (last.outcome, last.error) == ("crashed", "pids limit"), (i, last)


@pytest.mark.skipif("cpu" not in _CONTROLLERS, reason="no cgroup v2 cpu controller here")
def test_a_cpu_limit_throttles_the_turns_whole_tree() -> None:
    # A tool that would take a whole core for a second of wall time, under a tenth of one:
    # the kernel throttles the leaf (worker and tool alike), and the turn's own account
    # shows about a tenth of the wall time in CPU.
    spin = [
        sys.executable,
        "-c",
        "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0: pass",
    ]
    with runtime(workers=1, containment="cgroup") as rt:
        _, child, me = family(rt, limits={"cpu": 0.1})
        rt.send(child, "spin", authority=me, data=steps({"op": "tool", "argv": spin}))
        turn = rt.wait(child, until="running").turn
        assert turn is not None
        leaf = leaf_of(_worker_pid(rt, turn))
        assert leaf is not None
        # once the tool runs in the leaf, the turn's start (which set its limits) took
        # effect: the table names the turn's worker a moment before that, under its lock
        eventually(
            lambda: len(Path(leaf, "cgroup.procs").read_text().split()) > 1,
            what="the turn's tool in its leaf",
        )
        assert Path(leaf, "cpu.max").read_text().split() == ["10000", "100000"]
        rt.wait(child, until="idle", timeout=30.0)
        [rec] = rt.turns(child)
        assert rec.resources is not None and rec.ended_at is not None
        wall_ms = (rec.ended_at - rec.started_at) * 1000
        # unthrottled this is ~1,000 ms; throttled, a tenth of the wall time plus a period
        assert rec.resources["cpu_ms"] < 0.1 * wall_ms + 150, (rec.resources, wall_ms)


# ---- choosing containment ------------------------------------------------------------


def test_containment_says_which_path_is_in_force() -> None:
    with runtime(workers=1, containment="walk") as rt:
        assert rt.containment == "walk"
    with runtime(workers=1, containment="auto") as rt:
        assert rt.containment == ("walk" if CGROUP_MISSING else "cgroup")
    with pytest.raises(InvalidParams):
        tether.Runtime(workers=1, containment="jail")


def test_cgroup_containment_where_none_is_available_is_invalid_params_with_the_reason() -> None:
    from tether.runtime.backends.pool import Pool

    def factory(workers: int, host: Any) -> Any:
        return Pool(workers, host)

    # a backend of one's own: the runtime cannot put its workers in cgroups
    with pytest.raises(InvalidParams, match="local and Ray backends only"):
        tether.Runtime(workers=1, containment="cgroup", backend=factory)
    with runtime(workers=1, containment="auto", backend=factory) as rt:
        assert rt.containment == "walk"


def test_limits_are_stored_with_the_session_header(db_path: str) -> None:
    from tether.runtime.store import Store
    from tether.wire.records import SessionHeader

    store = Store(db_path)
    header = SessionHeader(
        id="s_1",
        parent=None,
        mode="continuable",
        slug=None,
        driver=SCRIPTED,
        limits={"memory_mb": 512.0, "pids": 64.0},
    )
    store.create_session(header).wait()
    store.close()
    store = Store(db_path)
    try:
        [back] = store.sessions()
        assert back.limits == {"memory_mb": 512.0, "pids": 64.0}
    finally:
        store.close()


# ---- over RPC and the CLI ----------------------------------------------------------------


def test_serve_takes_containment_and_refuses_unenforceable_limits_over_rpc_and_cli(
    tmp_path: Path,
) -> None:
    from tether_server import TETHER, running_server

    with running_server(tmp_path, "--containment", "walk") as server:
        answer = server.rpc("session.open", {"driver": SCRIPTED, "limits": {"memory_mb": 256}})
        assert answer["error"]["data"]["code"] == "invalid-params"
        # the walk's reason (under cgroup it would name the missing controller)
        assert "cgroup containment" in answer["error"]["message"]
        root = server.call("session.open", {"driver": SCRIPTED})["session"]
        spawn = {"parent": root, "driver": SCRIPTED, "limits": {"pids": 10}}
        assert server.rpc("subagent.spawn", spawn)["error"]["data"]["code"] == "invalid-params"
        cli = [TETHER, "open", "--limits", "memory_mb=256", "--url", server.url]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=30)
        assert done.returncode != 0 and "cgroup containment" in done.stderr
        bad = [TETHER, "open", "--limits", "disk=5", "--url", server.url]
        assert subprocess.run(bad, capture_output=True, timeout=30).returncode == 2


def test_a_stored_limit_this_host_cannot_enforce_crashes_the_turn_instead_of_ignoring_it(
    containment: str, db_path: str
) -> None:
    """Limits were checked when the session was made; a later host on the same store may
    lack the controllers. Its turns then end crashed, saying so: never run unlimited."""
    from tether.runtime.store import Store
    from tether.wire.records import SessionHeader

    missing = next(
        (k for k, c in LIMIT_CONTROLLERS.items() if containment == "walk" or c not in _CONTROLLERS),
        None,
    )
    if missing is None:
        pytest.skip("every limit's controller is available here")
    store = Store(db_path)
    header = SessionHeader(
        id="s_limited",
        parent=None,
        mode="continuable",
        slug=None,
        driver=SCRIPTED,
        limits={missing: 64.0},
    )
    store.create_session(header).wait()
    store.close()
    with runtime(db_path, workers=1, containment=containment) as rt:
        rt.prompt("s_limited", "go", data=steps({"op": "say", "text": "unlimited"}))
        rt.wait("s_limited", until=("idle", "parked"), timeout=15.0)
        [rec] = rt.turns("s_limited")
        assert rec.outcome == "crashed"
        assert rec.error is not None and "cannot be enforced" in rec.error
        assert [e.text for e in rt.transcript("s_limited") if e.kind == "assistant"] == []


def test_the_walks_orphan_sweep_never_takes_a_worker_being_started() -> None:
    """The launcher's children that are no worker are a dead worker's orphans; a worker
    the pool is starting is a launcher child not yet known, and must never be one."""
    import threading

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    seen: set[int] = set()
    stop = threading.Event()

    try:
        with runtime(workers=1, containment="walk") as rt:
            pool = local_pool(rt)

            def sweep() -> None:
                while not stop.is_set():
                    seen.update(pool.launcher.orphans() or ())

            sweeper = threading.Thread(target=sweep)
            sweeper.start()
            started: set[int] = set()
            try:
                for _ in range(40):
                    spare = eventually(lambda: pool._spare, what="a spare worker")
                    started.add(spare.pid)
                    os.kill(spare.pid, signal.SIGKILL)

                    def replaced(s: object = spare) -> bool:
                        return pool._spare is not None and pool._spare is not s

                    eventually(replaced, what="the spare replaced")
                started.update(rt.worker_pids)
            finally:
                stop.set()
                sweeper.join()
        assert seen == set(), f"workers taken for orphans: {seen & started or seen}"
    finally:
        sys.setswitchinterval(old_interval)


@needs_cgroup
def test_a_gone_in_memory_hosts_cgroup_is_emptied_and_removed_by_any_new_host() -> None:
    """An in-memory store has no successor to find its group by name: its group is named
    after its process, and any host removes it once that process is gone."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with runtime(workers=1, containment="cgroup") as rt:
        top = os.path.dirname(host_cgroups(rt).base)
    group = os.path.join(top, f"m-{gone.pid}-1-0")
    leaf = os.path.join(group, "w-left")
    os.makedirs(leaf)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        Path(leaf, "cgroup.procs").write_text(str(sleeper.pid))
        with runtime(workers=1, containment="cgroup"):
            assert not os.path.exists(group)
            assert sleeper.wait(5.0) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        with contextlib.suppress(OSError):
            os.rmdir(leaf)
            os.rmdir(group)


def test_the_v2_hierarchy_is_found_wherever_it_is_mounted(tmp_path: Path) -> None:
    from tether.contain.cgroup import v2_mount

    v1 = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
    hybrid = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"
    pure = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate"
    for lines, want in (
        ([v1, hybrid], "/sys/fs/cgroup/unified"),
        ([pure], "/sys/fs/cgroup"),
        ([v1], None),
    ):
        info = tmp_path / "mountinfo"
        info.write_text("\n".join(lines) + "\n")
        assert v2_mount(str(info)) == want
    assert v2_mount(str(tmp_path / "missing")) is None


@needs_cgroup
def test_empty_leaves_a_killed_host_left_on_a_store_nobody_reopens_are_removed() -> None:
    """Its workers killed their own leaves as their host went, but could not remove them;
    any later host removes an empty leaf once it is old, and never a populated one."""
    with runtime(workers=1, containment="cgroup") as rt:
        top = os.path.dirname(host_cgroups(rt).base)
    group = os.path.join(top, f"s-{uuid.uuid4().hex[:16]}")
    empty, busy = os.path.join(group, "w-empty"), os.path.join(group, "w-busy")
    os.makedirs(empty)
    os.makedirs(busy)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        Path(busy, "cgroup.procs").write_text(str(sleeper.pid))
        hour_ago = time.time() - 3600
        for leaf in (empty, busy):
            os.utime(leaf, (hour_ago, hour_ago))
        with runtime(workers=1, containment="cgroup"):
            assert not os.path.exists(empty)
            assert os.path.isdir(busy) and sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        for d in (busy, empty, group):
            with contextlib.suppress(OSError):
                os.rmdir(d)


def _keeper(path: str, both: Any, emptied: list[bool], errors: list[str]) -> None:
    """The Ray keeper's sweep of a dead worker's leaf: kill, then remove."""
    both.wait()
    try:
        emptied.append(kill_leaf(path))
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)
    except OSError as exc:
        errors.append(f"keeper: {exc!r}")


def _slot(leaf: Leaf, both: Any, emptied: list[bool], errors: list[str]) -> None:
    """The Ray slot's end of a dead worker: kill its leaf, then remove it."""
    both.wait()
    try:
        emptied.append(kill_leaf(leaf.path))
        leaf.remove()
    except OSError as exc:
        errors.append(f"slot: {exc!r}")


@needs_cgroup
def test_two_killers_of_one_leaf_racing_its_removal_both_see_it_emptied() -> None:
    """Under Ray a turn's leaf has two killers when its worker dies: the worker's keeper
    (kill, then remove) and the slot (kill, then remove). A control file of a leaf the
    kernel is removing says ENODEV while its directory still lists; that is "gone", not
    an error (it was one: the slot's stream raised OSError and the turn was reported as
    a lost slot, without the worker's exit code)."""
    groups = Cgroups.open(None, guard=False)
    errors: list[str] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for i in range(500):
            leaf = groups.leaf(f"race-{i}")
            leaf.create()
            sleeper = subprocess.Popen(["sleep", "60"])
            Path(leaf.file("cgroup.procs")).write_text(str(sleeper.pid))
            both = threading.Barrier(2, timeout=10)
            emptied: list[bool] = []
            threads = [
                threading.Thread(target=_keeper, args=(leaf.path, both, emptied, errors)),
                threading.Thread(target=_slot, args=(leaf, both, emptied, errors)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=20)
            assert sleeper.wait(timeout=10) == -signal.SIGKILL
            assert not errors, errors[:3]
            assert emptied == [True, True]
            assert not os.path.exists(leaf.path)
    finally:
        sys.setswitchinterval(interval)
        groups.close()


# ---- the stop report's fates: a process on its way out did not survive ----------------


def test_a_process_in_its_exit_or_a_zombie_is_reported_dead_not_survived() -> None:
    """A cgroup reads ``populated 0`` once its tasks have left it in their exit, before
    they are zombies, and a reaped process shows ``X`` while its parent reaps it: the
    stop report must call neither a survivor (a fresh-clone run caught an aborted turn's
    worker read as running the moment it was reported). The flag the check reads is the
    kernel's PF_EXITING, which a zombie keeps: shown here on real processes; the short
    window before the zombie cannot be held open from a test."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE
    )
    assert child.stdin is not None
    try:
        found: dict[int, tuple[psutil.Process, Any]] = {}
        hooks.describe([child.pid], found)
        assert not procs.exiting(child.pid)
        assert [f.fate for f in hooks.fates(found)] == ["survived"]
        child.stdin.close()  # it reads EOF and exits; left unreaped, it stays a zombie
        proc = found[child.pid][0]
        eventually(lambda: proc.status() == psutil.STATUS_ZOMBIE, what="the child a zombie")
        assert procs.exiting(child.pid) and not procs.alive(proc)
        assert [f.fate for f in hooks.fates(found)] == ["dead"]
    finally:
        child.kill()
        child.wait(5.0)
    assert not procs.exiting(child.pid)  # gone: no /proc entry
