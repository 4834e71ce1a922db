"""``tether.adapters.pydantic_ai:PydanticAIAgent`` (semantics §16.1) with the real framework.

A real ``pydantic_ai.Agent`` (its factory in tests/adapter_agents.py) runs in a worker
process and talks to the model server (``tether.testing.ModelServer``, a process of its
own on loopback) over real HTTP with the framework's own OpenAI client. Each test has its
own script, chosen by the model name it configures.
"""

from __future__ import annotations

import json
import sys
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
    final_report,
    frozen,
    runtime,
    texts,
)
from model_helpers import (
    CUT_REPLIES,
    all_read,
    check_a_cut_reply_is_counted,
    cut_every_time,
    last_notice,
    mcp_files,
    talking_to,
)
from tether import User
from tether.testing import ModelServer
from tether.testing.mcp_server import read_log

pytest.importorskip("pydantic_ai")

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("api_key")]

ADAPTER = "tether.adapters.pydantic_ai:PydanticAIAgent"
FACTORY = "adapter_agents:pydantic_ai_agent"
KEY_ENV = "TETHER_TEST_PYD_KEY"
SECRET = "sk-tether-pyd-0123456789abcdef"


def _config(server: ModelServer, script: str, **extra: Any) -> dict[str, Any]:
    model = {"base_url": server.url, "name": script, "api_key_env": KEY_ENV, "timeout": 30}
    return {"agent": FACTORY, "model": model, **extra}


def _agent(
    rt: tether.Runtime,
    server: ModelServer,
    script: str,
    replies: list[dict[str, Any]],
    **extra: Any,
) -> tuple[str, str, User]:
    server.script(script, replies)
    return family(
        rt, ADAPTER, root_driver=SCRIPTED, slug="agent", config=_config(server, script, **extra)
    )


def _said(rt: tether.Runtime, sid: str) -> list[tuple[str, str]]:
    return [(e.kind, e.text) for e in rt.transcript(sid)]


def test_a_turn_keeps_its_replies_tool_results_and_usage_and_the_next_turn_continues_it(
    server: ModelServer, db_path: str
) -> None:
    script = "pyd-tool-turn"
    replies: list[dict[str, Any]] = [
        {"text": "Let me look.", "tool_calls": [{"name": "lookup", "arguments": {"key": "k1"}}]},
        {"text": "The value is value-of-k1.", "chunk": 3},
        {"text": "You asked about k1 before."},
        {"text": "Still the same conversation."},
    ]
    with runtime(db_path, workers=2, grace=1.0) as rt:
        rec = Recorder(rt)
        root, child, me = _agent(rt, server, script, replies)
        rt.send(child, "what is k1?", authority=me)
        ended = rec.turn_ended(child, timeout=60.0)
        assert ended["outcome"] == "completed", ended.get("error")
        said = _said(rt, child)
        assert said[0] == ("user", "what is k1?")
        assert said[1] == ("assistant", "Let me look.")
        assert said[2] == ("tool", "value-of-k1")
        assert said[3] == ("assistant", "The value is value-of-k1.")
        [tool] = entries(rt, child, "tool")
        assert tool.data is not None and tool.data["name"] == "lookup"
        assert json.loads(tool.data["arguments"]) == {"key": "k1"}
        [first, second] = server.requests_for(script)
        assert first.authorization == f"Bearer {SECRET}"
        assert first.body["stream"] is True
        assert first.body["stream_options"] == {"include_usage": True}  # usage asked for
        assert "lookup" in [t["function"]["name"] for t in first.body["tools"]]
        assert second.body["messages"][-1]["role"] == "tool"
        assert second.body["messages"][-1]["content"] == "value-of-k1"
        usage = rt.turns(child)[0].usage
        assert usage is not None and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0

        rt.send(child, "what did I ask?", authority=me)
        assert rec.turn_ended(child, count=2, timeout=60.0)["outcome"] == "completed"
        third = server.requests_for(script)[2].body["messages"]
        contents = [m.get("content") for m in third]
        assert "what is k1?" in contents and "value-of-k1" in contents
        assert contents[-1] == "what did I ask?"

    # a new host on the same store: the conversation is in Tether's store
    with runtime(db_path, workers=1, grace=1.0) as again:
        rec = Recorder(again)
        again.send(child, "and now?", authority=me)
        assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
        fourth = server.requests_for(script)[3].body["messages"]
        contents = [m.get("content") for m in fourth]
        assert "what is k1?" in contents and "what did I ask?" in contents
        assert "You asked about k1 before." in contents and contents[-1] == "and now?"
        assert texts(again, child, "assistant")[-1] == "Still the same conversation."
        assert root  # the parent's session is the same too


