"""Async drivers (semantics §15.1): a cancel at whatever the driver awaits, shields, preempts
of the innermost tool await, run_command on the loop, one loop per worker.

The interrupt, pause and watchdog suites run on both kinds as well (the ``scripted``
fixture); these tests cover what only an async driver does. Real workers, real
subprocesses; every wait has a deadline.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import psutil
import pytest

import tether
from drivers import (
    ASYNC_SCRIPTED,
    Recorder,
    alive,
    entries,
    eventually,
    family,
    final_report,
    marker_actions,
    refilled,
    steps,
    texts,
    wait_entry,
    worker_with_tool,
)

pytestmark = pytest.mark.timeout(60)


def test_a_cancel_lands_at_an_await_in_a_long_sleep_within_a_second(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, ASYNC_SCRIPTED, root_driver=ASYNC_SCRIPTED)
    took = []
    for i in range(5):
        word = f"asleep {i}"
        data = steps({"op": "say", "text": word}, {"op": "sleep", "seconds": 60})
        rt.send(child, "sleep", authority=me, data=data)
        wait_entry(rt, child, "assistant", word)
        start = time.time()
        rt.interrupt(child, authority=me, kind="cancel", reason="now")
        ended = rec.turn_ended(child, count=i + 1, timeout=5.0)
        assert (ended["outcome"], ended["forced"], ended["escalated"]) == (
            "cancelled",
            False,
            False,
        )
        record = rt.turns(child)[-1]
        assert record.ended_at is not None
        took.append(record.ended_at - start)
        assert texts(rt, child, "assistant")[-1] == "cancelled after 2 steps: now"
    median = statistics.median(took)
    print(f"\ncancel at an await, interrupt() -> turn ended: median {median * 1000:.1f} ms")
    # The 50 ms goal is a benchmark's (cancel_inflight_p50_ms); here: far below any
    # boundary-driven stop of a 60 s sleep, robust under load.
    assert max(took) < 1.0, took


def test_a_driver_that_catches_the_cancel_ends_cancelled_with_its_wrap_up_in_the_parents_notice(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    root, child, me = family(rt, "drivers:AsyncWrapUp", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "work", authority=me)
    wait_entry(rt, child, "assistant", "ready")
    rt.interrupt(child, authority=me, kind="cancel", reason="out of time")
    ended = rec.turn_ended(child)
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
    assert texts(rt, child, "assistant")[-1] == "wrapped up: out of time"
    assert marker_actions(rt, child) == ["cancelled"]
    # the parent's ChildTurnEnded notice carries the final text
    eventually(lambda: entries(rt, root, "notice"), what="the parent's notice")
    [notice] = entries(rt, root, "notice")
    assert notice.data is not None
    assert notice.data["notice"]["partial"] == "wrapped up: out of time"
    assert notice.data["notice"]["outcome"] == "cancelled"


def test_a_cancel_arrival_hook_runs_in_the_reader_thread_while_the_loop_is_blocked(
    rt: tether.Runtime,
) -> None:
    # The driver's loop is blocked until the hook has run: a hook run on the loop would
    # wait for the 10 s block, and the turn would end after it.
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncCancelHook", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "work", authority=me)
    wait_entry(rt, child, "assistant", "ready")
    start = time.monotonic()
    rt.interrupt(child, authority=me, kind="cancel", reason="now")
    ended = rec.turn_ended(child, timeout=10.0)
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
    assert time.monotonic() - start < 5.0
    said = texts(rt, child, "assistant")
    assert said[1] == "hook ran in tether-worker-reader; main is MainThread", said


def test_a_shield_holds_the_cancel_until_the_block_exits() -> None:
    with tether.Runtime(workers=1, grace=5.0) as rt:
        rec = Recorder(rt)
        _root, child, me = family(rt, "drivers:AsyncShielded", root_driver=ASYNC_SCRIPTED)
        rt.send(child, "work", authority=me, data={"hold": 0.6})
        wait_entry(rt, child, "assistant", "shielded")
        start = time.monotonic()
        rt.interrupt(child, authority=me, kind="cancel", reason="stop")
        ended = rec.turn_ended(child, timeout=10.0)
        assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
        # the block ran to its end before the cancel was raised, right after it
        assert texts(rt, child, "assistant")[-2:] == ["shield done", "after shield"]
        assert time.monotonic() - start < 4.0


def test_a_shield_that_outlasts_grace_is_force_broken(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncShielded", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "work", authority=me, data={"hold": 30})
    wait_entry(rt, child, "assistant", "shielded")
    start = time.monotonic()
    rt.interrupt(child, authority=me, kind="cancel", reason="stop")
    ended = rec.turn_ended(child, timeout=10.0)
    assert time.monotonic() - start >= 0.9 * rt.grace
    assert (ended["outcome"], ended["forced"]) == ("cancelled", True)
    assert marker_actions(rt, child) == ["cancelled", "forced"]
    refilled(rt)


def test_a_preempt_stops_only_the_innermost_tool_await_and_the_turn_goes_on(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncPreemptable", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "work", authority=me)
    wait_entry(rt, child, "assistant", "calling")
    rt.interrupt(child, authority=me, kind="preempt", reason="too slow")
    ended = rec.turn_ended(child)
    assert ended["outcome"] == "completed"
    said = texts(rt, child, "assistant")
    assert said[-2].startswith("preempted by user: too slow after ")
    assert said[-1] == "went on"
    [marker] = entries(rt, child, "marker")
    assert (marker.action, marker.reason) == ("preempted", "too slow")


def test_a_preempt_of_a_never_tool_is_a_no_op_and_the_call_finishes(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncPreemptable", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "work", authority=me, data={"preempt": "never", "seconds": 0.8})
    wait_entry(rt, child, "assistant", "calling")
    rt.interrupt(child, authority=me, kind="preempt", reason="try me")
    ended = rec.turn_ended(child, timeout=5.0)
    assert ended["outcome"] == "completed"
    assert texts(rt, child, "assistant")[-2:] == ["tool finished", "went on"]
    assert marker_actions(rt, child) == []  # nothing was preempted


def test_a_cancel_during_a_never_tool_waits_for_the_call(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncPreemptable", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "work", authority=me, data={"preempt": "never", "seconds": 0.6})
    wait_entry(rt, child, "assistant", "calling")
    rt.interrupt(child, authority=me, kind="cancel", reason="later")
    ended = rec.turn_ended(child, timeout=5.0)
    # the call ran to its end inside the shield; the cancel landed right after it
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
    assert "tool finished" in texts(rt, child, "assistant")


def test_async_run_command_kills_what_the_command_left_and_spares_the_workers_older_children(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncLeftovers", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "go", authority=me)
    assert rec.turn_ended(child)["outcome"] == "completed"
    report = json.loads(texts(rt, child, "assistant")[-1])
    assert report["survived"] is True  # a child from before the command was left alone
    try:
        left = psutil.Process(report["left"])
    except psutil.NoSuchProcess:
        return  # killed and reaped
    assert not alive(left)


def test_a_cancel_deadline_escalates_when_an_async_driver_blocks_its_loop(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, ASYNC_SCRIPTED, root_driver=ASYNC_SCRIPTED)
    # said inside the block step: a cancel can no longer land at the boundary before it
    data = steps({"op": "block", "seconds": 30, "say": "blocking"})
    rt.send(child, "block", authority=me, data=data)
    wait_entry(rt, child, "assistant", "blocking")
    rt.interrupt(child, authority=me, kind="cancel", reason="wrap up", deadline=0.3)
    ended = rec.turn_ended(child, timeout=5.0)
    assert (ended["outcome"], ended["escalated"], ended["forced"]) == ("aborted", True, False)
    assert marker_actions(rt, child) == ["cancelled", "escalated"]
    refilled(rt)


def test_the_watchdogs_cancel_lands_at_the_await_of_a_stalled_async_turn(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    stall = {"after": 0.4, "every": 0.4, "steps": ["cancel", "abort"]}
    _root, child, me = family(rt, ASYNC_SCRIPTED, root_driver=ASYNC_SCRIPTED, stall=stall)
    rt.send(child, "stall", authority=me, data=steps({"op": "sleep", "seconds": 30}))
    ended = rec.turn_ended(child, timeout=10.0)
    assert (ended["outcome"], ended["cause"], ended["by"]) == ("cancelled", "system", "watchdog")
    assert marker_actions(rt, child) == ["cancelled"]
    assert texts(rt, child, "assistant")[-1].startswith("cancelled after")


def test_peeking_at_pending_steers_neither_takes_them_nor_hides_a_stall_from_the_watchdog(
    rt: tether.Runtime,
) -> None:
    # The driver looks every 20 ms: the watchdog still steers it after 0.4 s without
    # progress, the steer stays pending (the driver sees it, no marker is written), and
    # the next step cancels it.
    rec = Recorder(rt)
    stall = {"after": 0.4, "every": 0.4, "steps": ["steer", "cancel"], "nudge": "still there?"}
    _root, child, me = family(
        rt, "drivers:AsyncSteerPeeker", root_driver=ASYNC_SCRIPTED, stall=stall
    )
    rt.send(child, "watch", authority=me)
    ended = rec.turn_ended(child, timeout=10.0)
    assert (ended["outcome"], ended["cause"], ended["by"]) == ("cancelled", "system", "watchdog")
    assert marker_actions(rt, child) == ["cancelled"]  # the steer was seen, never delivered
    [peeked] = [t for t in texts(rt, child, "assistant") if t.startswith("peeked: ")]
    assert [t.endswith("still there?") for t in json.loads(peeked.removeprefix("peeked: "))] == [
        True
    ]


def test_a_steer_reported_delivered_gets_its_marker_where_the_driver_said_and_only_once(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncSteerPeeker", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "watch", authority=me, data={"deliver": True})
    wait_entry(rt, child, "assistant", "watching")
    rt.interrupt(child, authority=me, kind="steer", reason="turn left")
    assert rec.turn_ended(child)["outcome"] == "completed"
    said = [e.action or e.text for e in rt.transcript(child) if e.kind != "user"]
    assert said[:4] == ["watching", "before", "steered", "after"], said
    report = json.loads(said[-1])
    assert report == {"first": ["turn left"], "again": [], "left": []}


def test_an_async_worker_keeps_one_event_loop_for_all_its_turns() -> None:
    with tether.Runtime(workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _root, child, me = family(rt, "drivers:AsyncLoopId", root_driver=ASYNC_SCRIPTED)
        for i in range(3):
            rt.send(child, f"turn {i}", authority=me)
            rec.turn_ended(child, count=i + 1)
        assert len(set(texts(rt, child, "assistant"))) == 1


def test_an_async_host_tool_call_does_not_block_the_loop(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    root, child, me = family(rt, "drivers:AsyncCallTool", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "call", authority=me, data={"tool": "list_agents", "args": {}})
    assert rec.turn_ended(child)["outcome"] == "completed"
    report = json.loads(texts(rt, child, "assistant")[-1])
    assert report == {"result": {"agents": []}, "ticked": True}
    rt.send(child, "bad", authority=me, data={"tool": "list_agents", "args": {"scope": "all"}})
    rec.turn_ended(child, count=2)
    report = json.loads(texts(rt, child, "assistant")[-1])
    assert report["result"]["error"] == "invalid-params"
    assert root


@pytest.mark.timeout(120)
def test_a_cancel_racing_an_async_turns_start_always_lands_on_that_turn(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, ASYNC_SCRIPTED, root_driver=ASYNC_SCRIPTED)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for i in range(60):
            rt.send(child, f"race {i}", authority=me, data=steps({"op": "hang"}))
            turn = rt.interrupt(child, authority=me, kind="cancel", reason=f"race {i}")
            ended = rec.turn_ended(child, count=i + 1, timeout=10.0)
            assert (ended["turn"], ended["outcome"], ended["forced"]) == (turn, "cancelled", False)
    finally:
        sys.setswitchinterval(old)
    assert all(t.outcome == "cancelled" for t in rt.turns(child))
    assert marker_actions(rt, child) == ["cancelled"] * 60


@pytest.mark.timeout(180)
def test_a_deadline_racing_the_delivery_at_an_await_ends_the_turn_one_way_or_the_other(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, ASYNC_SCRIPTED, root_driver=ASYNC_SCRIPTED)
    seen = set()
    for i in range(25):
        data = steps({"op": "say", "text": f"up {i}"}, {"op": "sleep", "seconds": 60})
        rt.send(child, "race", authority=me, data=data)
        wait_entry(rt, child, "assistant", f"up {i}")
        rt.interrupt(child, authority=me, kind="cancel", reason="race", deadline=0.001)
        ended = rec.turn_ended(child, count=i + 1, timeout=10.0)
        # delivered first: cancelled, never escalated; else the escalation's abort
        assert (ended["outcome"], ended["escalated"]) in (("cancelled", False), ("aborted", True))
        seen.add(ended["outcome"])
        refilled(rt)
    actions = marker_actions(rt, child)
    assert actions.count("escalated") == sum(t.outcome == "aborted" for t in rt.turns(child))
    print(f"\noutcomes seen: {sorted(seen)}")


def test_a_cancel_at_an_await_is_reported_cancel_at_await_with_the_command_it_cut(
    rt: tether.Runtime,
) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, ASYNC_SCRIPTED, root_driver=ASYNC_SCRIPTED)
    rt.send(child, "tool", authority=me, data=steps({"op": "tool", "argv": ["sleep", "30"]}))
    worker_with_tool(rt, "sleep")
    turn = rt.interrupt(child, authority=me, kind="cancel", reason="stop")
    assert turn is not None and rec.turn_ended(child)["outcome"] == "cancelled"
    report = final_report(rt, turn)
    assert (report.via, report.outcome) == ("cancel-at-await", "cancelled")
    assert [(t.name, t.fate) for t in report.tools] == [("run_command", "cancelled")]


def test_a_preempted_tool_await_is_reported_with_its_fate(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncPreemptable", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "work", authority=me)
    wait_entry(rt, child, "assistant", "calling")
    turn = rt.interrupt(child, authority=me, kind="preempt", reason="too slow")
    assert turn is not None and rec.turn_ended(child)["outcome"] == "completed"
    report = final_report(rt, turn)
    assert (report.kind, report.via) == ("preempt", "cancel-at-await")
    assert [(t.name, t.fate) for t in report.tools] == [("slow", "preempted")]


def test_an_async_driver_reads_its_history_with_or_without_awaiting(rt: tether.Runtime) -> None:
    rec = Recorder(rt)
    _root, child, me = family(rt, "drivers:AsyncHistory", root_driver=ASYNC_SCRIPTED)
    rt.send(child, "first", authority=me)
    rec.turn_ended(child)
    rt.send(child, "second", authority=me)
    rec.turn_ended(child, count=2)
    report = json.loads(texts(rt, child, "assistant")[-1])
    assert report["same"] is True
    assert report["history"][:2] == [["user", "first"], ["assistant", report["history"][1][1]]]
    assert report["history"][-1] == ["user", "second"]
