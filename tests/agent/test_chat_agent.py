"""``tether.agents:ChatAgent`` (semantics §15.2) against the real model server over HTTP.

The model server (``tether.testing.model_server``) runs in a process of its own on
loopback; the agent runs in a worker process and talks to it with the official
``openai`` client. Each test has its own script, chosen by the model name it configures.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import structlog
import structlog.testing

import tether
from drivers import (
    ROOT,
    SCRIPTED,
    Recorder,
    alive,
    entries,
    eventually,
    family,
    frozen,
    refilled,
    texts,
    wait_entry,
    worker_with_tool,
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
from tether.testing.mcp_server import LOG_ENV, read_log

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("api_key")]

CHAT = "tether.agents:ChatAgent"
KEY_ENV = "TETHER_TEST_MODEL_KEY"
SECRET = "sk-tether-test-0123456789abcdef"


def _config(server: ModelServer, script: str, **extra: Any) -> dict[str, Any]:
    model = {
        "base_url": server.url,
        "name": script,
        "api_key_env": KEY_ENV,
        "retries": 2,
        "backoff": 0.01,
        "timeout": 30,
    }
    return {"model": model, "system": "You are a test agent.", "tools": ["run_command"], **extra}


def _agent(
    rt: tether.Runtime,
    server: ModelServer,
    script: str,
    replies: list[dict[str, Any]],
    **extra: Any,
) -> tuple[str, str, User]:
    server.script(script, replies)
    return family(
        rt, CHAT, root_driver=SCRIPTED, slug="agent", config=_config(server, script, **extra)
    )


def test_a_turn_calls_run_command_and_completes_with_replies_tool_entries_usage_and_no_key(
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    server: ModelServer,
    db_path: str,
) -> None:
    # Everything logged (host and workers) to the captured stderr: the runtime starts
    # here, in the test, so its workers inherit the captured descriptor.
    monkeypatch.setenv("TETHER_LOG", "debug")
    with (
        structlog.testing.capture_logs() as host_logs,  # the host's events, every level
        tether.Runtime(db_path, workers=2, grace=1.0) as art,
    ):
        _run_command_turn(art, server)
    with sqlite3.connect(db_path) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f"SELECT * FROM {table}"):
                assert SECRET not in repr(row), table
    out, err = capfd.readouterr()
    assert "model.request" in err  # the workers' debug lines were captured ...
    assert any(e["event"] == "turn.ended" for e in host_logs)  # ... and the host's ...
    assert SECRET not in out and SECRET not in err  # ... and the key is in none of them
    assert SECRET not in repr(host_logs)


def _run_command_turn(art: tether.Runtime, server: ModelServer) -> None:
    rec = Recorder(art)
    replies = [
        {
            "text": "Let me look.",
            "tool_calls": [{"name": "run_command", "arguments": {"argv": ["echo", "hello-tool"]}}],
            "chunk": 3,
        },
        {"text": "The tool said hello-tool.", "chunk": 3},
    ]
    root, child, me = _agent(art, server, "runs-a-command", replies)
    art.send(child, "what does the tool say?", authority=me)
    ended = rec.turn_ended(child, timeout=30.0)
    assert ended["outcome"] == "completed", ended

    said = [(e.kind, e.text) for e in art.transcript(child)]
    assert said[0] == ("user", "what does the tool say?")
    assert said[1] == ("assistant", "Let me look.")
    assert said[2][0] == "tool" and json.loads(said[2][1])["stdout"] == "hello-tool\n"
    assert said[3] == ("assistant", "The tool said hello-tool.")
    [first, second] = server.requests_for("runs-a-command")
    assert first.body["messages"][0] == {"role": "system", "content": "You are a test agent."}
    assert first.body["stream_options"] == {"include_usage": True}
    assert [t["function"]["name"] for t in first.body["tools"]] == ["run_command"]
    tool_msg = second.body["messages"][-1]
    assert tool_msg["role"] == "tool" and "hello-tool" in tool_msg["content"]
    usage = art.turns(child)[0].usage
    assert usage is not None and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert last_notice(art, root)["partial"] == "The tool said hello-tool."

    # The key reached the server (and, the caller checks, nothing else)
    assert first.authorization == f"Bearer {SECRET}"


def test_a_cancel_mid_stream_closes_the_connection_before_the_turn_ends_and_keeps_the_partial(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    text = "I am halfway through a long answer"
    root, child, me = _agent(
        rt, server, "cut-mid-stream", [{"text": text, "chunk": 4, "hang": True}]
    )
    rt.send(child, "tell me everything", authority=me)
    [request] = server.wait_requests(1, script="cut-mid-stream", timeout=30.0)
    server.wait_for(lambda s: s.requests_for("cut-mid-stream")[0].hanging, what="the hang")
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
    notice = last_notice(rt, root)
    assert (notice["outcome"], notice["partial"]) == ("cancelled", cut)


def test_a_reply_cut_by_a_cancel_counts_its_prompt_and_what_streamed_as_estimated_usage(
    server: ModelServer,
) -> None:
    # The stream's usage chunk comes at its end, which a cut reply never reaches
    check_a_cut_reply_is_counted(server, CHAT, _config(server, "cut-costs"))


def test_a_steer_sent_mid_stream_reaches_the_next_request_as_a_steer_message(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {
            "text": "Working on the slow path, step by step.",
            "tool_calls": [{"name": "run_command", "arguments": {"argv": ["true"]}}],
            "chunk": 2,
            "pace": 0.02,
        },
        {"text": "Switched to the fast path."},
    ]
    _root, child, me = _agent(rt, server, "steered", replies)
    rt.send(child, "do the task", authority=me)
    server.wait_requests(1, script="steered", timeout=30.0)
    rt.interrupt(child, authority=me, kind="steer", reason="use the <fast> path")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    [_, second] = server.requests_for("steered")
    steer = '<steer origin="user" by="user">use the &lt;fast&gt; path</steer>'
    assert second.body["messages"][-1] == {"role": "user", "content": steer}
    assert second.body["messages"][-2]["role"] == "tool"
    assert [m.action for m in entries(rt, child, "marker")] == ["steered"]


def test_a_steer_between_two_tool_calls_keeps_both_results_in_the_history_and_the_steer_after_them(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    go = tmp_path / "go"
    wait_go = f"while [ ! -e {go} ]; do sleep 0.01; done; echo first-result"
    replies: list[dict[str, Any]] = [
        {
            "tool_calls": [
                {"name": "run_command", "arguments": {"argv": ["sh", "-c", wait_go]}},
                # a host call: its reply comes down the worker's pipe after the steer
                # did, so the steer is pending at the boundary after it at the latest
                {"name": "list_agents", "arguments": {}},
                {"name": "run_command", "arguments": {"argv": ["echo", "third-result"]}},
            ]
        },
        {"text": "Done, the fast way."},
        {"text": "Still here."},
    ]
    _root, child, me = _agent(
        rt, server, "steer-between-calls", replies, tools=["run_command", "list_agents"]
    )
    rt.send(child, "do the task", authority=me)
    worker_with_tool(rt, "sh")
    rt.interrupt(child, authority=me, kind="steer", reason="use the fast path")
    go.touch()
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    kinds = [e.kind if e.kind != "marker" else e.action for e in rt.transcript(child)]
    # the steer landed between the calls of one reply (the case this test is about)
    assert kinds.index("steered") < len(kinds) - 1 - kinds[::-1].index("tool")

    rt.send(child, "and now?", authority=me)
    assert rec.turn_ended(child, count=2, timeout=30.0)["outcome"] == "completed"
    [_, live, later] = server.requests_for("steer-between-calls")
    said = '<steer origin="user" by="user">use the fast path</steer>'
    steer = {"role": "user", "content": said}
    sent = live.body["messages"]
    # the live request: every call's result right after the reply, then the steer
    assert [m["role"] for m in sent[-5:]] == ["assistant", "tool", "tool", "tool", "user"]
    assert sent[-1] == steer
    assert "third-result" in sent[-2]["content"]
    # the next turn's history says the same, in the same order
    assert later.body["messages"][: len(sent)] == sent
    assert later.body["messages"][len(sent) :] == [
        {"role": "assistant", "content": "Done, the fast way."},
        {"role": "user", "content": "and now?"},
    ]
    assert all("no result" not in (m.get("content") or "") for m in later.body["messages"][1:])


def test_a_preempt_of_a_hung_command_gives_the_model_the_preempted_result_and_the_turn_completes(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    hung = {"argv": ["sh", "-c", "echo started; sleep 30"]}
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "run_command", "arguments": hung}]},
        {"text": "That took too long; moving on."},
    ]
    _root, child, me = _agent(rt, server, "preempted", replies)
    rt.send(child, "run it", authority=me)
    # a fresh worker imports the openai client first (seconds on a loaded machine)
    server.wait_requests(1, script="preempted", timeout=30.0)
    worker_with_tool(rt, "sleep")
    rt.interrupt(child, authority=me, kind="preempt", reason="too slow")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    [_, second] = server.requests_for("preempted")
    result = second.body["messages"][-1]
    assert result["role"] == "tool"
    assert result["content"].startswith("preempted after ")
    assert "by user: too slow" in result["content"]
    assert "started" in result["content"]  # the partial output
    assert texts(rt, child, "assistant")[-1] == "That took too long; moving on."
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]


def test_a_run_command_past_its_max_duration_is_preempted_by_system_and_the_turn_goes_on(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "run_command", "arguments": {"argv": ["sleep", "30"]}}]},
        {"text": "Gave up on the slow command."},
    ]
    policy = {"run_command": {"max_duration": 0.5}}
    _root, child, me = _agent(rt, server, "max-duration", replies, tool_policy=policy)
    rt.send(child, "run it", authority=me)
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    [_, second] = server.requests_for("max-duration")
    result = second.body["messages"][-1]["content"]
    assert result.startswith("preempted after ")
    assert "by system (policy): max_duration 0.5 s exceeded" in result
    [marker] = entries(rt, child, "marker")
    assert (marker.action, marker.origin) == ("preempted", "system")


def test_429_and_500_are_retried_with_backoff_and_the_turn_completes(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [{"status": 429}, {"status": 500}, {"text": "third time lucky"}]
    _root, child, me = _agent(rt, server, "flaky", replies)
    rt.send(child, "try", authority=me)
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    assert [r.status for r in server.requests_for("flaky")] == [429, 500, 200]
    assert texts(rt, child, "assistant") == ["third time lucky"]


def test_errors_past_the_retries_and_a_400_end_the_turn_failed_with_one_line(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    _r1, down, me1 = _agent(rt, server, "down", [{"status": 503, "count": 10}])
    _r2, bad, me2 = _agent(rt, server, "bad", [{"status": 400, "message": "no such\nmodel"}])
    rt.send(down, "try", authority=me1)
    rt.send(bad, "try", authority=me2)
    for sid, n in ((down, 3), (bad, 1)):
        ended = rec.turn_ended(sid, timeout=30.0)
        assert ended["outcome"] == "failed"
        error = ended["error"]
        assert "\n" not in error and "Traceback" not in error
        assert all("Traceback" not in e.text for e in rt.transcript(sid))
        assert len(server.requests_for("down" if sid == down else "bad")) == n
    assert "after 2 retries: HTTP 503" in rt.turns(down)[0].error  # type: ignore[operator]
    assert "HTTP 400: no such model" in rt.turns(bad)[0].error  # type: ignore[operator]


def test_abort_mid_stream_kills_the_turn_and_the_server_sees_the_disconnect(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    _root, child, me = _agent(rt, server, "aborted", [{"text": "streaming...", "hang": True}])
    rt.send(child, "go", authority=me)
    [request] = server.wait_requests(1, script="aborted", timeout=30.0)
    rt.interrupt(child, authority=me, kind="abort", reason="kill it")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "aborted"
    server.wait_disconnect(request.id)


def test_pause_freezes_the_stream_and_resume_continues_it(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    text = "".join(f"word{i} " for i in range(40)).strip()
    _root, child, me = _agent(rt, server, "paused", [{"text": text, "chunk": 6, "pace": 0.03}])
    rt.send(child, "go", authority=me)
    server.wait_requests(1, script="paused", timeout=30.0)
    worker = eventually(lambda: talking_to(rt, server), what="the agent's worker")
    assert rt.pause(child, authority=me) != []
    eventually(lambda: frozen(worker), what="the worker frozen")
    time.sleep(0.5)  # frozen: the stream is not read meanwhile
    assert frozen(worker)
    assert texts(rt, child, "assistant") == []
    rt.resume(child, authority=me)
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
    assert texts(rt, child, "assistant") == [text]
    assert server.disconnects == [] or all(
        d.request not in {r.id for r in server.requests_for("paused")} for d in server.disconnects
    )


@pytest.mark.timeout(240)
def test_a_cancel_as_soon_as_the_stream_was_read_keeps_what_was_read_every_time(
    rt: tether.Runtime, server: ModelServer
) -> None:
    script = "cut-loop"
    _, child, me = _agent(rt, server, script, CUT_REPLIES)
    cut_every_time(rt, server, script, child, me)


def test_a_bad_config_is_refused_at_spawn_and_a_missing_key_fails_the_turn_with_one_line(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    root = rt.open_session(SCRIPTED)
    # config mistakes: the worker's check at spawn refuses them (issue 42, item 8)
    mistakes: list[tuple[dict[str, Any], str]] = [
        ({"model": {"base_url": server.url, "api_key": "sk-literal"}}, "api_key_env"),
        ({"model": {"base_url": server.url}, "tools": ["rm_rf"]}, "rm_rf"),
    ]
    for mistake, says in mistakes:
        with pytest.raises(tether.InvalidParams, match=says):
            rt.spawn(root, CHAT, config=mistake, prompt="hi")
    # a key missing from the environment is found out by the turn
    unset = {"base_url": server.url, "api_key_env": "TETHER_NO_SUCH_VAR"}
    config: dict[str, Any] = {"model": unset}
    sid = str(rt.spawn(root, CHAT, slug="bad", config=config, prompt="hi"))
    ended = rec.turn_ended(sid, timeout=30.0)
    assert ended["outcome"] == "failed" and "\n" not in ended["error"]
    assert "TETHER_NO_SUCH_VAR" in ended["error"], ended
    wait_entry(rt, root, "notice", "failed")


@pytest.mark.timeout(120)
def test_the_agent_demo_shows_a_steer_a_cut_stream_and_a_preempted_tool(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tether.cli.demo import main

    assert main(["--agent"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "next request ends with: <steer" in out
    assert "turn cancelled; partial reply kept" in out and "server saw the disconnect" in out
    assert "the MCP server got notifications/cancelled" in out
    assert "the model got: preempted after" in out
    # The tool hung a visible while before the preempt: the model is not told 0.0 s.
    elapsed = re.search(r"the model got: preempted after (\d+(?:\.\d)?) s", out)
    assert elapsed is not None and float(elapsed.group(1)) >= 1.0, out
    assert "demo finished" in out


# ---- MCP tools (tether.agents.mcp, semantics §15.3) ------------------------------------------


def _mcp_server_procs(rt: tether.Runtime) -> list[psutil.Process]:
    found = []
    for pid in rt.worker_pids:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "tether.testing.mcp_server" in " ".join(p.cmdline()):
                        found.append(p)
    return found


def test_a_turn_calls_run_command_and_an_mcp_tool_and_completes(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, _log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {
            "tool_calls": [
                {"name": "run_command", "arguments": {"argv": ["echo", "from-the-shell"]}},
                {"name": "mcp__files__echo", "arguments": {"text": "from-the-mcp-server"}},
            ]
        },
        {"text": "Both tools answered."},
    ]
    _root, child, me = _agent(rt, server, "with-mcp", replies, mcp=mcp)
    rt.send(child, "use both tools", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    [first, second] = server.requests_for("with-mcp")
    offered = [t["function"]["name"] for t in first.body["tools"]]
    assert "run_command" in offered and "mcp__files__echo" in offered
    results = [m["content"] for m in second.body["messages"] if m["role"] == "tool"]
    assert "from-the-shell" in results[0] and "from-the-mcp-server" in results[1]
    tools = entries(rt, child, "tool")
    assert [(e.data or {}).get("name") for e in tools] == ["run_command", "mcp__files__echo"]
    assert texts(rt, child, "assistant")[-1] == "Both tools answered."


@pytest.mark.timeout(120)
def test_a_preempt_of_a_hung_mcp_call_reaches_the_server_and_the_turn_goes_on(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "mcp__files__hang", "arguments": {"seconds": 60}}]},
        {"text": "The search hung; going on without it."},
    ]
    _root, child, me = _agent(rt, server, "mcp-preempt", replies, mcp=mcp)
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
    [_, second] = server.requests_for("mcp-preempt")
    result = second.body["messages"][-1]["content"]
    assert result.startswith("preempted after ") and "by user: search is stuck" in result
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]
    assert texts(rt, child, "assistant")[-1] == "The search hung; going on without it."
    report = eventually(lambda: rt.stop_report(turn), what="the preempt's report")
    assert [(t.name, t.fate) for t in report.tools] == [("mcp__files__hang", "preempted")]


@pytest.mark.timeout(120)
def test_abort_kills_the_mcp_servers_tree_and_pause_freezes_it(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, log = mcp_files(tmp_path)
    replies = [{"tool_calls": [{"name": "mcp__files__hang", "arguments": {"seconds": 60}}]}]
    _root, child, me = _agent(rt, server, "mcp-abort", replies, mcp=mcp)
    rt.send(child, "search", authority=me)
    eventually(
        lambda: any(r.get("method") == "tools/call" for r in read_log(str(log))),
        timeout=60.0,
        what="the MCP server to receive the call",
    )
    [srv] = _mcp_server_procs(rt)
    assert rt.pause(child, authority=me) != []
    eventually(lambda: frozen(srv), what="the MCP server frozen")
    rt.resume(child, authority=me)
    eventually(lambda: not frozen(srv), what="the MCP server thawed")
    rt.interrupt(child, authority=me, kind="abort", reason="enough")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "aborted"
    eventually(lambda: not alive(srv), what="the MCP server's death")
    refilled(rt)


@pytest.mark.timeout(120)
def test_an_mcp_call_past_its_max_duration_is_a_preempt_of_origin_system(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "mcp__files__hang", "arguments": {"seconds": 60}}]},
        {"text": "Too slow; moving on."},
    ]
    policy = {"mcp:files/hang": {"max_duration": 0.5}}
    _root, child, me = _agent(rt, server, "mcp-limit", replies, mcp=mcp, tool_policy=policy)
    rt.send(child, "search", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    assert any(r.get("method") == "notifications/cancelled" for r in read_log(str(log)))
    [_, second] = server.requests_for("mcp-limit")
    result = second.body["messages"][-1]["content"]
    assert "by system (policy): max_duration 0.5 s exceeded" in result
    [marker] = entries(rt, child, "marker")
    assert (marker.action, marker.origin) == ("preempted", "system")


@pytest.fixture
def hung_http(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Streamable HTTP MCP server (the SDK's) that reads the handshake and never answers."""
    log = tmp_path / "hung.log"
    src = str(ROOT / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.testing.mcp_server", "--http", "0", "--hang-handshake"],
        env={**os.environ, LOG_ENV: str(log), "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(60.0), "the hung server printed no URL"
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url, log
    finally:
        proc.kill()
        proc.wait(timeout=30.0)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(120)
def test_a_cancel_while_an_http_mcp_server_is_initializing_ends_the_turn_within_grace(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path, hung_http: tuple[str, Path]
) -> None:
    # The stdio server connects first (names are opened in order), then the HTTP one
    # hangs in its handshake; the cancel must unwind it at once: the turn ends cancelled
    # well within the grace, never force-broken, and the worker and its stdio server live.
    rec = Recorder(rt)
    mcp, _log = mcp_files(tmp_path)
    url, hung_log = hung_http
    mcp["servers"]["slow"] = {"url": url}
    replies = [{"text": "never asked"}]
    _root, child, me = _agent(rt, server, "mcp-hung-init", replies, mcp=mcp)
    rt.send(child, "search", authority=me)
    eventually(
        lambda: any(r.get("event") == "handshake_held" for r in read_log(str(hung_log))),
        timeout=60.0,
        what="the HTTP server to hold the handshake",
    )
    [srv] = _mcp_server_procs(rt)
    workers = set(rt.worker_pids)
    began = time.monotonic()
    rt.interrupt(child, authority=me, kind="cancel", reason="enough", grace=2.0)
    ended = rec.turn_ended(child, timeout=30.0)
    took = time.monotonic() - began
    assert ended["outcome"] == "cancelled" and not ended.get("forced"), ended
    assert took < 1.5, f"the cancel took {took:.2f} s to end the turn"
    assert alive(srv) and set(rt.worker_pids) == workers
    assert server.requests_for("mcp-hung-init") == []


@pytest.mark.timeout(120)
def test_one_mcp_server_that_will_not_start_leaves_the_turn_with_the_others_tools_and_says_so(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, _log = mcp_files(tmp_path)
    mcp["servers"]["broken"] = {"command": ["/nonexistent/mcp-server"]}
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "mcp__files__echo", "arguments": {"text": "still-here"}}]},
        {"text": "Done without the broken one."},
    ]
    _root, child, me = _agent(rt, server, "mcp-one-broken", replies, mcp=mcp)
    rt.send(child, "search", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    [first, second] = server.requests_for("mcp-one-broken")
    offered = [t["function"]["name"] for t in first.body["tools"]]
    assert "mcp__files__echo" in offered and not any("broken" in n for n in offered)
    [system] = [m["content"] for m in first.body["messages"] if m["role"] == "system"]
    [line] = [ln for ln in system.splitlines() if "broken" in ln]
    assert "its tools not offered" in line and "could not start" in line
    assert "No such file or directory" in line
    results = [m["content"] for m in second.body["messages"] if m["role"] == "tool"]
    assert results == ["still-here"]
    [said] = [e for e in entries(rt, child, "tool") if (e.data or {}).get("mcp_unavailable")]
    assert said.data == {"mcp_unavailable": "broken"} and "could not start" in said.text
    assert texts(rt, child, "assistant")[-1] == "Done without the broken one."


def test_an_mcp_config_whose_every_server_fails_ends_the_turn_failed_with_one_line(
    rt: tether.Runtime, server: ModelServer
) -> None:
    rec = Recorder(rt)
    mcp = {"servers": {"a": {"command": ["/nonexistent/a"]}, "b": {"command": ["/nonexistent/b"]}}}
    _root, child, me = _agent(rt, server, "mcp-all-broken", [{"text": "never"}], mcp=mcp)
    rt.send(child, "search", authority=me)
    ended = rec.turn_ended(child, timeout=60.0)
    assert ended["outcome"] == "failed" and "\n" not in ended["error"], ended
    assert "mcp server 'a' could not start" in ended["error"]
    assert "mcp server 'b' could not start" in ended["error"]
    assert server.requests_for("mcp-all-broken") == []


@pytest.mark.timeout(180)
def test_a_worker_keeps_the_stdio_servers_of_at_most_four_mcp_configs(
    server: ModelServer, tmp_path: Path, db_path: str
) -> None:
    # Seven sessions, six configs that differ only in a server's env, one after another
    # on one worker: the least recently used config's servers are closed as a fifth opens,
    # so the worker never holds more than four, and a reused config keeps its server.
    with tether.Runtime(db_path, workers=1, grace=1.0) as one:
        rec = Recorder(one)
        seen: list[int] = []
        workers: set[int] = set()
        for i, env in enumerate(["0", "1", "2", "3", "0", "4", "5"]):
            mcp, _log = mcp_files(tmp_path)
            mcp["servers"]["files"]["env"]["TETHER_TEST_SET"] = env
            replies: list[dict[str, Any]] = [
                {"tool_calls": [{"name": "mcp__files__echo", "arguments": {"text": env}}]},
                {"text": "ok"},
            ]
            _root, child, me = _agent(one, server, f"mcp-sets-{i}", replies, mcp=mcp)
            one.send(child, "echo", authority=me)
            assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
            servers = _mcp_server_procs(one)
            workers.update(p.ppid() for p in servers)
            assert len(workers) == 1, workers  # one active worker: every turn on it
            assert len(servers) <= 4, [p.pid for p in servers]
            sets = sorted(p.environ().get("TETHER_TEST_SET", "?") for p in servers)
            seen.append(len(servers))
            if i == 4:  # "0" reused: its server kept, no new one
                assert sets == ["0", "1", "2", "3"]
        assert sets == ["0", "3", "4", "5"]  # "1" and "2" were least recently used
        assert seen == [1, 2, 3, 4, 4, 4, 4]


def _tool_entries(rt: tether.Runtime, sid: str) -> list[tuple[str, dict[str, Any]]]:
    return [(e.text, e.data or {}) for e in entries(rt, sid, "tool")]


@pytest.mark.timeout(120)
def test_a_user_preempt_of_an_mcp_call_gives_the_model_its_progress_so_far(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {
            "tool_calls": [
                {"name": "mcp__files__progress", "arguments": {"steps": 6000, "every": 0.01}}
            ]
        },
        {"text": "Stopped it partway."},
    ]
    _root, child, me = _agent(rt, server, "mcp-preempt-progress", replies, mcp=mcp)
    rt.send(child, "index everything", authority=me)
    eventually(
        lambda: any(
            r.get("event") == "progress_sent" and r["step"] >= 5 for r in read_log(str(log))
        ),
        timeout=60.0,
        what="the MCP server to report some progress",
    )
    rt.interrupt(child, authority=me, kind="preempt", reason="enough indexing")
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    [_, second] = server.requests_for("mcp-preempt-progress")
    result = second.body["messages"][-1]["content"]
    assert "by user: enough indexing\npartial output:\nprogress " in result
    assert "/6000: step " in result
    [(text, data)] = _tool_entries(rt, child)
    assert text == result and data["preempted"] is True


@pytest.mark.timeout(120)
def test_an_mcp_call_stopped_by_its_idle_timeout_or_max_duration_leaves_a_preempted_tool_entry(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, _log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {
            "tool_calls": [
                {"name": "mcp__files__hang", "arguments": {"seconds": 60}},
                {"name": "mcp__files__progress", "arguments": {"steps": 2, "every": 30}},
            ]
        },
        {"text": "Both were too slow."},
    ]
    policy = {"mcp:files/hang": {"max_duration": 0.5}, "mcp:files/progress": {"idle_timeout": 0.5}}
    _root, child, me = _agent(rt, server, "mcp-limits", replies, mcp=mcp, tool_policy=policy)
    rt.send(child, "search", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    [(hang, hung), (idle, idled)] = _tool_entries(rt, child)
    assert "by system (policy): max_duration 0.5 s exceeded" in hang and hung["preempted"] is True
    assert "by system (policy): idle_timeout 0.5 s exceeded" in idle and idled["preempted"] is True


@pytest.mark.timeout(120)
def test_a_cancelled_mcp_call_leaves_a_tool_entry_saying_so_and_the_report_a_null_partial(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    mcp, log = mcp_files(tmp_path)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "mcp__files__hang", "arguments": {"seconds": 60}}]},
        {"text": "Starting over."},
    ]
    _root, child, me = _agent(rt, server, "mcp-cancelled", replies, mcp=mcp)
    rt.send(child, "search", authority=me)
    eventually(
        lambda: any(r.get("method") == "tools/call" for r in read_log(str(log))),
        timeout=60.0,
        what="the MCP server to receive the call",
    )
    turn = rt.interrupt(child, authority=me, kind="cancel", reason="wrong search")
    assert turn is not None
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "cancelled"
    [(text, data)] = _tool_entries(rt, child)
    assert text.startswith("cancelled after ") and text.endswith("by user: wrong search")
    assert data["cancelled"] is True and data["name"] == "mcp__files__hang"
    report = eventually(
        lambda: (r := rt.stop_report(turn)) is not None and r.outcome is not None and r,
        what="the cancel's complete report",
    )
    assert [(t.name, t.fate) for t in report.tools] == [("mcp__files__hang", "cancelled")]
    assert report.partial is None  # the turn said no assistant text, only a tool call
    assert msgspec.to_builtins(report)["partial"] is None

    # the next turn's model reads what really became of the call
    rt.send(child, "try again", authority=me)
    assert rec.turn_ended(child, count=2, timeout=60.0)["outcome"] == "completed"
    [_, later] = server.requests_for("mcp-cancelled")
    results = [m["content"] for m in later.body["messages"] if m["role"] == "tool"]
    assert results == [text]


