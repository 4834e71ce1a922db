"""Approvals (semantics §17.2) with ChatAgent against the real model server: a tool call
under an ``approval: required`` policy does not start until a person or an ancestor
decides it; approved it runs (with edited arguments if given), denied or expired the
model is told so and the turn goes on; a waiting turn holds no worker slot."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from drivers import (
    SCRIPTED,
    Recorder,
    entries,
    eventually,
    family,
    frozen,
    local_pool,
)
from tether import User
from tether.testing import ModelServer

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("api_key")]

CHAT = "tether.agents:ChatAgent"
KEY_ENV = "TETHER_TEST_MODEL_KEY"
SECRET = "sk-tether-test-approvals-0123456789"
REQUIRED = {"run_command": {"approval": "required"}}


def _config(
    server: ModelServer, script: str, policy: dict[str, Any] | None = None
) -> dict[str, Any]:
    model = {"base_url": server.url, "name": script, "api_key_env": KEY_ENV, "timeout": 30}
    return {
        "model": model,
        "tools": ["run_command"],
        "tool_policy": REQUIRED if policy is None else policy,
    }


def _agent(
    rt: tether.Runtime,
    server: ModelServer,
    script: str,
    replies: list[dict[str, Any]],
    policy: dict[str, Any] | None = None,
) -> tuple[str, str, User]:
    server.script(script, replies)
    return family(
        rt, CHAT, root_driver=SCRIPTED, slug="agent", config=_config(server, script, policy)
    )


def _call(argv: list[str], call_id: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"name": "run_command", "arguments": {"argv": argv}}
    if call_id is not None:
        call["id"] = call_id
    return call


def _touch(path: Path) -> list[str]:
    """A command that leaves ``path`` behind: whether it ran shows on disk."""
    return [sys.executable, "-c", f"open({str(path)!r}, 'a').write('ran\\n')"]


def _pending(rt: tether.Runtime, session: str, count: int = 1) -> list[tether.Approval]:
    return eventually(
        lambda: len(found := rt.approvals(session)) >= count and found,
        timeout=30.0,
        what=f"{count} pending approval(s) of {session}",
    )


def _tool_results(server: ModelServer, script: str, request: int) -> list[str]:
    """The tool messages the model got in its ``request``-th request."""
    body = server.requests_for(script)[request].body
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def test_a_call_under_approval_waits_and_runs_once_a_person_approves_it(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    replies: list[dict[str, Any]] = [
        {"text": "Cleaning up.", "tool_calls": [_call(_touch(ran))]},
        {"text": "Done."},
    ]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        root, child, me = _agent(rt, server, "approve", replies)
        rt.send(child, "clean up", authority=me)
        [a] = _pending(rt, child)
        # it waits: nothing ran, the turn is running with the approval listed
        assert a.state == "pending" and a.tool == "run_command" and a.session == child
        assert a.arguments == {"argv": _touch(ran)}
        assert not ran.exists()
        info = rt.status(child)
        assert info.state == "running" and info.approvals == (a.id,)
        assert [x.id for x in rt.approvals(root, scope="subtree")] == [a.id]
        assert rt.approvals(root) == []  # the root's own: none
        needed = next(e for e in entries(rt, child, "marker") if e.action == "approval")
        assert needed.text == f"Approval needed: run_command {json.dumps(_touch(ran))} ({a.id})"
        event = rec.wait_for(lambda e: e.name == "approval" and e.session == child)[0]
        assert event.data["approval"]["id"] == a.id and root in event.lineage

        decided = rt.decide(a.id, "approve", authority=User(parent=root, name="alice"))
        assert decided.state == "approved" and decided.decided_by == "alice"
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert ran.read_text() == "ran\n"  # once
        markers = [e.text for e in entries(rt, child, "marker")]
        assert f"✓ Approved by user alice ({a.id})" in markers
        [tool] = entries(rt, child, "tool")
        assert tool.data is not None and tool.data["approval"] == a.id
        assert "arguments_used" not in tool.data  # not edited
        assert json.loads(_tool_results(server, "approve", 1)[0])["returncode"] == 0
        assert rt.approvals(child) == [] and rt.status(child).approvals == ()
        with pytest.raises(tether.AlreadyDecided) as exc:
            rt.decide(a.id, "deny", authority=me, reason="too late")
        assert exc.value.code == "already-decided"
        with pytest.raises(tether.NotFound):
            rt.decide("a_nosuch", authority=me)


def test_a_denied_call_never_runs_and_the_model_is_told_who_denied_it_and_why(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_call(_touch(ran))]},
        {"text": "I will not delete it."},
    ]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "deny", replies)
        rt.send(child, "clean up", authority=me)
        [a] = _pending(rt, child)
        decided = rt.decide(a.id, "deny", authority=me, reason="not the build dir")
        assert decided.state == "denied" and decided.reason == "not the build dir"
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"  # it went on
        assert not ran.exists()
        assert _tool_results(server, "deny", 1) == ["denied by user: not the build dir"]
        markers = [e.text for e in entries(rt, child, "marker")]
        assert f"✗ Denied by user ({a.id}): not the build dir" in markers


def test_an_approval_with_edited_arguments_runs_them_and_the_tool_entry_records_both(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    asked, edited = tmp_path / "asked", tmp_path / "edited"
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_call(_touch(asked))]},
        {"text": "Done."},
    ]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "edit", replies)
        rt.send(child, "go", authority=me)
        [a] = _pending(rt, child)
        # an edit the tool's schema refuses changes nothing, and says why
        with pytest.raises(tether.InvalidParams, match="argv") as bad:
            rt.decide(a.id, authority=me, arguments={"argv": "not a list"})
        assert bad.value.code == "invalid-params"
        with pytest.raises(tether.InvalidParams, match="'shell' was unexpected"):
            rt.decide(a.id, authority=me, arguments={"argv": ["ls"], "shell": True})
        assert [x.id for x in rt.approvals(child)] == [a.id]  # still pending
        new = {"argv": _touch(edited)}
        decided = rt.decide(a.id, authority=me, arguments=new)
        assert decided.arguments_used == new and decided.arguments == {"argv": _touch(asked)}
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert edited.exists() and not asked.exists()
        [tool] = entries(rt, child, "tool")
        assert tool.data is not None
        assert json.loads(tool.data["arguments"]) == {"argv": _touch(asked)}
        assert json.loads(tool.data["arguments_used"]) == new
        assert "with edited arguments" in next(
            e.text for e in entries(rt, child, "marker") if e.action == "approved"
        )


def test_each_call_of_one_reply_is_its_own_approval(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_call(_touch(one), "c1"), _call(_touch(two), "c2")]},
        {"text": "Done."},
    ]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "two-calls", replies)
        rt.send(child, "go", authority=me)
        [first] = _pending(rt, child)
        assert first.tool_call_id == "c1"
        rt.decide(first.id, "deny", authority=me, reason="no")
        second = eventually(
            lambda: [a for a in rt.approvals(child) if a.id != first.id], what="the second"
        )[0]
        assert second.tool_call_id == "c2" and second.id != first.id
        rt.decide(second.id, authority=me)
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert two.exists() and not one.exists()


def test_an_approval_left_undecided_expires_and_the_model_is_told_it_timed_out(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    policy = {"run_command": {"approval": "required", "approval_timeout": 0.5}}
    replies: list[dict[str, Any]] = [{"tool_calls": [_call(_touch(ran))]}, {"text": "OK."}]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "expire", replies, policy)
        rt.send(child, "go", authority=me)
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert not ran.exists()
        assert _tool_results(server, "expire", 1) == ["timed out after 0.5 s"]
        [marker] = [e for e in entries(rt, child, "marker") if e.action == "approval-expired"]
        approval = marker.data["approval"] if marker.data else None
        with pytest.raises(
            tether.AlreadyDecided, match="expired already \\(by system \\(timeout\\)\\)"
        ):
            rt.decide(str(approval), authority=me)


def test_a_cancel_of_a_waiting_turn_cancels_its_approval(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    replies: list[dict[str, Any]] = [{"tool_calls": [_call(_touch(ran))]}, {"text": "OK."}]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "cancel", replies)
        rt.send(child, "go", authority=me)
        [a] = _pending(rt, child)
        rt.interrupt(child, authority=me, kind="cancel", reason="stop")
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "cancelled"
        with pytest.raises(tether.AlreadyDecided, match="cancelled"):
            rt.decide(a.id, authority=me)
        assert not ran.exists() and rt.approvals(child) == []


def test_a_preempt_of_a_pending_call_denies_it_by_the_preempts_by(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    replies: list[dict[str, Any]] = [{"tool_calls": [_call(_touch(ran))]}, {"text": "OK."}]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        root, child, _ = _agent(rt, server, "preempt", replies)
        rt.send(child, "go", authority=User(parent=root))
        [a] = _pending(rt, child)
        rt.interrupt(child, authority=User(parent=root, name="bob"), kind="preempt", reason="no")
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert not ran.exists()
        assert _tool_results(server, "preempt", 1) == ["denied by user bob: no"]
        with pytest.raises(tether.AlreadyDecided, match="denied already \\(by user bob\\)"):
            rt.decide(a.id, authority=User(parent=root))


def test_a_decision_while_paused_is_recorded_and_the_call_runs_only_after_resume(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    replies: list[dict[str, Any]] = [{"tool_calls": [_call(_touch(ran))]}, {"text": "OK."}]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "paused", replies)
        rt.send(child, "go", authority=me)
        [a] = _pending(rt, child)
        turn = rt.status(child).turn
        assert turn is not None
        [paused] = rt.pause(child, authority=me)
        worker = psutil.Process(local_pool(rt).turns.worker(paused).pid)  # type: ignore[union-attr]
        assert rt.decide(a.id, authority=me).state == "approved"
        # recorded at once; nothing of the turn runs while it is frozen
        assert rt.approvals(child) == [] and frozen(worker) and not ran.exists()
        rt.resume(child, authority=me)
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert ran.exists()


def test_an_ancestor_may_not_decide_an_approval_for_a_person_and_a_stranger_may_not_decide(
    server: ModelServer, db_path: str
) -> None:
    policy = {"run_command": {"approval": "required", "approver": "user"}}
    replies: list[dict[str, Any]] = [{"tool_calls": [_call(["true"])]}, {"text": "OK."}]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        root, child, me = _agent(rt, server, "user-only", replies, policy)
        rt.send(child, "go", authority=me)
        [a] = _pending(rt, child)
        assert a.approver == "user"
        with pytest.raises(tether.Unauthorized, match="for a person"):
            rt.decide(a.id, authority=tether.Ancestor(rt.agent_ref(root)))
        with pytest.raises(tether.Unauthorized):
            rt.decide(a.id, authority=User(parent=child))  # not its parent's address
        assert [x.id for x in rt.approvals(child)] == [a.id]
        rt.decide(a.id, authority=me)
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"


def test_a_parent_agent_gets_a_notice_of_its_childs_approval(
    server: ModelServer, db_path: str
) -> None:
    replies: list[dict[str, Any]] = [{"tool_calls": [_call(["true"])]}, {"text": "OK."}]
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        root, child, me = _agent(rt, server, "notice", replies)
        rt.send(child, "go", authority=me)
        [a] = _pending(rt, child)
        notice = eventually(
            lambda: next(
                (e for e in entries(rt, root, "notice") if "approval needed" in e.text), None
            ),
            timeout=10.0,
            what="the parent's notice",
        )
        assert notice.text == f'[agent] approval needed: run_command ["true"] ({a.id})'
        rt.decide(a.id, authority=me)
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"


def test_a_bad_approval_policy_is_refused_at_spawn_naming_the_field(
    server: ModelServer, db_path: str
) -> None:
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        root = rt.open_session(SCRIPTED)
        for policy, message in (
            ({"run_command": {"approval": "always"}}, "approval"),
            ({"run_command": {"approval": "required", "approval_timeout": 0}}, "approval_timeout"),
            ({"run_command": {"approval": "required", "approver": "boss"}}, "approver"),
            ({"files/*": {"approval": "required"}}, "the key must be"),
        ):
            with pytest.raises(tether.InvalidParams, match=message):
                rt.spawn(root, CHAT, config=_config(server, "never-used", policy))


def test_with_one_worker_a_parent_agent_runs_beside_its_waiting_child_and_approves_its_call(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    server.script("one-worker", [{"tool_calls": [_call(_touch(ran))]}, {"text": "Done."}])
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        root = rt.open_session("drivers:Approver")
        child = rt.spawn(root, CHAT, slug="agent", config=_config(server, "one-worker"))
        assert isinstance(child, str)
        rt.send(child, "go", authority=User(parent=root))
        # the child's turn waits on the one worker; the parent's notice starts a turn
        # of the parent beside it, which decides the call as the child's ancestor
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert rec.turn_ended(root, timeout=30.0)["outcome"] == "completed"
        assert ran.read_text() == "ran\n"
        [marker] = [e for e in entries(rt, child, "marker") if e.action == "approved"]
        assert marker.text.startswith(f"✓ Approved by parent ({root})")
        assert marker.text.endswith(": fine by me")
        # and the pool gives the worker it lent back: one active again
        pool = local_pool(rt)
        eventually(lambda: len(pool._active) == 1, timeout=10.0, what="one active worker")


def test_a_turn_waiting_on_approval_is_never_stepped_by_the_watchdog_nor_charged_turn_seconds(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    server.script("watched", [{"tool_calls": [_call(_touch(ran))]}, {"text": "Done."}])
    server.script("warm", [{"text": "Ready."}])
    stall = {"after": 1.0, "steps": ["cancel"]}
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        root = rt.open_session(SCRIPTED)
        child = rt.spawn(root, CHAT, slug="agent", config=_config(server, "watched"), stall=stall)
        assert isinstance(child, str)
        me = User(parent=root)
        # a first turn of another agent: the one worker has loaded ChatAgent's modules,
        # which the watched one's first second would otherwise spend
        warm = rt.spawn(root, CHAT, prompt="hi", config=_config(server, "warm"))
        assert isinstance(warm, str)
        assert rec.turn_ended(warm, timeout=30.0)["outcome"] == "completed"
        rt.send(child, "go", authority=me)
        [a] = _pending(rt, child)
        before = rt.budget(root).spent["turn_seconds"]
        # Time passing is what this test is about: twice the watchdog's ``after``.
        time.sleep(2.0)
        assert rt.budget(root).spent["turn_seconds"] < before + 0.5  # the wait is not charged
        assert not [e for e in rec.events if e.name == "watchdog.step"]
        assert rt.status(child).state == "running"
        rt.decide(a.id, authority=me)
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        assert ran.exists()
