"""Pause and resume (semantics §14.4) and the stall watchdog (semantics §14.5), with real workers.

Frozen means SIGSTOPped (the walk) or in a frozen cgroup (cgroup containment): every
check of "paused" looks at the processes' own state (``drivers.frozen``), and every
check of "resumed" at what the thawed turn then does.
"""

from __future__ import annotations

import time

import psutil
import pytest

import tether
from drivers import (
    HANG,
    Recorder,
    alive,
    all_frozen,
    entries,
    eventually,
    family,
    frozen,
    steps,
    texts,
    tree_of,
    wait_entry,
    worker_with_tool,
)
from tether import User

pytestmark = pytest.mark.timeout(60)

# A tool tree that outlives a short pause: sh, then a sleep under it.
SLOW_TOOL = ["sh", "-c", "sleep 1; echo out-of-the-tool; exit 3"]


def _running(procs: list[psutil.Process]) -> bool:
    return not any(frozen(p) for p in procs if alive(p))


def _markers(rt: tether.Runtime, sid: str) -> list[str]:
    return [e.action or "" for e in entries(rt, sid, "marker")]


# ---- pause / resume ------------------------------------------------------------------


def test_pause_mid_tool_stops_every_process_and_resume_finishes_the_turn_intact(
    rt: tether.Runtime,
    scripted: str,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, scripted)
    data = steps({"op": "tool", "argv": SLOW_TOOL}, {"op": "say", "text": "after the tool"})
    rt.send(child, "work", authority=me, data=data)
    worker = worker_with_tool(rt, "sleep")
    tree = tree_of(worker)
    assert len(tree) >= 3  # worker, sh, sleep

    running = rt.status(child).turn
    assert rt.pause(child, authority=me, reason="let me look") == [running]
    eventually(lambda: all_frozen(tree), timeout=2.0, what="every process of the tree stopped")
    assert rt.status(child).state == "paused"
    seen = len(rt.transcript(child))
    # Longer than the tool's own sleep: a thawed tree would have finished by now.
    time.sleep(1.3)
    assert all_frozen(tree)
    assert len(rt.transcript(child)) == seen, "the frozen turn wrote to its transcript"

    assert rt.resume(child, authority=me) == [running]
    ended = rec.turn_ended(child, timeout=10.0)
    assert ended["outcome"] == "completed"
    assert any("out-of-the-tool" in t for t in texts(rt, child, "tool"))
    assert texts(rt, child, "assistant")[-1] == "after the tool"
    assert _markers(rt, child) == ["paused", "resumed"]
    [paused, resumed] = texts(rt, child, "marker")
    assert paused == "⏸ Paused by user: let me look"
    assert resumed == "▶ Resumed by user"


def test_pause_of_a_subtree_freezes_its_running_descendants_and_leaves_a_sibling_running(
    scripted: str,
) -> None:
    with tether.Runtime(workers=3, grace=1.0) as rt:  # a worker for each hanging turn
        _subtree(rt, scripted)


def _subtree(rt: tether.Runtime, scripted: str) -> None:
    root = rt.open_session(scripted)
    a = str(rt.spawn(root, scripted, slug="a"))
    a1 = str(rt.spawn(a, scripted, slug="a1"))
    b = str(rt.spawn(root, scripted, slug="b"))
    me = User(parent=root)
    rt.send(a, "hang", authority=me, data=HANG)
    rt.send(a1, "hang", authority=User(parent=a), data=HANG)
    # the sibling writes to its transcript all the time (each failing command is an entry)
    rt.send(b, "busy", authority=me, data=steps({"op": "loop", "argv": ["false"]}))
    for sid in (a, a1, b):

        def dispatched(sid: str = sid) -> bool:
            return rt.status(sid).dispatched

        eventually(dispatched, what=f"{sid} on a worker")
    turns = {sid: rt.status(sid).turn for sid in (a, a1, b)}

    frozen = rt.pause(a, authority=me, scope="subtree", reason="inspect a's subtree")
    assert sorted(frozen) == sorted(t for sid, t in turns.items() if sid != b and t)
    assert rt.status(a).state == "paused" and rt.status(a1).state == "paused"
    assert rt.status(b).state == "running"
    seen_b = len(rt.transcript(b))
    eventually(lambda: len(rt.transcript(b)) > seen_b or None, what="the sibling to keep working")

    assert sorted(rt.resume(a, authority=me, scope="subtree")) == sorted(frozen)
    assert rt.status(a).state == "running" and rt.status(a1).state == "running"
    for sid, auth in ((a, me), (a1, User(parent=a)), (b, me)):
        rt.interrupt(sid, authority=auth, kind="abort")
        rt.wait(sid)