def _echo_turn(
    rt: tether.Runtime, rec: Recorder, server: ModelServer, tmp_path: Path, script: str, env: str
) -> tuple[str, User]:
    """A session whose MCP server differs from others' by ``env`` (TETHER_TEST_SET) and
    one completed turn of it that called the server's echo tool."""
    mcp, _log = mcp_files(tmp_path)
    mcp["servers"]["files"]["env"]["TETHER_TEST_SET"] = env
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "mcp__files__echo", "arguments": {"text": env}}]},
        {"text": "ok"},
    ]
    _root, child, me = _agent(rt, server, script, replies, mcp=mcp)
    rt.send(child, "echo", authority=me)
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == "completed"
    return child, me


def _servers_by_set(rt: tether.Runtime) -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {}
    for p in _mcp_server_procs(rt):
        with contextlib.suppress(psutil.Error):
            found.setdefault(p.environ().get("TETHER_TEST_SET", "?"), []).append(p)
    return found


@pytest.mark.timeout(180)
def test_disposing_a_session_closes_the_stdio_servers_its_worker_opened_for_it_and_no_others(
    server: ModelServer, tmp_path: Path, db_path: str
) -> None:
    # Two sessions with distinct MCP configs on one worker: disposing one kills its
    # server at once (not when the LRU bound gets to it); the other's server stays, and
    # the other's next turn still calls it.
    with tether.Runtime(db_path, workers=1, grace=1.0) as one:
        rec = Recorder(one)
        a, me_a = _echo_turn(one, rec, server, tmp_path, "mcp-disposed-a", "a")
        b, me_b = _echo_turn(one, rec, server, tmp_path, "mcp-disposed-b", "b")
        before = _servers_by_set(one)
        assert sorted(before) == ["a", "b"] and all(len(v) == 1 for v in before.values())
        [worker] = {p.ppid() for procs in before.values() for p in procs}
        [srv_a], [srv_b] = before["a"], before["b"]
        one.dispose(a, authority=me_a)
        eventually(lambda: not alive(srv_a), timeout=30.0, what="a's server to be closed")
        assert alive(srv_b) and sorted(_servers_by_set(one)) == ["b"]
        assert worker in one.worker_pids  # the same worker: nothing was killed
        replies: list[dict[str, Any]] = [
            {"tool_calls": [{"name": "mcp__files__echo", "arguments": {"text": "again"}}]},
            {"text": "still ok"},
        ]
        server.script("mcp-disposed-b", replies)
        one.send(b, "echo again", authority=me_b)
        assert rec.turn_ended(b, count=2, timeout=60.0)["outcome"] == "completed"
        [_, second] = server.requests_for("mcp-disposed-b")[-2:]
        assert [m["content"] for m in second.body["messages"] if m["role"] == "tool"][-1] == (
            "again"
        )
        assert _servers_by_set(one) == {"b": [srv_b]}  # the same server served it