def test_a_cancel_mid_stream_closes_the_connection_and_keeps_the_partial_reply(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    text = "I am halfway through a long answer"
    replies: list[dict[str, Any]] = [
        {"text": text, "chunk": 4, "hang": True},
        {"text": "Picking up where I was cut."},
    ]
    root, child, me = _agent(rt, server, "pyd-cut", replies)
    rt.send(child, "tell me everything", authority=me)
    [request] = server.wait_requests(1, script="pyd-cut", timeout=60.0)
    server.wait_for(lambda s: s.requests_for("pyd-cut")[0].hanging, what="the hang")
    eventually(lambda: all_read(server), timeout=10.0, what="the agent to read what was sent")

    rt.interrupt(child, authority=me, kind="cancel", reason="enough")
    ended = rec.turn_ended(child, timeout=30.0)
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False), ended
    gone = server.wait_disconnect(request.id)
    [turn] = rt.turns(child)
    assert turn.ended_at is not None and gone.time <= turn.ended_at
    [cut] = entries(rt, child, "assistant")
    assert cut.text and text.startswith(cut.text)  # what arrived, and nothing else
    assert cut.data is not None and cut.data["cut"] is True
    notice = last_notice(rt, root)
    assert (notice["outcome"], notice["partial"]) == ("cancelled", cut.text)

    # the cut reply is part of the conversation the next turn continues
    rt.send(child, "go on", authority=me)
    assert rec.turn_ended(child, count=2, timeout=30.0)["outcome"] == "completed"
    messages = server.requests_for("pyd-cut")[1].body["messages"]
    assert [(m["role"], m.get("content")) for m in messages[-3:]] == [
        ("user", "tell me everything"),
        ("assistant", cut.text),
        ("user", "go on"),
    ]


def test_a_reply_cut_by_a_cancel_counts_its_prompt_and_what_streamed_as_estimated_usage(
    server: ModelServer,
) -> None:
    # The stream's usage chunk comes at its end, which a cut reply never reaches
    check_a_cut_reply_is_counted(server, ADAPTER, _config(server, "pyd-cut-costs"))


def test_a_cancel_while_a_tool_runs_ends_the_turn_and_the_next_turn_sees_the_call_stopped(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    started = tmp_path / "search.started"
    call = {"name": "slow_search", "arguments": {"query": "q", "started": str(started)}}
    replies: list[dict[str, Any]] = [
        {"text": "Searching.", "tool_calls": [call]},
        {"text": "Fine, no search."},
    ]
    _root, child, me = _agent(rt, server, "pyd-cancel-tool", replies)
    rt.send(child, "search", authority=me)
    eventually(started.exists, timeout=60.0, what="the tool to run")
    turn = rt.interrupt(child, authority=me, kind="cancel", reason="enough")
    assert turn is not None
    ended = rec.turn_ended(child, timeout=30.0)
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False), ended
    report = eventually(lambda: rt.stop_report(turn), what="the cancel's report")
    assert [(t.name, t.fate) for t in report.tools] == [("slow_search", "cancelled")]

    rt.send(child, "never mind", authority=me)
    ended = rec.turn_ended(child, count=2, timeout=30.0)
    assert ended["outcome"] == "completed", ended.get("error")
    messages = server.requests_for("pyd-cancel-tool")[1].body["messages"]
    roles = [m["role"] for m in messages]
    assert roles[-3:] == ["assistant", "tool", "user"], roles
    assert messages[-2]["content"] == "(no result: stopped)"
    assert texts(rt, child, "assistant") == ["Searching.", "Fine, no search."]


