"""``tether.adapters.openai_agents:OpenAIAgentsAgent`` (semantics §16.1) with the real OpenAI
Agents SDK and its real client, against the model server over HTTP.

The model server runs in a process of its own on loopback; the SDK's agent (built by a
factory in ``tests/adapter_agents_oai.py``) runs in a worker process. Each test has its
own script, chosen by the model name it configures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents", reason="the OpenAI Agents SDK needs tether-runtime[openai-agents]")

import tether
from drivers import SCRIPTED, Recorder, entries, eventually, family, runtime, texts
from model_helpers import (
    CUT_REPLIES,
    all_read,
    check_a_cut_reply_is_counted,
    cut_every_time,
    mcp_files,
)
from tether import User
from tether.testing import ModelServer
from tether.testing.mcp_server import read_log

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("api_key")]

OAI = "tether.adapters.openai_agents:OpenAIAgentsAgent"
KEY_ENV = "TETHER_TEST_OAI_KEY"
SECRET = "sk-tether-oai-0123456789abcdef"


def _config(server: ModelServer, script: str, **extra: Any) -> dict[str, Any]:
    model = {"base_url": server.url, "name": script, "api_key_env": KEY_ENV, "timeout": 30}
    return {"agent": "adapter_agents_oai:helper", "model": model, **extra}


def _agent(
    rt: tether.Runtime,
    server: ModelServer,
    script: str,
    replies: list[dict[str, Any]],
    **extra: Any,
) -> tuple[str, str, User]:
    server.script(script, replies)
    return family(
        rt, OAI, root_driver=SCRIPTED, slug="agent", config=_config(server, script, **extra)
    )


def _roles(request: Any) -> list[str]:
    return [m["role"] for m in request.body["messages"]]


def test_a_turn_with_a_tool_call_records_replies_tool_entries_and_usage_and_the_next_turn_continues_it_after_a_restart(  # noqa: E501
    server: ModelServer, db_path: str
) -> None:
    replies: list[dict[str, Any]] = [
        {
            "text": "Let me look.",
            "tool_calls": [{"name": "lookup", "arguments": {"topic": "owls"}}],
        },
        {"text": "Owls: notes on owls.", "chunk": 3},
        {"text": "You asked about owls."},
    ]
    with runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        _root, child, me = _agent(rt, server, "oai-history", replies)
        rt.send(child, "tell me about owls", authority=me)
        ended = rec.turn_ended(child, timeout=60.0)
        assert ended["outcome"] == "completed", ended
        said = [(e.kind, e.text) for e in rt.transcript(child)]
        assert said[0] == ("user", "tell me about owls")
        assert said[1] == ("assistant", "Let me look.")
        assert said[2] == ("tool", "notes on owls")
        assert said[3] == ("assistant", "Owls: notes on owls.")
        tool = entries(rt, child, "tool")[0].data or {}
        assert (tool["name"], json.loads(tool["arguments"])) == ("lookup", {"topic": "owls"})
        usage = rt.turns(child)[0].usage
        assert usage is not None and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        [first, second] = server.requests_for("oai-history")
        assert first.body["stream_options"] == {"include_usage": True}
        assert first.authorization == f"Bearer {SECRET}"
        assert _roles(second) == ["system", "user", "assistant", "tool"]

    # a new host on the same store: the next turn continues the same conversation
    with runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        rt.send(child, "what did I ask?", authority=me)
        assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
        third = server.requests_for("oai-history")[2]
        messages = third.body["messages"]
        assert _roles(third) == ["system", "user", "assistant", "tool", "assistant", "user"]
        assert messages[1]["content"] == "tell me about owls"
        assert messages[2]["tool_calls"][0]["function"]["name"] == "lookup"
        assert messages[3]["content"] == "notes on owls"
        assert messages[4]["content"] == "Owls: notes on owls."
        assert messages[5]["content"] == "what did I ask?"
        assert texts(rt, child, "assistant")[-1] == "You asked about owls."


def test_a_cancel_mid_stream_closes_the_connection_before_the_turn_ends_and_keeps_the_partial(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    text = "I am halfway through a long answer"
    replies: list[dict[str, Any]] = [
        {"text": text, "chunk": 4, "hang": True},
        {"text": "Going on from there."},
    ]
    root, child, me = _agent(rt, server, "oai-cut", replies)
    rt.send(child, "tell me everything", authority=me)
    [request] = server.wait_requests(1, script="oai-cut", timeout=60.0)
    server.wait_for(lambda s: s.requests_for("oai-cut")[0].hanging, what="the hang")
    eventually(lambda: all_read(server), timeout=10.0, what="the agent to read what was sent")

    rt.interrupt(child, authority=me, kind="cancel", reason="enough")
    ended = rec.turn_ended(child, timeout=30.0)
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
    gone = server.wait_disconnect(request.id)
    [turn] = rt.turns(child)
    assert turn.ended_at is not None and gone.time <= turn.ended_at
    cut = texts(rt, child, "assistant")[-1]
    assert cut and text.startswith(cut)  # what arrived, and nothing else
    assert entries(rt, child, "assistant")[-1].data == {"cut": True}
    eventually(lambda: entries(rt, root, "notice"), what="the parent's notice")
    notice = (entries(rt, root, "notice")[-1].data or {})["notice"]
    assert (notice["outcome"], notice["partial"]) == ("cancelled", cut)

    # the SDK's run kept nothing of the cut turn; the next turn still sees the partial
    rt.send(child, "go on", authority=me)
    assert rec.turn_ended(child, count=2, timeout=30.0)["outcome"] == "completed"
    after = server.requests_for("oai-cut")[1].body["messages"]
    assert [(m["role"], m["content"]) for m in after[1:]] == [
        ("user", "tell me everything"),
        ("assistant", cut),
        ("user", "go on"),
    ]


def test_a_reply_cut_by_a_cancel_counts_its_prompt_and_what_streamed_as_estimated_usage(
    server: ModelServer,
) -> None:
    # The stream's usage chunk comes at its end, which a cut reply never reaches
    check_a_cut_reply_is_counted(server, OAI, _config(server, "oai-cut-costs"))


def test_a_steer_sent_mid_stream_reaches_the_next_request_and_stays_in_the_later_ones(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    look = [{"name": "lookup", "arguments": {"topic": "paths"}}]
    replies: list[dict[str, Any]] = [
        {
            "text": "Working on the slow path, step by step.",
            "tool_calls": look,
            "chunk": 2,
            "pace": 0.02,
        },
        {"text": "Checking the fast path.", "tool_calls": look},
        {"text": "Switched to the fast path."},
    ]
    _root, child, me = _agent(rt, server, "oai-steer", replies)
    rt.send(child, "do the task", authority=me)
    server.wait_requests(1, script="oai-steer", timeout=60.0)
    rt.interrupt(child, authority=me, kind="steer", reason="use the <fast> path")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    [_, second, third] = server.requests_for("oai-steer")
    steer = {
        "role": "user",
        "content": '<steer origin="user" by="user">use the &lt;fast&gt; path</steer>',
    }
    assert second.body["messages"][-1] == steer
    assert second.body["messages"][-2]["role"] == "tool"
    # the SDK keeps no filter's additions: the adapter puts the steer back at its place
    assert _roles(third) == ["system", "user", "assistant", "tool", "user", "assistant", "tool"]
    assert third.body["messages"][4] == steer
    assert [m.action for m in entries(rt, child, "marker")] == ["steered"]
    # and the transcript has it after the tool result it followed
    kinds = [e.kind for e in rt.transcript(child)]
    assert kinds == ["user", "assistant", "tool", "marker", "assistant", "tool", "assistant"]


def test_a_preempt_of_a_running_function_tool_gives_the_model_the_preempted_result_and_the_turn_completes(  # noqa: E501
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    probe = tmp_path / "probe-started"
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "slow_probe", "arguments": {"target": "db"}}]},
        {"text": "The probe took too long; moving on."},
    ]
    extra = {"agent": "adapter_agents_oai:prober", "probe_file": str(probe)}
    _root, child, me = _agent(rt, server, "oai-preempt", replies, **extra)
    rt.send(child, "probe the db", authority=me)
    eventually(probe.exists, timeout=60.0, what="the tool to start")
    turn = rt.interrupt(child, authority=me, kind="preempt", reason="too slow")
    assert turn is not None
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    report = eventually(lambda: rt.stop_report(turn), what="the preempt's report")
    assert [(t.name, t.fate) for t in report.tools] == [("slow_probe", "preempted")]
    [_, second] = server.requests_for("oai-preempt")
    result = second.body["messages"][-1]
    assert result["role"] == "tool"
    assert result["content"].startswith("preempted after ")
    assert "by user: too slow" in result["content"]
    tool = entries(rt, child, "tool")[-1]
    assert tool.text == result["content"] and (tool.data or {})["preempted"] is True
    assert texts(rt, child, "assistant")[-1] == "The probe took too long; moving on."
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]


def test_after_a_handoff_the_new_agent_is_watched_its_tool_preempted_and_its_reply_recorded(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    probe = tmp_path / "probe-started"
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "transfer_to_prober", "arguments": {}}]},
        {"tool_calls": [{"name": "slow_probe", "arguments": {"target": "db"}}]},
        {"text": "The probe took too long; moving on."},
    ]
    extra = {"agent": "adapter_agents_oai:triage", "probe_file": str(probe)}
    _root, child, me = _agent(rt, server, "oai-handoff", replies, **extra)
    rt.send(child, "probe the db", authority=me)
    eventually(probe.exists, timeout=60.0, what="the prober's tool to start")
    turn = rt.interrupt(child, authority=me, kind="preempt", reason="too slow")
    assert turn is not None
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    report = eventually(lambda: rt.stop_report(turn), what="the preempt's report")
    assert [(t.name, t.fate) for t in report.tools] == [("slow_probe", "preempted")]
    [_, second, third] = server.requests_for("oai-handoff")
    assert "slow_probe" in [t["function"]["name"] for t in second.body["tools"]]
    result = third.body["messages"][-1]
    assert result["role"] == "tool" and result["content"].startswith("preempted after ")
    # the handed-off agent's replies are entries, as the first agent's are
    assert texts(rt, child, "assistant")[-1] == "The probe took too long; moving on."
    probe_entry = entries(rt, child, "tool")[-1]
    assert probe_entry.data is not None and probe_entry.data["preempted"] is True
    assert rt.turns(child)[-1].usage


def test_the_framework_agent_spawns_a_child_with_spawn_agent_and_stops_it_with_interrupt_agent(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "spawn_agent", "arguments": {"slug": "kid"}}]},
        {"text": "Spawned kid."},
        {"text": "kid is working on it", "hang": True},  # the kid's turn
        {"tool_calls": [{"name": "interrupt_agent", "arguments": {"agent": "kid"}}]},
        {"text": "Stopped kid."},
    ]
    tools = ["spawn_agent", "interrupt_agent"]
    _root, child, me = _agent(rt, server, "oai-family", replies, tools=tools)
    # one step at a time, so that the script's replies go to the requests in order
    rt.send(child, "start a helper", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    [kid] = rt.list_agents(child)
    assert kid.slug == "kid"
    first = server.requests_for("oai-family")[0]
    assert sorted(t["function"]["name"] for t in first.body["tools"]) == sorted(["lookup", *tools])

    rt.send(kid.id, "work", authority=User(parent=child))
    [*_, kids] = server.wait_requests(3, script="oai-family", timeout=60.0)
    server.wait_for(lambda s: s.requests_for("oai-family")[2].hanging, what="the kid's stream")
    # the server sent it all; the kid must also have read it for its cut reply to hold it
    # (a CI run stopped the kid with the text still in its socket: no cut entry)
    eventually(lambda: all_read(server), timeout=10.0, what="the kid to read what was sent")
    rt.send(child, "stop the helper", authority=me)
    assert rec.turn_ended(child, count=2, timeout=60.0)["outcome"] == "completed"
    assert rec.turn_ended(kid.id, timeout=30.0)["outcome"] == "cancelled"
    server.wait_disconnect(kids.id)
    stopped = [e for e in entries(rt, child, "tool") if (e.data or {})["name"] == "interrupt_agent"]
    [turn] = rt.turns(kid.id)
    assert [json.loads(e.text) for e in stopped] == [{"accepted": True, "turn": turn.id}]
    assert texts(rt, kid.id, "assistant") == ["kid is working on it"]
    assert texts(rt, child, "assistant")[-1] == "Stopped kid."


@pytest.mark.timeout(120)
def test_a_preempt_of_a_hung_mcp_call_reaches_the_server_and_the_framework_agent_goes_on(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "mcp__files__hang", "arguments": {"seconds": 60}}]},
        {"text": "The search hung; going on without it."},
    ]
    _root, child, me = _agent(rt, server, "oai-mcp", replies, mcp=mcp)
    rt.send(child, "search", authority=me)
    call = eventually(
        lambda: next((r for r in read_log(str(log)) if r.get("method") == "tools/call"), None),
        timeout=60.0,
        what="the MCP server to receive the call",
    )
    turn = rt.interrupt(child, authority=me, kind="preempt", reason="search is stuck")
    assert turn is not None
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    cancelled = [r for r in read_log(str(log)) if r.get("method") == "notifications/cancelled"]
    assert [r["requestId"] for r in cancelled] == [call["id"]]
    [first, second] = server.requests_for("oai-mcp")
    assert "mcp__files__hang" in [t["function"]["name"] for t in first.body["tools"]]
    result = second.body["messages"][-1]["content"]
    assert result.startswith("preempted after ") and "by user: search is stuck" in result
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]
    assert texts(rt, child, "assistant")[-1] == "The search hung; going on without it."


def test_a_bad_config_or_a_refused_request_ends_the_turn_failed_with_one_line(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    server.script("oai-refused", [{"status": 400, "message": "no such\nmodel"}])
    root = rt.open_session(SCRIPTED)
    # config mistakes: the worker's check at spawn refuses them (issue 42, item 8)
    for mistake, says in [
        ({"model": {"base_url": server.url}}, "config.agent"),  # no agent
        ({**_config(server, "oai-refused"), "tools": ["rm_rf"]}, "rm_rf"),
    ]:
        with pytest.raises(tether.InvalidParams, match=says):
            rt.spawn(root, OAI, config=mistake, prompt="hi")
    configs = [_config(server, "oai-refused")]
    errors = []
    for i, config in enumerate(configs):
        sid = str(rt.spawn(root, OAI, slug=f"bad{i}", config=config, prompt="hi"))
        ended = rec.turn_ended(sid, timeout=60.0)
        assert ended["outcome"] == "failed" and "\n" not in ended["error"], ended
        assert all("Traceback" not in e.text for e in rt.transcript(sid))
        errors.append(ended["error"])
    assert "HTTP 400: no such model" in errors[0]
    # a factory that is not there is refused at the spawn itself (issue 42, item 15)
    nobody = {**_config(server, "oai-refused"), "agent": "adapter_agents_oai:nobody"}
    with pytest.raises(tether.DriverNotFound, match="nobody"):
        rt.spawn(root, OAI, slug="bad-factory", config=nobody, prompt="hi")


def test_a_cancel_during_a_function_tool_stops_it_and_the_next_turn_sees_the_call_unanswered(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    probe = tmp_path / "probe-started"
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "slow_probe", "arguments": {"target": "db"}}]},
        {"text": "Fine, no probe then."},
    ]
    extra = {"agent": "adapter_agents_oai:prober", "probe_file": str(probe)}
    _root, child, me = _agent(rt, server, "oai-cancel-tool", replies, **extra)
    rt.send(child, "probe the db", authority=me)
    eventually(probe.exists, timeout=60.0, what="the tool to start")
    turn = rt.interrupt(child, authority=me, kind="cancel", reason="never mind")
    assert turn is not None
    ended = rec.turn_ended(child, timeout=30.0)
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
    report = eventually(lambda: rt.stop_report(turn), what="the cancel's report")
    assert [(t.name, t.fate) for t in report.tools] == [("slow_probe", "cancelled")]
    assert entries(rt, child, "tool") == []  # the call never returned

    rt.send(child, "go on", authority=me)
    assert rec.turn_ended(child, count=2, timeout=30.0)["outcome"] == "completed"
    after = server.requests_for("oai-cancel-tool")[1].body["messages"]
    assert _roles(server.requests_for("oai-cancel-tool")[1]) == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
    ]
    assert after[2]["tool_calls"][0]["id"] == after[3]["tool_call_id"]
    assert after[3]["content"] == "(no result: stopped)"


def test_429_and_500_are_retried_by_the_client_and_the_turn_completes(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [{"status": 429}, {"status": 500}, {"text": "third time lucky"}]
    _root, child, me = _agent(rt, server, "oai-flaky", replies)
    rt.send(child, "try", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    assert [r.status for r in server.requests_for("oai-flaky")] == [429, 500, 200]
    assert texts(rt, child, "assistant") == ["third time lucky"]


def test_abort_mid_stream_kills_the_turn_and_the_server_sees_the_disconnect(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    _root, child, me = _agent(rt, server, "oai-abort", [{"text": "streaming...", "hang": True}])
    rt.send(child, "go", authority=me)
    [request] = server.wait_requests(1, script="oai-abort", timeout=60.0)
    rt.interrupt(child, authority=me, kind="abort", reason="kill it")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "aborted"
    server.wait_disconnect(request.id)


def test_with_telemetry_each_model_request_is_a_chat_span_under_the_turn_with_model_and_usage(
    server: ModelServer,
) -> None:
    from otlp_receiver import OtlpReceiver

    script = "oai-traced"
    replies: list[dict[str, Any]] = [
        {
            "text": "Let me look.",
            "tool_calls": [{"name": "lookup", "arguments": {"topic": "owls"}}],
        },
        {"text": "Owls: notes on owls."},
    ]
    with OtlpReceiver() as receiver:
        with tether.Runtime(workers=1, grace=1.0, telemetry={"endpoint": receiver.url}) as rt:
            rec = Recorder(rt)
            _root, child, me = _agent(rt, server, script, replies)
            rt.send(child, "tell me about owls", authority=me)
            ended = rec.turn_ended(child, timeout=60.0)
            assert ended["outcome"] == "completed", ended.get("error")
        top, chats = receiver.chats_under(ended["turn"], script, 2)
    assert top.attrs["gen_ai.agent.id"] == child and not top.error
    assert all(c.attrs["gen_ai.provider.name"] == "openai" for c in chats)


@pytest.mark.timeout(240)
def test_a_cancel_as_soon_as_the_stream_was_read_keeps_what_was_read_every_time(
    rt: tether.Runtime, server: ModelServer
) -> None:
    script = "oai-cut-loop"
    _, child, me = _agent(rt, server, script, CUT_REPLIES)
    cut_every_time(rt, server, script, child, me)


def test_a_completed_handoff_has_its_tool_entry_and_later_turns_read_its_real_result(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "transfer_to_prober", "arguments": {}}]},
        {"text": "Prober here."},
        {"text": "Still here."},
    ]
    extra = {"agent": "adapter_agents_oai:triage", "probe_file": str(tmp_path / "unused")}
    _root, child, me = _agent(rt, server, "oai-handoff-kept", replies, **extra)
    rt.send(child, "hand me over", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    [asked] = entries(rt, child, "assistant")[0].data["tool_calls"]  # type: ignore[index]
    transfer = '{"assistant": "prober"}'  # what the SDK tells the model of a handoff
    [tool] = entries(rt, child, "tool")
    assert tool.text == transfer and tool.data is not None
    assert (tool.data["name"], tool.data["tool_call_id"]) == ("transfer_to_prober", asked["id"])
    kinds = [e.kind for e in rt.transcript(child)]
    assert kinds == ["user", "assistant", "tool", "assistant"], kinds

    rt.send(child, "still there?", authority=me)
    assert rec.turn_ended(child, count=2, timeout=60.0)["outcome"] == "completed"
    messages = server.requests_for("oai-handoff-kept")[-1].body["messages"]
    results = [m for m in messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [(asked["id"], transfer)]