def test_steers_and_a_cancel_sent_while_paused_take_effect_after_resume(
    rt: tether.Runtime,
    scripted: str,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, scripted)
    rt.send(child, "hang", authority=me, data=HANG)
    rt.wait(child, until="running")
    turn = rt.status(child).turn
    rt.pause(child, authority=me)

    assert rt.interrupt(child, authority=me, kind="steer", reason="first steer") == turn
    queued = rt.send(child, "later", authority=me)  # a send queues behind the frozen turn
    assert [m.id for m in rt.inbox(child)] == [queued]
    assert rt.status(child).state == "paused"
    rt.resume(child, authority=me)
    wait_entry(rt, child, "assistant", "first steer")

    rt.pause(child, authority=me)
    rt.interrupt(child, authority=me, kind="steer", reason="discarded steer")
    assert rt.interrupt(child, authority=me, kind="cancel", reason="stop now") == turn
    assert rt.status(child).state == "paused"  # nothing happens until resume
    rt.resume(child, authority=me)
    ended = rec.turn_ended(child, timeout=10.0)
    assert (ended["turn"], ended["outcome"]) == (turn, "cancelled")
    said = texts(rt, child, "assistant")
    assert not any("discarded steer" in t for t in said)  # a stop discards pending steers
    assert said[-1].startswith("cancelled after")
    assert rt.status(child).state == "parked"
    assert [m.id for m in rt.inbox(child)] == [queued]


def test_abort_of_a_paused_turn_kills_the_frozen_tree_at_once(
    rt: tether.Runtime, scripted: str
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, scripted)
    rt.send(child, "tool", authority=me, data=steps({"op": "tool", "argv": SLOW_TOOL}))
    worker = worker_with_tool(rt, "sleep")
    tree = tree_of(worker)
    rt.pause(child, authority=me)
    eventually(lambda: all_frozen(tree), timeout=2.0, what="the tree stopped")

    rt.interrupt(child, authority=me, kind="abort", reason="enough")
    eventually(lambda: not any(alive(p) for p in tree), timeout=2.0, what="the tree dead")
    assert rec.turn_ended(child)["outcome"] == "aborted"
    assert rt.status(child).state == "parked"


def test_dispose_and_close_leave_no_process_of_a_paused_turn(db_path: str, scripted: str) -> None:
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        _root, child, me = family(rt, scripted)
        _r2, other, me2 = family(rt, scripted)
        for sid, auth in ((child, me), (other, me2)):
            rt.send(sid, "t", authority=auth, data=steps({"op": "tool", "argv": SLOW_TOOL}))
        worker_with_tool(rt, "sleep", count=1)
        trees = [tree_of(psutil.Process(pid)) for pid in rt.worker_pids]
        procs = [p for tree in trees for p in tree]
        rt.wait(child, until="running")
        rt.wait(other, until="running")
        rt.pause(child, authority=me)
        rt.pause(other, authority=me2)

        rt.dispose(child, authority=me)
        assert rt.status(child).state == "settled"
        assert rt.turns(child)[-1].outcome == "aborted"
        start = time.monotonic()
    # close() aborted the other paused turn rather than waiting out a grace it cannot use
    assert time.monotonic() - start < 5.0
    eventually(lambda: not any(alive(p) for p in procs), timeout=5.0, what="no process left")


def test_pausing_an_idle_parked_or_absent_target_is_an_accepted_no_op(
    rt: tether.Runtime,
    scripted: str,
) -> None:
    root, child, me = family(rt, scripted)
    assert rt.pause(child, authority=me) == []  # idle
    rt.send(child, "x", authority=me, wake=False)
    assert rt.status(child).state == "parked"
    assert rt.pause(child, authority=me) == []
    assert rt.resume(child, authority=me) == []
    assert rt.pause("s_no_such_session", authority=me) == []
    assert rt.pause(root, authority=User(parent=root), scope="subtree") == []
    assert _markers(rt, child) == []


def test_pause_authority_is_the_interrupts(rt: tether.Runtime, scripted: str) -> None:
    root, child, me = family(rt, scripted)
    sibling = str(rt.spawn(root, scripted))
    rt.send(child, "hang", authority=me, data=HANG)
    rt.wait(child, until="running")
    for bad in (
        User(parent="s_someone_else"),
        tether.Ancestor(rt.agent_ref(sibling)),
        tether.Ancestor(rt.agent_ref(child)),
    ):
        with pytest.raises(tether.Unauthorized):
            rt.pause(child, authority=bad)
        with pytest.raises(tether.Unauthorized):
            rt.pause(child, authority=bad, scope="subtree")
    assert rt.status(child).state == "running"
    assert rt.pause(child, authority=tether.Ancestor(rt.agent_ref(root))) != []
    with pytest.raises(tether.InvalidParams):
        rt.resume(child, authority=me, scope="everything")
    assert rt.resume(child, authority=me) != []
    rt.interrupt(child, authority=me, kind="abort")
    rt.wait(child)


# ---- the stall watchdog -----------------------------------------------------------------

STALL = {"after": 0.4, "every": 0.4, "steps": ["steer", "cancel", "abort"], "grace": 0.3}


