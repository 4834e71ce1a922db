"""Issue 19 on the Ray backend: each slot's turn in a cgroup leaf of its node (semantics §15.5).

Under ``containment="cgroup"`` a slot makes a group of its own on its node and runs each
turn child in a leaf ``w-<token>`` of it; the node's reaper kills with ``cgroup.kill``
and pauses with ``cgroup.freeze``, so neither depends on ancestry or environment: the
escapee here double-forks, ``setsid``s, clears its environment, renames itself and
ignores SIGTERM. The same tests run under the walk where the walk can keep the promise.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import psutil
import pytest

import tether
from drivers import (
    Recorder,
    alive,
    cgroup_probe,
    escapee,
    escapee_procs,
    eventually,
    family,
    frozen,
    leaf_of,
    steps,
    tree_of,
)
from tether import User

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]


CGROUP_MISSING = cgroup_probe()[0]


def _ray_runtime(containment: str) -> tether.Runtime:
    return tether.Runtime(
        workers=1,
        grace=1.0,
        backend="ray",
        containment=containment,
        ray_options={"abort_timeout": 2.0},
    )


def _turn_child(rt: tether.Runtime, turn: str) -> psutil.Process:
    """The turn child running ``turn`` (the slot actor's child on this one-node cluster)."""
    from tether.runtime.backends.ray import RayBackend

    pool = rt._pool
    assert isinstance(pool, RayBackend), pool
    pid: int = eventually(
        lambda: (s := pool.turns.worker(turn)) is not None and s.child, what="the turn on a slot"
    )
    return psutil.Process(pid)


def _run_escapee(rt: tether.Runtime, token: str) -> tuple[str, str, User, psutil.Process]:
    _, child, me = family(rt, slug="child")
    argv = ["sh", "-c", escapee(token)]
    rt.send(child, "go", authority=me, data=steps({"op": "tool", "argv": argv}))
    turn = rt.wait(child, until="running", timeout=30.0).turn
    assert turn is not None
    found = eventually(lambda: escapee_procs(token), timeout=30.0, what="the escapee running")
    esc = next(p for p in found if p.cmdline()[0] == token)
    assert os.getsid(esc.pid) == esc.pid  # it left the worker's session
    assert "TETHER_TREE" not in esc.environ()
    return child, turn, me, esc


def test_a_ray_runtime_reports_the_containment_its_slots_use(ray_session: Any) -> None:
    want = "walk" if CGROUP_MISSING is not None else "cgroup"
    with _ray_runtime("auto") as rt:
        assert rt.containment == want
    with _ray_runtime("walk") as rt:
        assert rt.containment == "walk"


def test_a_ray_abort_kills_a_renamed_env_cleared_setsid_escapee_that_ignores_sigterm(
    ray_session: Any, containment: str, token: str
) -> None:
    with _ray_runtime(containment) as rt:
        assert rt.containment == containment
        rec = Recorder(rt)
        child, turn, me, esc = _run_escapee(rt, token)
        worker = _turn_child(rt, turn)
        tree = tree_of(worker)
        if containment == "cgroup":
            leaf = leaf_of(worker.pid)
            assert os.path.basename(leaf).endswith(f"w-{worker.environ()['TETHER_TREE']}")
            assert leaf_of(esc.pid) == leaf  # the escapee never left the leaf

        assert rt.interrupt(child, authority=me, kind="abort", reason="runaway") == turn
        ended = rec.turn_ended(child, timeout=10.0)
        assert (ended["outcome"], ended["reason"]) == ("aborted", "runaway")
        assert not alive(esc) and not any(alive(p) for p in tree)
        assert escapee_procs(token) == []
        if containment == "cgroup":  # the slot's next child has a leaf of its own
            eventually(lambda: not os.path.exists(leaf) or None, what="the old leaf removed")
        rt.send(child, "next", authority=me)
        assert rec.turn_ended(child, count=2, timeout=30.0)["outcome"] == "completed"


def test_a_sigkilled_ray_turn_child_leaves_no_process_of_its_turn_under_cgroup(
    ray_session: Any, token: str
) -> None:
    """The walk cannot promise this one (the escapee has left the tree and cleared the
    tag the keeper sweeps by); the leaf holds it whatever it did."""
    if CGROUP_MISSING is not None:
        pytest.skip(f"no cgroup containment here: {CGROUP_MISSING}")
    with _ray_runtime("cgroup") as rt:
        rec = Recorder(rt)
        child, turn, _me, esc = _run_escapee(rt, token)
        _turn_child(rt, turn).send_signal(signal.SIGKILL)
        assert rec.turn_ended(child, timeout=10.0)["outcome"] == "crashed"
        eventually(lambda: not alive(esc) or None, what="the escapee dead")
        assert escapee_procs(token) == []


def test_a_ray_pause_freezes_every_process_of_the_turn_and_resume_thaws_them(
    ray_session: Any, containment: str, token: str
) -> None:
    with _ray_runtime(containment) as rt:
        rec = Recorder(rt)
        child, turn, me, esc = _run_escapee(rt, token)

        # the escapee re-parented to the turn child (a subreaper): in its tree for both
        def adopted() -> list[psutil.Process] | None:
            tree = tree_of(_turn_child(rt, turn))
            return tree if esc in tree else None

        procs = eventually(adopted, what="the escapee adopted by the turn child")
        assert rt.pause(child, authority=me) == [turn]
        # (the escapee's loop starts a short sleep every 50 ms: one may be gone by now)
        eventually(lambda: all(frozen(p) for p in procs if alive(p)) or None, what="all frozen")
        rt.resume(child, authority=me)
        eventually(lambda: not any(frozen(p) for p in procs) or None, what="every process thawed")
        assert rt.pause(child, authority=me) == [turn]
        eventually(lambda: all(frozen(p) for p in procs if alive(p)) or None, what="frozen again")
        rt.interrupt(child, authority=me, kind="abort")  # an abort of a frozen turn
        assert rec.turn_ended(child, timeout=10.0)["outcome"] == "aborted"
        assert not any(alive(p) for p in procs)
        if containment == "cgroup":
            assert escapee_procs(token) == []