def test_a_steer_sent_while_the_model_streams_reaches_the_next_request(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {
            "text": "Working on the slow path, step by step.",
            "tool_calls": [{"name": "lookup", "arguments": {"key": "k2"}}],
            "chunk": 2,
            "pace": 0.05,
        },
        {"text": "Switched to the fast path."},
    ]
    _root, child, me = _agent(rt, server, "pyd-steer", replies)
    rt.send(child, "do the task", authority=me)
    server.wait_requests(1, script="pyd-steer", timeout=60.0)
    rt.interrupt(child, authority=me, kind="steer", reason="use the <fast> path")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    [first, second] = server.requests_for("pyd-steer")
    assert not first.body["messages"][-1]["content"].startswith("<steer")
    steer = '<steer origin="user" by="user">use the &lt;fast&gt; path</steer>'
    assert second.body["messages"][-1] == {"role": "user", "content": steer}
    assert second.body["messages"][-2]["role"] == "tool"
    # the marker where the framework took the steer: in the request after the tool's result
    kinds = [e.action or e.kind for e in rt.transcript(child) if e.kind != "user"]
    assert kinds == ["assistant", "tool", "steered", "assistant"], kinds
    assert texts(rt, child, "assistant")[-1] == "Switched to the fast path."


def test_a_preempt_of_a_running_tool_stops_only_that_tool_and_the_model_gets_the_preempted_result(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    started = tmp_path / "search.started"
    call = {"name": "slow_search", "arguments": {"query": "q", "started": str(started)}}
    replies: list[dict[str, Any]] = [
        {"tool_calls": [call]},
        {"text": "The search was too slow; moving on."},
    ]
    _root, child, me = _agent(rt, server, "pyd-preempt", replies)
    rt.send(child, "search", authority=me)
    eventually(started.exists, timeout=60.0, what="the tool to run")
    turn = rt.interrupt(child, authority=me, kind="preempt", reason="too slow")
    assert turn is not None
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    [_, second] = server.requests_for("pyd-preempt")
    result = second.body["messages"][-1]
    assert result["role"] == "tool"
    assert result["content"].startswith("preempted after ")
    assert "by user: too slow" in result["content"]
    [tool] = entries(rt, child, "tool")
    assert tool.data is not None and tool.data["preempted"] is True
    assert tool.text == result["content"]
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]
    assert texts(rt, child, "assistant")[-1] == "The search was too slow; moving on."
    report = eventually(lambda: rt.stop_report(turn), what="the preempt's report")
    assert [(t.name, t.fate) for t in report.tools] == [("slow_search", "preempted")]


_WAIT_FOR_CHILD = """
import json, sys, time, urllib.request
url, script = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    with urllib.request.urlopen(url + "/_tether/log") as r:
        log = json.load(r)
    ours = [q for q in log["requests"] if q["script"] == script]
    if len(ours) >= 2 and ours[1]["hanging"]:  # the child's stream sent all it will
        print("the child asked the model")
        sys.exit(0)
    time.sleep(0.02)
sys.exit("the child never asked the model")
"""


def test_the_agent_spawns_a_child_with_tethers_tools_and_stops_it(
    rt: tether.Runtime, server: ModelServer
) -> None:
    # The parent's first reply spawns the child and, alongside, waits (a command) until
    # the child's model request has arrived, so that the script's replies go in order:
    # the child hangs, and only then does the parent ask again and cancel it.
    rec = Recorder(rt)
    script = "pyd-family"
    wait = [sys.executable, "-c", _WAIT_FOR_CHILD, server.root, script]
    replies: list[dict[str, Any]] = [
        {
            "tool_calls": [
                {"name": "spawn_agent", "arguments": {"slug": "kid", "prompt": "work on it"}},
                {"name": "run_command", "arguments": {"argv": wait}},
            ]
        },
        {"text": "kid: working...", "hang": True},
        {"tool_calls": [{"name": "interrupt_agent", "arguments": {"agent": "kid"}}]},
        {"text": "Stopped the child."},
    ]
    tools = ["spawn_agent", "interrupt_agent", "run_command"]
    _root, parent, me = _agent(rt, server, script, replies, tools=tools)
    rt.send(parent, "delegate, then stop", authority=me)
    assert rec.turn_ended(parent, timeout=60.0)["outcome"] == "completed"
    [kid] = rt.list_agents(parent)
    assert kid.slug == "kid"
    assert rec.turn_ended(str(kid.id), timeout=30.0)["outcome"] == "cancelled"
    child_request = server.requests_for(script)[1]
    server.wait_disconnect(child_request.id)
    # its cut reply: what it had read of the stream when the cancel came (the server
    # sent it all; the child may not have read it all yet)
    said = texts(rt, str(kid.id), "assistant")
    assert len(said) <= 1 and all("kid: working...".startswith(t) for t in said), said
    # the entries' JSON data: a name is Any (None where one has none)
    names: list[Any] = [(e.data or {}).get("name") for e in entries(rt, parent, "tool")]
    assert sorted(names[:2]) == ["run_command", "spawn_agent"] and names[2] == "interrupt_agent"
    stopped = json.loads(entries(rt, parent, "tool")[2].text)
    assert stopped["accepted"] is True and stopped["turn"] == rt.turns(str(kid.id))[0].id
    assert texts(rt, parent, "assistant")[-1] == "Stopped the child."