def test_a_stalled_turn_is_nudged_then_cancelled_then_aborted_each_with_its_marker(
    rt: tether.Runtime,
    scripted: str,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, scripted, stall=STALL)
    # a call that blocks the driver (for an async one: its loop): no cancel can land
    # (an awaited hang takes the watchdog's cancel at once: tests/agent/test_async_drivers.py)
    rt.send(child, "stall", authority=me, data=steps({"op": "block", "seconds": 30}))
    ended = rec.turn_ended(child, timeout=10.0)
    assert (ended["outcome"], ended["cause"], ended["by"]) == ("aborted", "system", "watchdog")
    assert _markers(rt, child) == ["cancelled", "aborted"]  # the steer is never delivered
    steps_taken = [e.data["kind"] for e in rec.events if e.name == "watchdog.step"]
    assert steps_taken == ["steer", "cancel", "abort"]
    [cancelled, aborted] = texts(rt, child, "marker")
    assert aborted.startswith("⊘ Aborted by watchdog: no progress for")
    assert cancelled.startswith("⊘ Cancelled by watchdog: no progress for")


def test_a_nudged_turn_that_wraps_up_at_its_next_boundary_is_left_alone(
    rt: tether.Runtime,
    scripted: str,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, scripted, stall=STALL | {"nudge": "say where you are"})
    data = steps({"op": "sleep", "seconds": 0.7}, {"op": "work", "steps": 60, "every": 0.02})
    rt.send(child, "slow start", authority=me, data=data)
    ended = rec.turn_ended(child, timeout=10.0)
    assert ended["outcome"] == "completed"
    assert _markers(rt, child) == ["steered"]
    [steer] = [t for t in texts(rt, child, "assistant") if t.startswith("<steer")]
    assert 'origin="watchdog"' in steer and "say where you are" in steer
    [marker] = texts(rt, child, "marker")
    assert marker.startswith("↪ Steered by watchdog: no progress for")


def test_a_paused_turn_is_never_stepped_by_the_watchdog(rt: tether.Runtime, scripted: str) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, scripted, stall=STALL)
    rt.send(child, "hang", authority=me, data=HANG)
    rt.wait(child, until="running")
    rt.pause(child, authority=me)
    time.sleep(1.5)  # several `after`s: a watchdog that ignored the pause would have acted
    assert [e for e in rec.events if e.name == "watchdog.step"] == []
    assert rt.status(child).state == "paused"
    rt.resume(child, authority=me)
    rt.interrupt(child, authority=me, kind="abort")
    rt.wait(child)
    assert _markers(rt, child) == ["paused", "resumed", "aborted"]


def test_a_loop_of_identical_tool_calls_counts_as_no_progress(
    rt: tether.Runtime, scripted: str
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(
        rt, scripted, stall=STALL | {"repeat": 3, "steps": ["cancel", "abort"]}
    )
    rt.send(child, "loop", authority=me, data=steps({"op": "loop", "argv": ["true"]}))
    ended = rec.turn_ended(child, timeout=10.0)
    assert (ended["outcome"], ended["by"]) == ("cancelled", "watchdog")


def test_a_child_inherits_its_parents_stall_policy(rt: tether.Runtime, scripted: str) -> None:
    rec = Recorder(rt)
    root = rt.open_session(scripted, stall=STALL | {"steps": ["abort"]})
    kid = str(rt.spawn(root, scripted))
    rt.send(kid, "stall", authority=User(parent=root), data=steps({"op": "sleep", "seconds": 30}))
    ended = rec.turn_ended(kid, timeout=10.0)
    assert (ended["outcome"], ended["by"]) == ("aborted", "watchdog")


def test_a_bad_stall_policy_is_invalid_params_and_creates_nothing(
    rt: tether.Runtime, scripted: str
) -> None:
    root = rt.open_session(scripted)
    for bad in (
        {},
        {"after": 0},
        {"after": "soon"},
        {"after": 1, "steps": []},
        {"after": 1, "steps": ["explode"]},
        {"after": 1, "repeat": 1},
        {"after": 1, "nudge": ""},
        {"after": 1, "surprise": True},
    ):
        with pytest.raises(tether.InvalidParams):
            rt.spawn(root, scripted, stall=bad)
    assert rt.list_agents(root) == []


def test_a_pause_guarded_by_an_ended_turn_freezes_nothing(
    rt: tether.Runtime, scripted: str
) -> None:
    _root, child, me = family(rt, scripted)
    rt.send(child, "first", authority=me, data=HANG)
    rt.wait(child, until="running")
    first = rt.status(child).turn
    rt.interrupt(child, authority=me, kind="cancel")
    rt.wait(child)
    rt.send(child, "second", authority=me, data=HANG)
    rt.wait(child, until="running")
    assert rt.pause(child, authority=me, turn=first) == []  # a click on turn 1 is stale
    assert rt.status(child).state == "running"
    second = rt.status(child).turn
    assert rt.pause(child, authority=me, turn=second) == [second]
    rt.interrupt(child, authority=me, kind="abort")
    rt.wait(child)