@pytest.mark.timeout(180)
def test_disposing_one_of_two_sessions_that_share_an_mcp_config_keeps_their_server(
    server: ModelServer, tmp_path: Path, db_path: str
) -> None:
    # The set goes only with the last session that used it: disposing the other too
    # (dormant by then, released) closes it.
    with tether.Runtime(db_path, workers=1, grace=1.0) as one:
        rec = Recorder(one)
        a, me_a = _echo_turn(one, rec, server, tmp_path, "mcp-shared-a", "s")
        b, me_b = _echo_turn(one, rec, server, tmp_path, "mcp-shared-b", "s")
        [srv] = _servers_by_set(one)["s"]
        one.dispose(a, authority=me_a)
        one.release(b)  # dormant: its host no longer holds it, the worker still does
        # a frame after the disposal's, handled after it: a turn of another session
        _c, _me = _echo_turn(one, rec, server, tmp_path, "mcp-shared-c", "c")
        assert alive(srv) and _servers_by_set(one)["s"] == [srv]
        one.dispose(b, authority=me_b)
        eventually(lambda: not alive(srv), timeout=30.0, what="the shared server to be closed")
        assert sorted(_servers_by_set(one)) == ["c"]


@pytest.mark.timeout(180)
def test_a_disposal_while_the_worker_runs_a_paused_turn_waits_for_it_and_never_disturbs_it(
    server: ModelServer, tmp_path: Path, db_path: str
) -> None:
    # The one worker holds a's server and runs b's turn (in a tool, then paused): the
    # disposal of a returns at once, a's server stays while b's turn runs, b's turn
    # resumes and completes untouched, and a's server goes after it.
    with tether.Runtime(db_path, workers=1, grace=1.0) as one:
        rec = Recorder(one)
        a, me_a = _echo_turn(one, rec, server, tmp_path, "mcp-busy-a", "a")
        [srv_a] = _servers_by_set(one)["a"]
        go = tmp_path / "go"
        wait_go = f"while [ ! -e {go} ]; do sleep 0.01; done; echo released"
        replies: list[dict[str, Any]] = [
            {"tool_calls": [{"name": "run_command", "arguments": {"argv": ["sh", "-c", wait_go]}}]},
            {"text": "b is done"},
        ]
        _root, b, me_b = _agent(one, server, "mcp-busy-b", replies)
        one.send(b, "wait", authority=me_b)
        worker_with_tool(one, "sleep")
        [running] = one.pause(b, authority=me_b, reason="hold on")
        began = time.monotonic()
        one.dispose(a, authority=me_a)
        assert time.monotonic() - began < 5.0  # the paused worker held nothing up
        assert alive(srv_a)  # nothing runs in the worker between turns until b's ends
        assert one.resume(b, authority=me_b) == [running]
        go.touch()
        ended = rec.turn_ended(b, timeout=60.0)
        assert ended["outcome"] == "completed", ended
        [_, second] = server.requests_for("mcp-busy-b")
        [result] = [m["content"] for m in second.body["messages"] if m["role"] == "tool"]
        assert "released" in result
        eventually(lambda: not alive(srv_a), timeout=30.0, what="a's server to be closed")