def test_a_bad_config_or_a_refused_request_ends_the_turn_failed_with_one_line(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    server.script("pyd-refused", [{"status": 400, "message": "no such\nmodel"}])
    root = rt.open_session(SCRIPTED)
    good = _config(server, "pyd-refused")
    # config mistakes: the worker's check at spawn refuses them (issue 42, item 8)
    for mistake, says in [
        ({**good, "model": {**good["model"], "api_key": "sk-literal"}}, "api_key_env"),
        ({**good, "tools": ["rm_rf"]}, "rm_rf"),
    ]:
        with pytest.raises(tether.InvalidParams, match=says):
            rt.spawn(root, ADAPTER, config=mistake, prompt="hi")
    configs = [
        {**good, "model": {**good["model"], "api_key_env": "TETHER_NO_SUCH_VAR"}},
        good,
    ]
    errors = []
    for i, config in enumerate(configs):
        sid = str(rt.spawn(root, ADAPTER, slug=f"bad{i}", config=config, prompt="hi"))
        ended = rec.turn_ended(sid, timeout=60.0)
        assert ended["outcome"] == "failed", ended
        assert "\n" not in ended["error"] and "Traceback" not in ended["error"]
        assert all("Traceback" not in e.text for e in rt.transcript(sid))
        errors.append(ended["error"])
    assert "TETHER_NO_SUCH_VAR" in errors[0]
    assert "HTTP 400" in errors[1] and "no such model" in errors[1], errors[1]
    assert len(server.requests_for("pyd-refused")) == 1  # a 400 is not retried
    # a factory that is not there is refused at the spawn itself (issue 42, item 15)
    nobody = {**good, "agent": "adapter_agents:no_such_factory"}
    with pytest.raises(tether.DriverNotFound, match="no_such_factory"):
        rt.spawn(root, ADAPTER, slug="bad-factory", config=nobody, prompt="hi")


@pytest.mark.timeout(120)
def test_mcp_tools_opened_by_tether_answer_and_a_preempt_of_a_hung_call_reaches_the_server(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "mcp__files__echo", "arguments": {"text": "from-mcp"}}]},
        {"tool_calls": [{"name": "mcp__files__hang", "arguments": {"seconds": 60}}]},
        {"text": "The search hung; going on without it."},
    ]
    _root, child, me = _agent(rt, server, "pyd-mcp", replies, mcp=mcp)
    rt.send(child, "search", authority=me)

    def hung_call() -> dict[str, Any] | None:
        return next(
            (
                r
                for r in read_log(str(log))
                if r.get("method") == "tools/call" and r.get("tool") == "hang"
            ),
            None,
        )

    call = eventually(hung_call, timeout=60.0, what="the MCP server to receive the hang")
    turn = rt.interrupt(child, authority=me, kind="preempt", reason="search is stuck")
    assert turn is not None
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    cancelled = [r for r in read_log(str(log)) if r.get("method") == "notifications/cancelled"]
    assert [r["requestId"] for r in cancelled] == [call["id"]]
    first, second, third = server.requests_for("pyd-mcp")
    offered = [t["function"]["name"] for t in first.body["tools"]]
    assert "mcp__files__echo" in offered and "lookup" in offered
    assert second.body["messages"][-1] == {
        "role": "tool",
        "tool_call_id": second.body["messages"][-1]["tool_call_id"],
        "content": "from-mcp",
    }
    result = third.body["messages"][-1]["content"]
    assert result.startswith("preempted after ") and "by user: search is stuck" in result
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]
    report = eventually(lambda: rt.stop_report(turn), what="the preempt's report")
    assert [(t.name, t.fate) for t in report.tools] == [("mcp__files__hang", "preempted")]


