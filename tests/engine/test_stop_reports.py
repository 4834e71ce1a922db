"""Issue 19, items 4 and 5: a durable report of what each stop did (semantics §15.6), and
subtree stops (a cancel or an abort of every running turn below a session).

Real worker processes and tool subprocesses throughout; every wait is on state or
events, with a deadline. The tests that check the processes a kill lists need an
executor that reports how it killed a tree (``TurnOver.via`` and ``processes``: the
containment work of issue 19, item 1): on one that does not (``via`` None), they skip
and say so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

import tether
from drivers import (
    SCRIPTED,
    alive,
    ended_turn,
    eventually,
    family,
    final_report,
    runtime,
    spawn_child,
    steps,
    tree_of,
    worker_with_tool,
)
from tether import Ancestor, User
from tether_server import TETHER, running_server

HANG_OP = {"op": "hang"}
HANG = steps(HANG_OP)
SH_TREE = ["sh", "-c", "sleep 300 & sleep 300; wait"]
CALLER = "drivers:ToolCaller"  # plays a model: makes the tool calls its message lists
NO_PROCS = "this executor does not report how it killed a tree (TurnOver.via): cgroup branch"


def _check_times(r: tether.StopReport) -> None:
    assert r.effective_at is not None and r.latency_ms is not None
    assert r.requested_at <= r.effective_at
    assert r.latency_ms == pytest.approx((r.effective_at - r.requested_at) * 1000, abs=0.01)


# ---- one report per kind ---------------------------------------------------------------------


def test_a_cancel_taken_at_a_boundary_reports_when_it_landed_and_the_tool_it_found_open(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    rt.send(kid, "go", authority=me, data=steps({"op": "tool", "argv": ["sleep", "1.5"]}, HANG_OP))
    worker_with_tool(rt, "sleep")  # the command runs: the cancel finds it open
    turn = rt.interrupt(kid, authority=me, kind="cancel", reason="wrong approach")
    assert turn is not None
    # Written at acceptance: who and when, before it has taken effect.
    first = rt.stop_report(turn)
    assert first is not None
    assert (first.kind, first.origin, first.by, first.reason) == (
        "cancel",
        "user",
        "user",  # a person who gave no name: never the parent address they presented
        "wrong approach",
    )
    assert first.outcome is None and first.effective_at is None

    record = ended_turn(rt, kid, turn)
    r = final_report(rt, turn)
    assert (r.turn, r.session, r.outcome, r.via) == (turn, kid, "cancelled", "boundary")
    assert not r.forced and not r.escalated and r.processes == []
    assert r.requested_at == first.requested_at
    _check_times(r)
    # The boundary came only after the command returned (about 1.5 s after it started).
    assert r.effective_at is not None and record.ended_at is not None
    assert r.effective_at <= record.ended_at
    assert [(t.name, t.fate) for t in r.tools] == [("run_command", "returned")]
    assert r.partial is not None and "cancelled after" in r.partial


def test_a_force_broken_cancel_reports_the_kill_as_its_effect_not_the_boundary_it_ignored(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    rt.send(
        kid,
        "stubborn",
        authority=me,
        data=steps({"op": "ignore_cancel"}, {"op": "say", "text": "ignoring"}, HANG_OP),
    )
    eventually(lambda: any(e.text == "ignoring" for e in rt.transcript(kid)), what="ignoring")
    turn = rt.interrupt(kid, authority=me, kind="cancel", reason="stop", grace=0.3)
    assert turn is not None
    record = ended_turn(rt, kid, turn)
    r = final_report(rt, turn)
    assert (r.outcome, r.forced, r.escalated) == ("cancelled", True, False)
    assert record.forced
    _check_times(r)
    # The boundary handed the cancel over and the driver ignored it: the turn went on
    # until the grace ran out and its tree was killed. That kill is the effect.
    if r.via is None:
        pytest.skip(NO_PROCS)
    assert r.via in ("cgroup", "walk")
    assert r.latency_ms is not None and r.latency_ms >= 300
    assert r.effective_at is not None and record.ended_at is not None
    assert r.effective_at <= record.ended_at
    assert r.processes and all(p.fate == "dead" for p in r.processes)
    assert r.partial == "ignoring"


def _forced_async_cancel(rt: tether.Runtime, driver: str, data: dict[str, Any]) -> None:
    """An async turn whose cancel reaches it at an await held by a shield that outlasts
    the grace: the report names the kill, not the moment the cancel reached the await."""
    _, kid, me = family(rt, driver, root_driver=SCRIPTED, root_slug="lead", slug="kid")
    rt.send(kid, "work", authority=me, data=data)
    said = "calling" if driver == "drivers:AsyncPreemptable" else "shielded"
    eventually(lambda: any(e.text == said for e in rt.transcript(kid)), what=said)
    turn = rt.interrupt(kid, authority=me, kind="cancel", reason="stop", grace=0.5)
    assert turn is not None
    record = ended_turn(rt, kid, turn)
    r = final_report(rt, turn)
    assert (r.outcome, r.forced, r.escalated) == ("cancelled", True, False)
    assert record.forced
    _check_times(r)
    assert r.via != "cancel-at-await"
    if r.via is None:
        pytest.skip(NO_PROCS)
    assert r.via in ("cgroup", "walk")
    assert r.latency_ms is not None and r.latency_ms >= 500
    assert r.effective_at is not None and record.ended_at is not None
    assert r.effective_at <= record.ended_at
    assert r.processes and all(p.fate == "dead" for p in r.processes)


def test_a_forced_cancel_of_a_never_preemptable_call_reports_the_kill_not_the_await(
    rt: tether.Runtime,
) -> None:
    _forced_async_cancel(rt, "drivers:AsyncPreemptable", {"preempt": "never", "seconds": 60})


def test_a_forced_cancel_of_a_shield_reports_the_kill_not_the_await(rt: tether.Runtime) -> None:
    _forced_async_cancel(rt, "drivers:AsyncShielded", {"hold": 60})


def test_a_cancel_a_never_call_held_back_reports_its_effect_when_the_call_returned(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(
        rt, "drivers:AsyncPreemptable", root_driver=SCRIPTED, root_slug="lead", slug="kid"
    )
    rt.send(kid, "work", authority=me, data={"preempt": "never", "seconds": 0.8})
    eventually(lambda: any(e.text == "calling" for e in rt.transcript(kid)), what="calling")
    turn = rt.interrupt(kid, authority=me, kind="cancel", reason="later", grace=10.0)
    assert turn is not None
    record = ended_turn(rt, kid, turn)
    r = final_report(rt, turn)
    assert (r.outcome, r.forced, r.escalated, r.via) == (
        "cancelled",
        False,
        False,
        "cancel-at-await",
    )
    _check_times(r)
    # The call (a 0.8 s sleep begun after "calling") ran on inside its shield; the
    # cancel took effect once it had returned, not when it reached the await.
    calling = next(e for e in rt.transcript(kid) if e.text == "calling")
    assert r.effective_at is not None and record.ended_at is not None
    assert calling.created_at + 0.7 <= r.effective_at <= record.ended_at
    assert [(t.name, t.fate) for t in r.tools] == [("slow", "returned")]  # it ran to its end


def test_a_cancel_escalated_by_its_deadline_reports_the_kill_as_its_effect(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    # Wedged in a command: no boundary comes before the deadline.
    rt.send(kid, "wedge", authority=me, data=steps({"op": "tool", "argv": ["sleep", "60"]}))
    worker_with_tool(rt, "sleep")
    turn = rt.interrupt(kid, authority=me, kind="cancel", reason="late", deadline=0.3)
    assert turn is not None
    ended_turn(rt, kid, turn)
    r = final_report(rt, turn)
    assert (r.kind, r.outcome, r.escalated, r.forced) == ("cancel", "aborted", True, False)
    _check_times(r)
    assert r.latency_ms is not None and r.latency_ms >= 300
    assert [(t.name, t.fate) for t in r.tools] == [("run_command", "killed")]


def test_an_abort_reports_the_tool_call_it_killed(rt: tether.Runtime) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    rt.send(kid, "wedge", authority=me, data=steps({"op": "tool", "argv": SH_TREE}))
    worker_with_tool(rt, "sleep", count=2)
    turn = rt.interrupt(kid, authority=me, kind="abort", reason="stuck")
    assert turn is not None
    ended_turn(rt, kid, turn)
    r = final_report(rt, turn)
    assert (r.kind, r.outcome, r.reason) == ("abort", "aborted", "stuck")
    _check_times(r)
    assert [(t.name, t.fate) for t in r.tools] == [("run_command", "killed")]


def test_an_abort_lists_every_process_the_test_started_and_each_is_dead(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    rt.send(kid, "wedge", authority=me, data=steps({"op": "tool", "argv": SH_TREE}))
    worker = worker_with_tool(rt, "sleep", count=2)
    procs = tree_of(worker)  # the worker, sh and its two sleeps
    started = {p.pid: p.create_time() for p in procs}
    turn = rt.interrupt(kid, authority=me, kind="abort", reason="stuck")
    assert turn is not None
    ended_turn(rt, kid, turn)
    r = final_report(rt, turn)
    if r.via is None:
        pytest.skip(NO_PROCS)
    assert r.via in ("cgroup", "walk")
    listed = {p.pid: p for p in r.processes}
    assert set(started) <= set(listed), (started, r.processes)
    for pid, when in started.items():
        fate = listed[pid]
        assert fate.fate == "dead" and fate.signal
        assert fate.started == pytest.approx(when, abs=0.05)  # the same process, not a reuse
    assert not any(alive(p) for p in procs)
    assert any(p.argv[:2] == ["sh", "-c"] for p in r.processes)


def test_a_preempt_reports_the_tool_call_it_cut_and_the_turn_goes_on(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    rt.send(
        kid,
        "go",
        authority=me,
        data=steps({"op": "tool", "argv": ["sleep", "300"]}, {"op": "say", "text": "went on"}),
    )
    worker_with_tool(rt, "sleep")
    turn = rt.interrupt(kid, authority=me, kind="preempt", reason="too slow")
    assert turn is not None
    record = ended_turn(rt, kid, turn)
    assert record.outcome == "completed"
    r = final_report(rt, turn)
    assert (r.kind, r.origin, r.reason, r.via, r.outcome) == (
        "preempt",
        "user",
        "too slow",
        "walk",
        "completed",
    )
    _check_times(r)
    assert [(t.name, t.fate) for t in r.tools] == [("run_command", "preempted")]
    assert r.partial == "went on"


def test_a_watchdog_step_leaves_a_report_of_origin_watchdog(rt: tether.Runtime) -> None:
    root = rt.open_session(SCRIPTED)
    kid = spawn_child(rt, root, stall={"after": 0.3, "steps": ["cancel"]})
    me = User(parent=root)
    # No progress for a second (the watchdog cancels), then a boundary that takes it.
    rt.send(kid, "go", authority=me, data=steps({"op": "sleep", "seconds": 1.0}, HANG_OP))
    info = rt.wait(kid, until="parked", timeout=15.0)
    assert info.state == "parked"
    turn = rt.turns(kid)[-1].id
    r = final_report(rt, turn)
    assert (r.kind, r.origin, r.by, r.outcome, r.via) == (
        "cancel",
        "watchdog",
        "watchdog",
        "cancelled",
        "boundary",
    )
    assert r.reason.startswith("no progress for")
    _check_times(r)


@pytest.mark.timeout(120)
def test_a_stop_racing_a_turns_natural_end_always_leaves_a_complete_report(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        bound = 0
        for n in range(100):
            rt.send(kid, f"quick {n}", authority=me)  # ends at once, by itself
            kind = "cancel" if n % 2 else "abort"
            turn = rt.interrupt(kid, authority=me, kind=kind, reason=f"race {n}")
            info = rt.wait(kid)
            last = rt.turns(kid)[-1]
            if turn is None:  # the turn had ended (or not started): nothing was stopped
                assert rt.stop_report(last.id) is None
                assert last.outcome == "completed"
            else:
                bound += 1
                r = final_report(rt, turn)
                assert (r.kind, r.reason) == (kind, f"race {n}")
                assert r.outcome == ("cancelled" if kind == "cancel" else "aborted")
                assert r.outcome == last.outcome and last.id == turn
                _check_times(r)
            if info.state == "parked":
                rt.send(kid, "wake", authority=me)
                rt.wait(kid)
    finally:
        sys.setswitchinterval(old)
    assert bound > 0  # the race was run, not only lost


def test_no_report_for_a_turn_no_stop_reached(rt: tether.Runtime) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    rt.send(kid, "plain", authority=me)
    rt.wait(kid)
    done = rt.turns(kid)[-1]
    assert done.outcome == "completed" and rt.stop_report(done.id) is None
    # A steer is no stop, and a pause and resume stop nothing either.
    rt.send(kid, "go", authority=me, data=HANG)
    turn = rt.wait(kid, until="running").turn
    assert turn is not None
    assert rt.interrupt(kid, authority=me, kind="steer", reason="look left") == turn
    assert rt.pause(kid, authority=me) == [turn]
    assert rt.resume(kid, authority=me) == [turn]
    eventually(
        lambda: any(e.action == "steered" for e in rt.transcript(kid)), what="the steer's marker"
    )
    assert rt.stop_report(turn) is None
    assert rt.stop_report("t_nosuchturn") is None
    with pytest.raises(tether.InvalidParams):
        rt.stop_report(17)  # type: ignore[arg-type]
    rt.interrupt(kid, authority=me, kind="abort")


def test_a_stop_report_survives_a_restart_on_the_same_store(db_path: str) -> None:
    with runtime(db_path, workers=1, grace=1.0) as rt:
        _, kid, me = family(rt, root_slug="lead", slug="kid")
        rt.send(kid, "wedge", authority=me, data=steps({"op": "tool", "argv": ["sleep", "300"]}))
        worker_with_tool(rt, "sleep")
        turn = rt.interrupt(kid, authority=me, kind="abort", reason="before the restart")
        assert turn is not None
        before = final_report(rt, turn)
    with runtime(db_path, workers=1, grace=1.0) as again:
        assert again.stop_report(turn) == before
        assert before.reason == "before the restart" and before.outcome == "aborted"


# ---- RPC, CLI and the model tool -----------------------------------------------------------


def test_rpc_and_cli_return_the_report(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        root = server.call("session.open", {"driver": SCRIPTED, "slug": "lead"})["session"]
        params = {"parent": root, "driver": SCRIPTED, "prompt": "work", "data": HANG}
        kid = server.call("subagent.spawn", params)["session"]
        turn = server.wait_state(kid, "running")["turn"]
        address = {"session": kid, "parent": root}
        answer = server.call(
            "subagent.interrupt", {"address": address, "kind": "cancel", "reason": "enough"}
        )
        assert answer == {"accepted": True, "turn": turn}
        server.wait_state(kid, "parked")

        def complete() -> dict[str, Any] | None:
            got: dict[str, Any] = server.call("subagent.stopReport", {"turn": turn})["report"]
            return got if got is not None and got["outcome"] is not None else None

        report = eventually(complete, timeout=10.0, what="the complete report over RPC")
        assert report["kind"] == "cancel" and report["by"] == "user"  # no name given
        assert report["outcome"] == "cancelled" and report["via"] == "boundary"
        assert server.call("subagent.stopReport", {"turn": "t_none"}) == {"report": None}
        refused = server.rpc("subagent.stopReport", {"turn": turn, "session": kid})
        assert refused["error"]["data"]["code"] == "invalid-params"

        def cli(*args: str) -> str:
            done = subprocess.run(
                [TETHER, *args, "--url", server.url], capture_output=True, text=True, timeout=30
            )
            assert done.returncode == 0, done.stderr
            return done.stdout

        text = cli("report", turn)
        assert f"{turn} ({kid}): cancel by user: enough" in text
        assert "via boundary" in text and "outcome    cancelled" in text
        assert json.loads(cli("report", turn, "--json")) == {"report": report}
        assert cli("report", "t_none").strip() == "no stop reached t_none"


def _said(rt: tether.Runtime, sid: str) -> list[dict[str, Any]]:
    return [json.loads(e.text) for e in rt.transcript(sid) if e.kind == "assistant"]


def _calls(*calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"calls": [[name, args] for name, args in calls]}


def test_the_stop_report_tool_reads_only_the_callers_own_subtree(rt: tether.Runtime) -> None:
    root = rt.open_session(CALLER, slug="root")
    a = spawn_child(rt, root, CALLER, slug="a")
    b = spawn_child(rt, root, CALLER, slug="b")
    a1 = spawn_child(rt, a, CALLER, slug="a1")
    wedge = _calls(("run_command", {"argv": ["sleep", "300"]}))
    rt.send(a1, "wedge", authority=User(parent=a), data=wedge)
    worker_with_tool(rt, "sleep")
    turn = rt.interrupt(a1, authority=User(parent=a), kind="abort", reason="cut")
    assert turn is not None
    report = msgspec.to_builtins(final_report(rt, turn))
    ask = _calls(("stop_report", {"turn": turn}), ("stop_report", {"turn": "t_none"}))
    for sid, parent in ((a, root), (b, root), (a1, a)):
        rt.send(sid, "read", authority=User(parent=parent), data=ask)
    for sid in (a, b, a1):

        def answered(s: str = sid) -> bool:
            return len(_said(rt, s)) == 2

        eventually(answered, timeout=10.0, what=f"{sid}'s answers")
    got_a, none_a = _said(rt, a)
    assert got_a["report"]["turn"] == turn and got_a["report"]["kind"] == "abort"
    assert got_a["report"]["tools"] == [{"name": "run_command", "fate": "killed", "call": None}]
    assert got_a["report"] == report
    assert none_a == {"report": None}
    assert _said(rt, a1)[0]["report"]["turn"] == turn  # its own turn
    refused = _said(rt, b)[0]  # a sibling's turn
    assert refused["error"] == "subagent-unauthorized"


# ---- subtree stops -----------------------------------------------------------------------------


def _tree(rt: tether.Runtime, me_root: str) -> dict[str, str]:
    """root ─ a ─ a1, root ─ b ─ b1: each running a command (a sh with two sleeps)."""
    ids = {"root": me_root}
    ids["a"] = spawn_child(rt, me_root, slug="a")
    ids["b"] = spawn_child(rt, me_root, slug="b")
    ids["a1"] = spawn_child(rt, ids["a"], slug="a1")
    ids["b1"] = spawn_child(rt, ids["b"], slug="b1")
    return ids


def _sleeps(rt: tether.Runtime, count: int) -> list[psutil.Process] | None:
    found = []
    for pid in rt.worker_pids:
        try:
            found += [p for p in tree_of(psutil.Process(pid))[1:] if p.name() == "sleep"]
        except psutil.NoSuchProcess:
            continue
    found = [p for p in found if alive(p)]
    return found if len(found) >= count else None


def _parent_of(rt: tether.Runtime, sid: str, root: str) -> User:
    parent = rt.status(sid).parent
    return User(parent=parent if parent is not None else root)


@pytest.mark.timeout(90)
def test_a_subtree_abort_of_a_three_level_tree_stops_every_running_turn_and_leaves_no_process() -> (
    None
):
    with runtime(workers=6, grace=1.0) as rt:
        root = rt.open_session(SCRIPTED, slug="root")
        ids = _tree(rt, root)
        wedge = steps({"op": "tool", "argv": SH_TREE})
        for name, sid in ids.items():
            rt.send(sid, f"wedge {name}", authority=_parent_of(rt, sid, root), data=wedge)
        # A one-shot below is the holder's, not the subtree's: it is left running.
        one = rt.spawn(ids["a"], SCRIPTED, mode="one-shot", prompt="hold", data=HANG)
        assert isinstance(one, tether.OneShot)
        running = {sid: rt.wait(sid, until="running").turn for sid in ids.values()}
        assert None not in running.values()
        eventually(
            lambda: all(rt.status(sid).dispatched for sid in ids.values()), what="all dispatched"
        )
        sleeps = eventually(
            lambda: _sleeps(rt, 10), timeout=15.0, what="two sleeps under each of the 5 turns"
        )

        turns = rt.interrupt(
            root, authority=User(parent=root), kind="abort", reason="all of it", scope="subtree"
        )
        assert turns[0] == running[root]  # the target's own first, then pre-order
        assert sorted(turns) == sorted(t for t in running.values() if t is not None)
        for sid, turn in running.items():
            assert turn is not None
            rec = ended_turn(rt, sid, turn)
            assert (rec.outcome, rec.cause, rec.by, rec.reason) == (
                "aborted",
                "user",
                "user",  # a person who gave no name
                "all of it",
            )
            r = final_report(rt, turn)
            assert (r.kind, r.session, r.outcome) == ("abort", sid, "aborted")
            assert [(t.name, t.fate) for t in r.tools] == [("run_command", "killed")]
        eventually(lambda: not any(alive(p) for p in sleeps), what="every sleep dead")
        assert rt.status(one.id).state == "running"  # skipped
        one.kill()
        rt.wait(one.id, until="settled")


def test_a_subtree_cancel_binds_each_stop_to_its_own_turn_and_skips_idle_sessions(
    rt: tether.Runtime,
) -> None:
    _, kid, me = family(rt, root_slug="lead", slug="kid")
    grand = spawn_child(rt, kid, slug="grand")
    idle = spawn_child(rt, kid, slug="idle")
    rt.send(kid, "go", authority=me, data=HANG)
    rt.send(grand, "go", authority=User(parent=kid), data=HANG)
    mine = rt.wait(kid, until="running").turn
    theirs = rt.wait(grand, until="running").turn
    # A guard naming a turn that is not the target's stops the target's nothing, but
    # the subtree below is still stopped.
    old = "t_" + "0" * 32
    assert rt.interrupt(kid, authority=me, kind="cancel", scope="subtree", turn=old) == [theirs]
    rt.wait(grand, until="parked")
    rt.send(grand, "again", authority=User(parent=kid), data=HANG)
    theirs2 = rt.wait(grand, until="running").turn
    turns = rt.interrupt(kid, authority=me, kind="cancel", reason="wrap up", scope="subtree")
    assert turns == [mine, theirs2]
    for sid, turn in ((kid, mine), (grand, theirs), (grand, theirs2)):
        assert turn is not None
        assert ended_turn(rt, sid, turn).outcome == "cancelled"
        assert final_report(rt, turn).via == "boundary"
    assert rt.status(idle).state == "idle"
    assert rt.interrupt(kid, authority=me, kind="abort", scope="subtree") == []


def test_a_subtree_stop_is_authorized_once_at_its_top(rt: tether.Runtime) -> None:
    root, kid, me = family(rt, root_slug="lead", slug="kid")
    grand = spawn_child(rt, kid, slug="grand")
    with pytest.raises(tether.Unauthorized):
        rt.interrupt(kid, authority=User(parent=grand), kind="abort", scope="subtree")
    with pytest.raises(tether.Unauthorized):  # a session cannot stop its own subtree
        rt.interrupt(kid, authority=Ancestor(rt.agent_ref(kid)), kind="abort", scope="subtree")
    for kind in ("steer", "preempt"):
        with pytest.raises(tether.InvalidParams):
            rt.interrupt(kid, authority=me, kind=kind, reason="x", scope="subtree")
    with pytest.raises(tether.InvalidParams):
        rt.interrupt(kid, authority=me, scope="everything")  # type: ignore[call-overload]
    # An ancestor above the target acts on the whole subtree below it.
    rt.send(grand, "go", authority=User(parent=kid), data=HANG)
    turn = rt.wait(grand, until="running").turn
    got = rt.interrupt(kid, authority=Ancestor(rt.agent_ref(root)), kind="abort", scope="subtree")
    assert got == [turn]
    assert turn is not None
    r = final_report(rt, turn)
    assert (r.origin, r.by) == ("parent", root)


def test_the_interrupt_agent_tool_stops_a_subtree() -> None:
    with runtime(workers=3, grace=1.0) as rt:  # two wedged turns and the caller's
        root = rt.open_session(CALLER, slug="root")
        a = spawn_child(rt, root, CALLER, slug="a")
        a1 = spawn_child(rt, a, CALLER, slug="a1")
        wedge = _calls(("run_command", {"argv": ["sleep", "300"]}))
        rt.send(a, "wedge", authority=User(parent=root), data=wedge)
        rt.send(a1, "wedge", authority=User(parent=a), data=wedge)
        turns = {rt.wait(s, until="running").turn for s in (a, a1)}
        stop = _calls(("interrupt_agent", {"agent": "a", "kind": "abort", "scope": "subtree"}))
        rt.send(root, "stop them", authority=User(parent=root), data=stop)
        said = eventually(lambda: _said(rt, root), timeout=10.0, what="the tool's answer")
        assert said[0]["accepted"] is True and set(said[0]["turns"]) == turns
        for sid in (a, a1):
            rt.wait(sid, until="parked")
            assert rt.turns(sid)[-1].outcome == "aborted"
            assert rt.turns(sid)[-1].by == root


def test_rpc_and_cli_stop_a_subtree(tmp_path: Path) -> None:
    with running_server(tmp_path, "--workers", "3") as server:
        root = server.call("session.open", {"driver": SCRIPTED, "slug": "lead"})["session"]
        spawn = {"driver": SCRIPTED, "prompt": "work", "data": HANG}
        kid = server.call("subagent.spawn", {"parent": root, **spawn})["session"]
        grand = server.call("subagent.spawn", {"parent": kid, **spawn})["session"]
        t_kid = server.wait_state(kid, "running")["turn"]
        t_grand = server.wait_state(grand, "running")["turn"]
        address = {"session": kid, "parent": root}
        bad = server.rpc(
            "subagent.interrupt", {"address": address, "kind": "steer", "scope": "subtree"}
        )
        assert bad["error"]["data"]["code"] == "invalid-params"
        done = subprocess.run(
            [TETHER, "abort", kid, "--subtree", "--reason", "all", "--url", server.url],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split("\n")[:2] == [f"aborted {t_kid}", f"aborted {t_grand}"]
        for sid in (kid, grand):
            server.wait_state(sid, "parked")
        answer = server.call(
            "subagent.interrupt", {"address": address, "kind": "cancel", "scope": "subtree"}
        )
        assert answer == {"accepted": True, "turns": []}