def test_abort_mid_stream_kills_the_turn_and_the_server_sees_the_disconnect(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    _root, child, me = _agent(rt, server, "pyd-abort", [{"text": "streaming...", "hang": True}])
    rt.send(child, "go", authority=me)
    [request] = server.wait_requests(1, script="pyd-abort", timeout=60.0)
    rt.interrupt(child, authority=me, kind="abort", reason="kill it")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "aborted"
    server.wait_disconnect(request.id)


def test_pause_freezes_the_stream_and_resume_continues_it(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    text = "".join(f"word{i} " for i in range(40)).strip()
    replies = [{"text": text, "chunk": 6, "pace": 0.03}]
    _root, child, me = _agent(rt, server, "pyd-paused", replies)
    rt.send(child, "go", authority=me)
    server.wait_requests(1, script="pyd-paused", timeout=60.0)
    worker = eventually(lambda: talking_to(rt, server), what="the agent's worker")
    assert rt.pause(child, authority=me) != []
    eventually(lambda: frozen(worker), what="the worker frozen")
    assert texts(rt, child, "assistant") == []
    rt.resume(child, authority=me)
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    assert texts(rt, child, "assistant") == [text]
    ours = {r.id for r in server.requests_for("pyd-paused")}
    assert all(d.request not in ours for d in server.disconnects)


def test_a_steer_sent_while_the_final_reply_streams_is_taken_by_the_framework_and_marked_then(
    rt: tether.Runtime, server: ModelServer
) -> None:
    # The reply has no tool call, so no model request follows it in the adapter's own
    # loop: the steer is the framework's to take (Pydantic AI's end-of-run redirect), and
    # its marker is written when the framework delivers it, after the reply it followed.
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"text": "Here is the slow answer, word by word.", "chunk": 2, "pace": 0.05},
        {"text": "Switched to the short answer."},
    ]
    _root, child, me = _agent(rt, server, "pyd-steer-final", replies)
    rt.send(child, "answer", authority=me)
    server.wait_requests(1, script="pyd-steer-final", timeout=60.0)
    rt.interrupt(child, authority=me, kind="steer", reason="keep it short")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    [_, second] = server.requests_for("pyd-steer-final")
    steer = '<steer origin="user" by="user">keep it short</steer>'
    assert second.body["messages"][-1] == {"role": "user", "content": steer}
    assert second.body["messages"][-2]["role"] == "assistant"
    kinds = [e.action or e.kind for e in rt.transcript(child) if e.kind != "user"]
    assert kinds == ["assistant", "steered", "assistant"], kinds
    assert texts(rt, child, "assistant")[-1] == "Switched to the short answer."


def test_with_telemetry_each_model_request_is_a_chat_span_under_the_turn_with_model_and_usage(
    server: ModelServer,
) -> None:
    from otlp_receiver import OtlpReceiver

    script = "pyd-traced"
    replies: list[dict[str, Any]] = [
        {"text": "Let me look.", "tool_calls": [{"name": "lookup", "arguments": {"key": "k1"}}]},
        {"text": "The value is value-of-k1."},
    ]
    with OtlpReceiver() as receiver:
        with tether.Runtime(workers=1, grace=1.0, telemetry={"endpoint": receiver.url}) as rt:
            rec = Recorder(rt)
            _root, child, me = _agent(rt, server, script, replies)
            rt.send(child, "what is k1?", authority=me)
            ended = rec.turn_ended(child, timeout=60.0)
            assert ended["outcome"] == "completed", ended.get("error")
        top, chats = receiver.chats_under(ended["turn"], script, 2)
    assert top.attrs["gen_ai.agent.id"] == child and not top.error
    assert all(c.attrs["gen_ai.provider.name"] == "openai" for c in chats)


@pytest.mark.timeout(240)
def test_a_cancel_as_soon_as_the_stream_was_read_keeps_what_was_read_every_time(
    rt: tether.Runtime, server: ModelServer
) -> None:
    script = "pyd-cut-loop"
    _, child, me = _agent(rt, server, script, CUT_REPLIES)
    cut_every_time(rt, server, script, child, me)


def _tool_messages(request: Any) -> list[tuple[str, str]]:
    """A request's tool results: (the call's name, as its reply asked, the result)."""
    messages = request.body["messages"]
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    return [(names[m["tool_call_id"]], m["content"]) for m in messages if m["role"] == "tool"]


@pytest.mark.parametrize("stopped", ["while-a-sibling-runs", "before-the-next-reply"])
def test_a_tool_result_that_came_back_before_a_cancel_is_in_every_later_request(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path, stopped: str
) -> None:
    # ``lookup`` returns at once. Either its sibling ``slow_search`` still runs when the
    # cancel lands, or every call has returned and the next reply's request is held
    # before its first token: either way, only a call that never returned reads stopped.
    rec = Recorder(rt)
    script = f"pyd-kept-{stopped}"
    started = tmp_path / "search.started"
    calls: list[dict[str, Any]] = [{"name": "lookup", "arguments": {"key": "k1"}}]
    if stopped == "while-a-sibling-runs":
        search = {"query": "q", "started": str(started)}
        calls.append({"name": "slow_search", "arguments": search})
    replies: list[dict[str, Any]] = [
        {"text": "Looking.", "tool_calls": calls},
        {"hang": True},  # the next reply, when every call returned: held
        {"text": "Second answer."},
        {"text": "Third answer."},
    ]
    if stopped == "while-a-sibling-runs":
        del replies[1]
    _root, child, me = _agent(rt, server, script, replies)
    rt.send(child, "look it up", authority=me)
    if stopped == "while-a-sibling-runs":
        eventually(started.exists, timeout=60.0, what="the slow search to run")
        eventually(lambda: entries(rt, child, "tool"), what="lookup's result")
    else:
        server.wait_requests(2, script=script, timeout=60.0)
        server.wait_for(lambda s: s.requests_for(script)[1].hanging, what="the held reply")
    rt.interrupt(child, authority=me, kind="cancel", reason="enough")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "cancelled"

    expected = [("lookup", "value-of-k1")]
    if stopped == "while-a-sibling-runs":
        expected.append(("slow_search", "(no result: stopped)"))
    for count, question in [(2, "and now?"), (3, "and still?")]:
        rt.send(child, question, authority=me)
        assert rec.turn_ended(child, count=count, timeout=30.0)["outcome"] == "completed"
        assert _tool_messages(server.requests_for(script)[-1]) == expected


def _pause_cancel_resume(
    rt: tether.Runtime, server: ModelServer, child: str, me: User, files: tuple[Path, Path]
) -> str:
    """One turn whose tool waits for ``release``, which appears while the worker is
    frozen, with a cancel issued then; the turn's id."""
    started, release = files
    call = {"name": "wait_for_file", "arguments": {"path": str(release), "started": str(started)}}
    server.script("pyd-pause-cancel", [{"tool_calls": [call]}])
    rt.send(child, "wait for it", authority=me)
    eventually(lambda: started.exists() and started.read_text(), timeout=60.0, what="the tool")
    worker = psutil.Process(int(started.read_text()))
    assert rt.pause(child, authority=me) != []
    eventually(lambda: frozen(worker), what="the worker frozen")
    release.touch()
    turn = rt.interrupt(child, authority=me, kind="cancel", reason="while paused")
    assert turn is not None
    rt.resume(child, authority=me)
    return turn


@pytest.mark.timeout(300)
def test_a_tool_that_returns_as_a_paused_and_cancelled_turn_resumes_has_its_entry_when_reported_returned(  # noqa: E501
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    # On resume the tool returns as the cancel issued during the pause reaches the worker.
    # Whichever wins, the stop report and the transcript agree: a call reported
    # ``returned`` has its entry, with its result; one that has no entry was not.
    rec = Recorder(rt)
    _root, child, me = _agent(rt, server, "pyd-pause-cancel", [{"text": "unused"}])
    fates: list[str] = []
    for i in range(60):  # the race went wrong in ~1 try of 12 before the fix
        files = (tmp_path / f"started-{i}", tmp_path / f"release-{i}")
        turn = _pause_cancel_resume(rt, server, child, me, files)
        assert rec.turn_ended(child, count=i + 1, timeout=30.0)["outcome"] == "cancelled"
        report = final_report(rt, turn)
        [fate] = [t.fate for t in report.tools]
        kept = [e.text for e in entries(rt, child, "tool") if e.turn == turn]
        if fate == "returned":
            assert kept == [f"{files[1]} appeared"], (i, fate, kept)
        else:
            assert kept == [], (i, fate, kept)
        fates.append(fate)
    assert set(fates) <= {"returned", "cancelled"}, fates
