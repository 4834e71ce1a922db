"""``tether.adapters.claude_code:ClaudeCodeAgent`` (semantics §16.1) with the real Claude Code CLI.

The CLI (bundled with ``claude-agent-sdk``) runs as a child of a worker and talks the
Anthropic Messages wire to ``tether.testing.ModelServer`` on loopback: no key, no
network. Each test has a server of its own (the CLI names its script by its model name).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest

import tether
from drivers import (
    SCRIPTED,
    Recorder,
    alive,
    entries,
    escapee,
    escapee_procs,
    eventually,
    family,
    frozen,
    runtime,
    texts,
    worker_with_tool,
)
from model_helpers import all_read, mcp_files, server_port
from tether import User
from tether.testing import ModelServer
from tether.testing.escapee import escapee_loop
from tether.testing.mcp_server import read_log

pytest.importorskip("claude_agent_sdk")

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("api_key")]

AGENT = "tether.adapters.claude_code:ClaudeCodeAgent"
MODEL = "claude-sonnet-4-5"  # the CLI refuses model names it does not know
KEY_ENV = "TETHER_TEST_ANTHROPIC_KEY"
SECRET = "sk-ant-tether-test-0123456789"
TIMEOUT = 60.0  # a CLI starts in a second or two, more on a loaded machine


@pytest.fixture
def server() -> Iterator[ModelServer]:
    with ModelServer(process=True, realtime=True) as s:
        yield s


def _config(server: ModelServer, home: Path, **claude: Any) -> dict[str, Any]:
    home.mkdir(exist_ok=True)
    return {
        "claude": {
            "model": MODEL,
            "allowed_tools": ["Bash"],
            "cwd": str(home),
            "env": {"HOME": str(home)},
            **claude,
        },
        "model": {"base_url": server.root, "api_key_env": KEY_ENV},
    }


def _agent(
    rt: tether.Runtime, server: ModelServer, home: Path, replies: list[dict[str, Any]]
) -> tuple[str, str, User]:
    server.script(MODEL, replies)
    return family(rt, AGENT, root_driver=SCRIPTED, slug="claude", config=_config(server, home))


def _bash(command: str) -> dict[str, Any]:
    return {"name": "Bash", "arguments": {"command": command, "description": "run it"}}


def _said(request: Any) -> str:
    """Every text the model was sent in a request's messages, one a line."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key in ("text", "content"):
                walk(node.get(key))
            if isinstance(node.get("input"), dict):
                out.append(json.dumps(node["input"]))

    walk(request.body.get("messages", []))
    return "\n".join(out)


def _tool_result(request: Any) -> str:
    """The text of the tool result in a request's last message."""
    last = request.body["messages"][-1]
    [block] = [b for b in last["content"] if b.get("type") == "tool_result"]
    content = block["content"]
    if isinstance(content, list):
        return "\n".join(c.get("text", "") for c in content)
    return str(content)


def test_a_turn_runs_bash_and_answers_and_the_next_turn_continues_it_also_after_a_restart(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    replies: list[dict[str, Any]] = [
        {"text": "Let me look.", "tool_calls": [_bash("echo hello-from-bash")]},
        {"text": "Bash said hello-from-bash."},
        {"text": "Second answer."},
        {"text": "Third answer, after the restart."},
    ]
    with runtime(db_path, workers=1, grace=2.0) as rt:
        rec = Recorder(rt)
        root, child, me = _agent(rt, server, tmp_path / "home", replies)
        rt.send(child, "what does bash say?", authority=me)
        assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
        said = [(e.kind, e.text) for e in rt.transcript(child)]
        assert said[0] == ("user", "what does bash say?")
        assert said[1] == ("assistant", "Let me look.")
        assert said[2] == ("tool", "hello-from-bash")
        assert said[3] == ("assistant", "Bash said hello-from-bash.")
        assert len(said) == 4
        [call] = entries(rt, child, "assistant")[0].data["tool_calls"]  # type: ignore[index]
        assert call["function"]["name"] == "Bash"
        tool = entries(rt, child, "tool")[0].data
        assert tool is not None and tool["tool_call_id"] == call["id"]
        usage = rt.turns(child)[0].usage
        assert usage is not None and usage["prompt_tokens"] > 0
        assert usage["completion_tokens"] > 0 and usage["cost_microusd"] > 0
        first = server.requests_for(MODEL)
        assert [r.api_key for r in first] == [SECRET, SECRET]
        assert "hello-from-bash" in _said(first[1])

        rt.send(child, "and now?", authority=me)
        assert rec.turn_ended(child, count=2, timeout=TIMEOUT)["outcome"] == "completed"
        third = server.requests_for(MODEL)[2]
        assert "what does bash say?" in _said(third)
        assert "Bash said hello-from-bash." in _said(third)
        assert texts(rt, child, "assistant")[-1] == "Second answer."

    # A new host on the same store: the conversation goes on from the store alone
    with runtime(db_path, workers=1, grace=2.0) as rt:
        rec = Recorder(rt)
        rt.send(child, "still there?", authority=User(parent=root))
        assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
        fourth = server.requests_for(MODEL)[3]
        assert "what does bash say?" in _said(fourth)
        assert "Second answer." in _said(fourth) and "and now?" in _said(fourth)
        assert texts(rt, child, "assistant")[-1] == "Third answer, after the restart."


def test_a_cancel_mid_stream_closes_the_model_stream_and_keeps_the_cut_reply(
    server: ModelServer, tmp_path: Path
) -> None:
    # The grace is the deadline for the CLI's own wrap-up, not what is tested: under a
    # loaded CI run the Node CLI took more than 2 s to end its interrupted turn.
    with runtime(workers=1, grace=30.0) as rt:
        _cancel_mid_stream(rt, server, tmp_path)


def _cancel_mid_stream(rt: tether.Runtime, server: ModelServer, tmp_path: Path) -> None:
    rec = Recorder(rt)
    text = "I am halfway through a long answer about everything"
    _root, child, me = _agent(
        rt, server, tmp_path / "home", [{"text": text, "chunk": 4, "hang": True}]
    )
    rt.send(child, "tell me everything", authority=me)
    [request] = server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
    server.wait_for(lambda s: s.requests_for(MODEL)[0].hanging, what="the hang")
    eventually(lambda: all_read(server), timeout=10.0, what="the CLI to read what was sent")

    rt.interrupt(child, authority=me, kind="cancel", reason="enough")
    ended = rec.turn_ended(child, timeout=TIMEOUT)
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
    gone = server.wait_disconnect(request.id)
    [turn] = rt.turns(child)
    assert turn.ended_at is not None and gone.time <= turn.ended_at
    cut = entries(rt, child, "assistant")[-1]
    assert cut.text and text.startswith(cut.text)
    assert cut.data is not None and cut.data["cut"] is True
    report = rt.stop_report(turn.id)
    assert report is not None and report.partial == cut.text


def test_a_cancel_mid_stream_closes_the_model_connection_before_the_cli_acts_on_its_interrupt(
    server: ModelServer, tmp_path: Path
) -> None:
    # The CLI is stopped (SIGSTOP) before the cancel, so it cannot act on its interrupt:
    # the server's disconnect is the adapter's own doing. Resumed, the CLI ends the turn
    # through its interrupt, the cut reply kept, with no network error to retry.
    with runtime(workers=1, grace=30.0) as rt:
        rec = Recorder(rt)
        text = "A long answer that the cancel cuts in the middle"
        _root, child, me = _agent(
            rt, server, tmp_path / "home", [{"text": text, "chunk": 4, "hang": True}]
        )
        rt.send(child, "tell me everything", authority=me)
        [request] = server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
        server.wait_for(lambda s: s.requests_for(MODEL)[0].hanging, what="the hang")
        eventually(lambda: all_read(server), timeout=10.0, what="the text read")
        cli = _cli(rt)
        cli.send_signal(signal.SIGSTOP)
        try:
            eventually(lambda: cli.status() == psutil.STATUS_STOPPED, what="the CLI stopped")
            rt.interrupt(child, authority=me, kind="cancel", reason="enough")
            gone = server.wait_disconnect(request.id, timeout=10.0)
            assert cli.status() == psutil.STATUS_STOPPED  # still: it closed nothing
            assert rt.turns(child)[0].ended_at is None  # the turn waits for the CLI
        finally:
            cli.send_signal(signal.SIGCONT)
        ended = rec.turn_ended(child, timeout=TIMEOUT)
        assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
        [turn] = rt.turns(child)
        assert turn.ended_at is not None and gone.time <= turn.ended_at
        cut = entries(rt, child, "assistant")[-1]
        assert cut.text and text.startswith(cut.text)
        assert cut.data is not None and cut.data["cut"] is True
        assert len(server.requests_for(MODEL)) == 1  # the CLI did not retry


def test_a_cancel_closes_the_model_connection_while_the_workers_loop_is_busy(
    server: ModelServer, tmp_path: Path
) -> None:
    # The worker's event loop is held (as the CLI's stream keeps a busy one) when the
    # cancel arrives: the model connection is shut from the worker's reader thread, not
    # after the loop's turn; the turn ends once the loop is free again.
    hold = tmp_path / "hold"
    with runtime(workers=1, grace=30.0) as rt:
        rec = Recorder(rt)
        text = "An answer the cancel cuts while the loop is held"
        server.script(MODEL, [{"text": text, "chunk": 4, "hang": True}])
        root = rt.open_session(SCRIPTED)
        config = {**_config(server, tmp_path / "home"), "hold": str(hold)}
        child = rt.spawn(root, "adapter_agents:LoopHoldingClaudeCode", config=config)
        me = User(parent=root)
        rt.send(child, "tell me everything", authority=me)
        [request] = server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
        server.wait_for(lambda s: s.requests_for(MODEL)[0].hanging, what="the hang")
        eventually(lambda: all_read(server), timeout=10.0, what="the text read")
        hold.with_suffix(".on").touch()
        eventually(hold.with_suffix(".held").exists, timeout=10.0, what="the loop held")
        try:
            rt.interrupt(child, authority=me, kind="cancel", reason="enough")
            gone = server.wait_disconnect(request.id, timeout=5.0)
            assert not hold.with_suffix(".off").exists()  # the loop was held all along
            assert rt.turns(child)[0].ended_at is None
        finally:
            hold.with_suffix(".off").touch()
        ended = rec.turn_ended(child, timeout=TIMEOUT)
        assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
        [turn] = rt.turns(child)
        assert turn.ended_at is not None and gone.time <= turn.ended_at
        cut = entries(rt, child, "assistant")[-1]
        assert cut.text and text.startswith(cut.text)
        assert len(server.requests_for(MODEL)) == 1


def test_a_cancel_keeps_all_the_text_that_streamed_before_it_though_the_cli_had_not_read_it(
    server: ModelServer, tmp_path: Path
) -> None:
    # The CLI is stopped before the text arrives: the forwarder has passed it all on
    # when the cancel comes, but the CLI has read none of it. Resumed, the CLI still
    # shows it all before its interrupt is sent, and the cut reply is the whole text.
    with runtime(workers=1, grace=30.0) as rt:
        rec = Recorder(rt)
        text = "Every word of this streamed before the cancel"
        _root, child, me = _agent(
            rt, server, tmp_path / "home", [{"text": text, "chunk": 4, "pace": 0.3, "hang": True}]
        )
        rt.send(child, "tell me everything", authority=me)
        cli = _cli(rt)
        [request] = server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
        cli.send_signal(signal.SIGSTOP)
        try:
            eventually(lambda: cli.status() == psutil.STATUS_STOPPED, what="the CLI stopped")
            server.wait_for(
                lambda s: s.requests_for(MODEL)[0].hanging, timeout=TIMEOUT, what="the hang"
            )
            eventually(lambda: all_read(server), timeout=10.0, what="the text forwarded")
            rt.interrupt(child, authority=me, kind="cancel", reason="enough")
            server.wait_disconnect(request.id, timeout=10.0)
        finally:
            cli.send_signal(signal.SIGCONT)
        ended = rec.turn_ended(child, timeout=TIMEOUT)
        assert (ended["outcome"], ended["forced"]) == ("cancelled", False)
        cut = entries(rt, child, "assistant")[-1]
        assert cut.text == text
        assert cut.data is not None and cut.data["cut"] is True
        assert len(server.requests_for(MODEL)) == 1


def test_the_forwarder_serves_only_the_turns_cli_on_loopback_and_only_while_the_turn_runs(
    server: ModelServer, tmp_path: Path
) -> None:
    # The CLI's model requests, its key among their headers, go through a listener in
    # the worker: one on 127.0.0.1 whose base URL has a per-turn secret as its path. A
    # request without it is refused and never reaches the model; after the turn the
    # port is closed.
    import httpx

    with runtime(workers=1, grace=30.0) as rt:
        rec = Recorder(rt)
        _root, child, me = _agent(
            rt, server, tmp_path / "home", [{"text": "Hello there", "chunk": 4, "hang": True}]
        )
        rt.send(child, "hi", authority=me)
        cli = _cli(rt)
        server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
        base = urlsplit(cli.environ()["ANTHROPIC_BASE_URL"])
        assert (base.scheme, base.hostname) == ("http", "127.0.0.1")
        assert len(base.path) > 30 and SECRET not in base.path
        worker = cli.ppid()  # the CLI is the worker's child
        [listening] = [
            c
            for c in psutil.Process(worker).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == base.port
        ]
        assert listening.laddr.ip == "127.0.0.1"
        origin = f"http://127.0.0.1:{base.port}"
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
        for path in ("/v1/messages", "/wrong-secret/v1/messages", base.path[:-1] + "/v1/messages"):
            answer = httpx.post(origin + path, json=body, headers={"x-api-key": "k"}, timeout=10)
            assert answer.status_code == 404
        assert [r.api_key for r in server.requests] == [SECRET]  # nothing else reached it
        rt.interrupt(child, authority=me, kind="cancel", reason="enough")
        assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "cancelled"
        with pytest.raises(httpx.ConnectError):
            httpx.post(origin + base.path + "/v1/messages", json=body, timeout=10)


def _cli(rt: tether.Runtime) -> psutil.Process:
    """The Claude Code CLI under the runtime's workers (the worker's direct child)."""

    def find() -> psutil.Process | None:
        for pid in rt.worker_pids:
            try:
                kids = psutil.Process(pid).children()
            except psutil.NoSuchProcess:
                continue
            for p in kids:
                try:
                    if alive(p) and "claude" in " ".join(p.cmdline()):
                        return p
                except psutil.Error:
                    pass
        return None

    return eventually(find, timeout=TIMEOUT, what="the Claude Code CLI under a worker")


def test_a_steer_sent_while_the_model_streams_reaches_the_next_model_request(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {
            "text": "Working on the slow path, step by step, slowly.",
            "tool_calls": [_bash("echo slow-path")],
            "chunk": 2,
            "pace": 0.05,
        },
        {"text": "Switched to the fast path."},
    ]
    _root, child, me = _agent(rt, server, tmp_path / "home", replies)
    rt.send(child, "do the task", authority=me)
    server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
    rt.interrupt(child, authority=me, kind="steer", reason="use the <fast> path")
    assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
    [first, second] = server.requests_for(MODEL)
    assert "fast" not in _said(first)
    steer = '<steer origin="user" by="user">use the &lt;fast&gt; path</steer>'
    assert steer in _said(second)
    assert [m.action for m in entries(rt, child, "marker")] == ["steered"]
    assert texts(rt, child, "assistant")[-1] == "Switched to the fast path."


def test_a_preempt_of_a_running_bash_command_stops_only_it_and_the_model_is_told(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_bash("echo started; sleep 30; echo never")]},
        {"text": "That took too long; moving on."},
    ]
    _root, child, me = _agent(rt, server, tmp_path / "home", replies)
    rt.send(child, "run it", authority=me)
    server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
    worker_with_tool(rt, "sleep")
    rt.interrupt(child, authority=me, kind="preempt", reason="too slow")
    assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
    [_, second] = server.requests_for(MODEL)
    said = _tool_result(second)
    # The command's shell was killed: the CLI reports a failed command (its output cannot
    # be replaced by a hook) and the preempted text comes with it, as the hook's context
    assert "preempted after " in said
    assert "by user: too slow" in said
    assert "started" in said and "never" not in said  # the output so far, and no more
    [tool] = entries(rt, child, "tool")
    assert tool.text.startswith("preempted after ") and tool.data is not None
    assert tool.data["preempted"] is True
    assert texts(rt, child, "assistant")[-1] == "That took too long; moving on."
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]


def test_an_abort_while_bash_runs_a_setsid_escapee_leaves_no_process_of_the_turn(
    server: ModelServer, tmp_path: Path, token: str
) -> None:
    with runtime(workers=1, grace=1.0, containment="cgroup") as rt:
        rec = Recorder(rt)
        replies = [{"tool_calls": [_bash(escapee(token, then="sleep 60; echo never"))]}]
        _root, child, me = _agent(rt, server, tmp_path / "home", replies)
        rt.send(child, "run it", authority=me)
        cli = _cli(rt)
        escaped = eventually(lambda: escapee_procs(token), timeout=TIMEOUT, what="the escapee")
        [loop] = escapee_loop(escaped, token)
        tree = [cli, *cli.children(recursive=True)]
        rt.interrupt(child, authority=me, kind="abort", reason="stop it all")
        assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "aborted"
        eventually(lambda: not any(alive(p) for p in [*tree, *escaped]), what="all gone")
        [turn] = rt.turns(child)
        report = rt.stop_report(turn.id)
        assert report is not None
        signalled = {p.pid: p.fate for p in report.processes}
        assert signalled.get(cli.pid) == "dead"
        # the escapee's loop itself (its short-lived ``sleep 0.05`` children come and go:
        # one seen when it was found may have exited before the abort)
        assert signalled.get(loop.pid) == "dead"
        assert set(signalled.values()) == {"dead"}


def test_a_pause_freezes_the_cli_and_its_command_and_resume_lets_the_turn_complete(
    server: ModelServer, tmp_path: Path
) -> None:
    with runtime(workers=1, grace=1.0, containment="cgroup") as rt:
        rec = Recorder(rt)
        replies: list[dict[str, Any]] = [
            {"tool_calls": [_bash("echo started; sleep 1.5; echo finished")]},
            {"text": "It finished."},
        ]
        _root, child, me = _agent(rt, server, tmp_path / "home", replies)
        rt.send(child, "run it", authority=me)
        server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
        worker_with_tool(rt, "sleep")
        cli = _cli(rt)
        assert rt.pause(child, authority=me) != []
        tree = [cli, *cli.children(recursive=True)]
        eventually(lambda: all(frozen(p) for p in tree), what="the CLI and its command frozen")
        assert len(server.requests_for(MODEL)) == 1
        rt.resume(child, authority=me)
        assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
        assert texts(rt, child, "assistant")[-1] == "It finished."
        assert "finished" in entries(rt, child, "tool")[0].text


def _tool(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"name": f"mcp__tether__{name}", "arguments": arguments}


# Exit 0 once the third request hangs with all its words sent and every connection to
# the server has read what arrived (an empty receive queue in /proc/net/tcp).
_CHILD_HAS_READ = """
import json, sys, urllib.request
log = json.load(urllib.request.urlopen("{log}", timeout=5))
third = [r for r in log["requests"] if r["id"] == "req_3"]
if not third or not third[0]["hanging"]:
    sys.exit(1)
rows = [line.split() for line in open("/proc/net/tcp").readlines()[1:]]
port = ":%04X" % {port}
sys.exit(any(r[2].endswith(port) and r[3] == "01" and int(r[4].split(":")[1], 16) for r in rows))
"""


def test_claude_code_with_tethers_tools_spawns_a_child_and_stops_it(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    # The parent's Bash waits until the child's model request (the third) has been sent
    # its words and the child's CLI has read them, so the scripted replies go to each in
    # a known order and the stop cuts a reply the child has.
    ready = tmp_path / "child_has_read.py"
    ready.write_text(
        _CHILD_HAS_READ.format(log=f"{server.root}/_tether/log", port=server_port(server))
    )
    wait = f"until {sys.executable} {ready}; do sleep 0.05; done"
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_tool("spawn_agent", {"slug": "kid", "prompt": "work hard"})]},
        {"tool_calls": [_bash(f"{wait}; echo child-running")]},
        {"text": "The child is working on it", "hang": True},  # the child's reply
        {"tool_calls": [_tool("interrupt_agent", {"agent": "kid", "reason": "enough"})]},
        {"text": "I stopped the child."},
    ]
    server.script(MODEL, replies)
    root = rt.open_session(SCRIPTED)
    config = _config(server, tmp_path / "home") | {"tools": ["spawn_agent", "interrupt_agent"]}
    parent = rt.spawn(root, AGENT, slug="claude", config=config)
    rt.send(parent, "delegate it", authority=User(parent=root))
    assert rec.turn_ended(parent, timeout=TIMEOUT)["outcome"] == "completed"
    [kid] = [a for a in rt.list_agents(parent) if a.slug == "kid"]
    ended = rec.turn_ended(kid.id, timeout=TIMEOUT)
    assert ended["outcome"] == "cancelled"
    cut = entries(rt, kid.id, "assistant")[-1]
    assert cut.data is not None and cut.data["cut"] is True
    spawned, _bashed, stopped = entries(rt, parent, "tool")
    assert kid.id in spawned.text and spawned.data is not None
    assert spawned.data["name"] == "mcp__tether__spawn_agent"
    assert stopped.data is not None and stopped.data["name"] == "mcp__tether__interrupt_agent"
    assert texts(rt, parent, "assistant")[-1] == "I stopped the child."


def test_a_model_error_ends_the_turn_failed_with_one_line(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    replies = [{"status": 400, "message": "no such\nmodel", "count": 10}]
    _root, child, me = _agent(rt, server, tmp_path / "home", replies)
    rt.send(child, "try", authority=me)
    ended = rec.turn_ended(child, timeout=TIMEOUT)
    assert ended["outcome"] == "failed", ended
    error = ended["error"]
    assert "\n" not in error and "Traceback" not in error and "400" in error, error
    assert all("Traceback" not in e.text for e in rt.transcript(child))


def test_a_steer_sent_while_the_last_reply_streams_gets_a_reply_of_its_own_in_the_same_turn(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"text": "A slow final answer, streaming along at its own pace.", "chunk": 2, "pace": 0.04},
        {"text": "Taking your steer into account."},
    ]
    _root, child, me = _agent(rt, server, tmp_path / "home", replies)
    rt.send(child, "answer", authority=me)
    server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
    rt.interrupt(child, authority=me, kind="steer", reason="mention the steer")
    assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
    [_, second] = server.requests_for(MODEL)
    steer = '<steer origin="user" by="user">mention the steer</steer>'
    assert steer in _said(second)
    assert [m.action for m in entries(rt, child, "marker")] == ["steered"]
    assert texts(rt, child, "assistant") == [replies[0]["text"], replies[1]["text"]]


def test_a_cancel_while_bash_runs_a_setsid_escapee_leaves_no_process_of_the_turn(
    server: ModelServer, tmp_path: Path, token: str
) -> None:
    with runtime(workers=1, grace=2.0, containment="cgroup") as rt:
        rec = Recorder(rt)
        call = _bash(escapee(token, then="sleep 60; echo never"))
        replies = [{"text": "Starting the long job.", "tool_calls": [call]}]
        root, child, me = _agent(rt, server, tmp_path / "home", replies)
        rt.send(child, "run it", authority=me)
        cli = _cli(rt)
        escaped = eventually(lambda: escapee_procs(token), timeout=TIMEOUT, what="the escapee")
        tree = [cli, *cli.children(recursive=True)]
        rt.interrupt(child, authority=me, kind="cancel", reason="stop")
        assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "cancelled"
        eventually(lambda: not any(alive(p) for p in [*tree, *escaped]), what="all gone")
        [turn] = rt.turns(child)
        report = rt.stop_report(turn.id)
        assert report is not None
        assert [(t.name, t.fate) for t in report.tools] == [("Bash", "cancelled")]
        # the parent hears the last reply said, not the entry that keeps the session
        notice = eventually(lambda: entries(rt, root, "notice"), what="the notice")[-1]
        assert notice.data is not None
        assert notice.data["notice"]["partial"] == "Starting the long job."


def test_a_steer_sent_while_bash_runs_reaches_the_request_after_the_command(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_bash("echo working; sleep 1.5; echo worked")]},
        {"text": "Noted your steer."},
    ]
    _root, child, me = _agent(rt, server, tmp_path / "home", replies)
    rt.send(child, "do the task", authority=me)
    server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
    worker_with_tool(rt, "sleep")
    rt.interrupt(child, authority=me, kind="steer", reason="also check the logs")
    assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
    [_, second] = server.requests_for(MODEL)
    assert '<steer origin="user" by="user">also check the logs</steer>' in _said(second)
    assert "worked" in _tool_result(second)  # the command was not cut by the steer
    [marker] = entries(rt, child, "marker")
    assert marker.action == "steered"
    assert texts(rt, child, "assistant")[-1] == "Noted your steer."


def test_a_config_mistake_or_a_key_in_the_config_is_refused_at_spawn_with_one_line(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    root = rt.open_session(SCRIPTED)
    good = _config(server, tmp_path / "home")
    bad = [
        good | {"claude": {**good["claude"], "modle": MODEL}},
        good | {"model": {**good["model"], "api_key": SECRET}},
        good | {"tools": ["rm_rf"]},
    ]
    # the worker's check at spawn refuses them, before any turn (issue 42, item 8)
    for n, config in enumerate(bad):
        with pytest.raises(tether.InvalidParams) as refused:
            rt.spawn(root, AGENT, slug=f"bad{n}", config=config)
        assert "\n" not in refused.value.message and "config" in refused.value.message
        assert SECRET not in refused.value.message
    assert rt.list_agents(root, scope="children") == []
    assert server.requests == []


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
    server.script(MODEL, replies)
    root = rt.open_session(SCRIPTED)
    config = _config(server, tmp_path / "home") | {"mcp": mcp}
    child = rt.spawn(root, AGENT, slug="claude", config=config)
    me = User(parent=root)
    rt.send(child, "search", authority=me)

    def hung_call() -> dict[str, Any] | None:
        calls = read_log(str(log))
        return next(
            (r for r in calls if r.get("method") == "tools/call" and r.get("tool") == "hang"),
            None,
        )

    call = eventually(hung_call, timeout=TIMEOUT, what="the MCP server to receive the hang")
    turn = rt.interrupt(child, authority=me, kind="preempt", reason="search is stuck")
    assert turn is not None
    assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
    cancelled = [r for r in read_log(str(log)) if r.get("method") == "notifications/cancelled"]
    assert [r["requestId"] for r in cancelled] == [call["id"]]
    first, second, third = server.requests_for(MODEL)
    # the CLI offers MCP tools deferred (found through its ToolSearch): named in the request
    offered = json.dumps(first.body)
    assert "mcp__files__echo" in offered and "mcp__files__hang" in offered
    assert _tool_result(second).startswith("from-mcp")  # the CLI may add a reminder
    result = _tool_result(third)
    assert result.startswith("preempted after ") and "by user: search is stuck" in result
    echoed, hung = entries(rt, child, "tool")
    assert echoed.text == "from-mcp" and echoed.data is not None
    assert echoed.data["name"] == "mcp__files__echo"
    assert hung.data is not None and hung.data["preempted"] is True
    assert [m.action for m in entries(rt, child, "marker")] == ["preempted"]
    report = eventually(lambda: rt.stop_report(turn), what="the preempt's report")
    assert [(t.name, t.fate) for t in report.tools] == [("mcp__files__hang", "preempted")]
    assert texts(rt, child, "assistant")[-1] == "The search hung; going on without it."


def test_an_mcp_server_named_like_tethers_own_tools_is_a_config_mistake(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    mcp, _log = mcp_files(tmp_path)
    mcp = {**mcp, "servers": {"tether": mcp["servers"]["files"]}}
    root = rt.open_session(SCRIPTED)
    config = _config(server, tmp_path / "home") | {"mcp": mcp}
    # refused when the session is opened (its config is checked there), before any turn
    with pytest.raises(tether.InvalidParams, match="'tether' is Tether's own"):
        rt.spawn(root, AGENT, slug="claude", config=config)
    assert server.requests == []


def test_with_telemetry_each_model_request_is_a_chat_span_under_the_turn_with_model_and_usage(
    server: ModelServer, tmp_path: Path
) -> None:
    from otlp_receiver import OtlpReceiver

    replies: list[dict[str, Any]] = [
        {"text": "Let me look.", "tool_calls": [_bash("echo hello-from-bash")]},
        {"text": "Bash said hello-from-bash."},
    ]
    with OtlpReceiver() as receiver:
        with tether.Runtime(workers=1, grace=2.0, telemetry={"endpoint": receiver.url}) as rt:
            rec = Recorder(rt)
            _root, child, me = _agent(rt, server, tmp_path / "home", replies)
            rt.send(child, "what does bash say?", authority=me)
            ended = rec.turn_ended(child, timeout=TIMEOUT)
            assert ended["outcome"] == "completed", ended.get("error")
        top, chats = receiver.chats_under(ended["turn"], MODEL, 2)
    assert top.attrs["gen_ai.agent.id"] == child and not top.error
    assert all(c.attrs["gen_ai.provider.name"] == "anthropic" for c in chats)


def test_each_response_counts_against_a_budget_as_it_streams_so_a_budget_stops_the_cli_mid_turn(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    spend = {"input_tokens": 900, "output_tokens": 100}
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_bash("echo one")], "usage": spend},
        {"text": "still going " * 20, "chunk": 4, "hang": True},  # never asked for
    ]
    server.script(MODEL, replies)
    root = rt.open_session(SCRIPTED)
    config = _config(server, tmp_path / "home")
    child = rt.spawn(root, AGENT, slug="claude", config=config, budget={"tokens": 500})
    rt.send(child, "spend", authority=User(parent=root))
    ended = rec.turn_ended(child, timeout=TIMEOUT)
    # the first response's 1,000 tokens cross the limit while the turn still runs
    assert ended["outcome"] == "cancelled" and ended["by"] == "budget", ended
    [marker] = [m for m in entries(rt, child, "marker") if m.action == "cancelled"]
    assert "of 500 tokens spent" in marker.text
    usage = rt.turns(child)[0].usage
    assert usage is not None and usage["prompt_tokens"] >= 900
    if len(server.requests_for(MODEL)) == 1:  # stopped before the CLI asked again: the
        # first response alone, counted once (its stream and the CLI's result agree)
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (900, 100)
    # else the second request's prompt was spent too: in flight when the limit was crossed
    assert rt.budget(child).spent["tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# What one response of 1,000 prompt and 100 completion tokens costs at Sonnet's list price
# ($3 and $15 a million), in micro-dollars: the CLI's own figure for it
SPEND = {"input_tokens": 1000, "output_tokens": 100}
SPEND_MICROUSD = 1000 * 3 + 100 * 15


def test_a_cost_budget_stops_the_cli_within_one_response_of_the_one_that_crossed_it(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    # No model.price: each response is priced as it streams, not at the turn's end. The
    # third reply never ends: only a stop ends this turn.
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"text": "Step one.", "tool_calls": [_bash("echo one")], "usage": SPEND},
        {"text": "Step two.", "tool_calls": [_bash("echo two")], "usage": SPEND},
        {"text": "Step three, at length " * 10, "chunk": 8, "hang": True, "usage": SPEND},
        {"text": "Step four.", "tool_calls": [_bash("echo four")], "usage": SPEND},
        {"text": "Done.", "usage": SPEND},
    ]
    server.script(MODEL, replies)
    root = rt.open_session(SCRIPTED)
    config = _config(server, tmp_path / "home")
    budget = {"cost_usd": 0.008, "on_soft": "none"}  # crossed by the second response
    child = rt.spawn(root, AGENT, slug="claude", config=config, budget=budget)
    rt.send(child, "work", authority=User(parent=root))
    ended = rec.turn_ended(child, timeout=TIMEOUT)
    assert ended["outcome"] == "cancelled" and ended["by"] == "budget", ended
    # at most the request the CLI had sent before the stop arrived went out after it
    assert len(server.requests_for(MODEL)) <= 3, len(server.requests_for(MODEL))
    usage = rt.turns(child)[0].usage
    assert usage is not None and usage["cost_microusd"] >= 2 * SPEND_MICROUSD, usage
    assert rt.budget(child).spent["cost_usd"] == usage["cost_microusd"] / 1_000_000


def test_an_aborted_turn_counts_the_cost_of_the_responses_it_had(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    started, release = tmp_path / "started", tmp_path / "release"
    wait = f"touch {started}; while [ ! -e {release} ]; do sleep 0.1; done"
    server.script(MODEL, [{"text": "Waiting.", "tool_calls": [_bash(wait)], "usage": SPEND}])
    root = rt.open_session(SCRIPTED)
    config = _config(server, tmp_path / "home")
    child = rt.spawn(root, AGENT, slug="claude", config=config, budget={"cost_usd": 1.0})
    rt.send(child, "wait", authority=User(parent=root))
    eventually(started.exists, timeout=TIMEOUT, what="the command to run")
    rt.interrupt(child, authority=User(parent=root), kind="abort", reason="enough")
    assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "aborted"
    usage = rt.turns(child)[0].usage
    assert usage is not None, "the aborted turn cost nothing"
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1000, 100), usage
    assert usage["cost_microusd"] == SPEND_MICROUSD, usage
    assert rt.budget(child).spent["cost_usd"] == SPEND_MICROUSD / 1_000_000


def test_a_reply_cut_by_a_cancel_counts_the_servers_prompt_and_what_streamed_as_estimated(
    server: ModelServer, tmp_path: Path
) -> None:
    text = "I am halfway through a long answer about everything"
    usage_given = {"input_tokens": 1234, "output_tokens": 999}  # the 999 never arrives
    with runtime(workers=1, grace=30.0) as rt:
        rec = Recorder(rt)
        server.script(MODEL, [{"text": text, "chunk": 4, "hang": True, "usage": usage_given}])
        root = rt.open_session(SCRIPTED)
        config = _config(server, tmp_path / "home")
        child = rt.spawn(root, AGENT, slug="claude", config=config, budget={"tokens": 10**6})
        me = User(parent=root)
        rt.send(child, "tell me everything", authority=me)
        server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
        server.wait_for(lambda s: s.requests_for(MODEL)[0].hanging, what="the hang")
        eventually(lambda: all_read(server), timeout=10.0, what="the CLI to read what was sent")
        rt.interrupt(child, authority=me, kind="cancel", reason="enough")
        assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "cancelled"
        cut = "".join(texts(rt, child, "assistant"))
        usage = rt.turns(child)[0].usage
        assert usage is not None and usage.get("estimated") is True, usage
        assert usage["prompt_tokens"] == 1234  # the server's own count, from its stream
        assert abs(usage["completion_tokens"] - len(cut) / 4) <= 1, (usage, cut)
        cost = 1234 * 3 + usage["completion_tokens"] * 15
        assert usage["cost_microusd"] == cost, usage
        spent = rt.budget(child).spent["tokens"]
        assert spent == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_tool_call_the_cli_refuses_by_itself_is_named_and_follows_the_reply_that_asked(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    # The CLI refuses a Bash command that is only a long ``sleep`` by its own rule, as
    # soon as the call has streamed, before the reply's stream ends.
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
        {"text": "Waiting a while.", "tool_calls": [_bash("sleep 300")]},
        {"text": "It would not wait."},
    ]
    _root, child, me = _agent(rt, server, tmp_path / "home", replies)
    rt.send(child, "wait five minutes", authority=me)
    assert rec.turn_ended(child, timeout=TIMEOUT)["outcome"] == "completed"
    kinds = [e.kind for e in rt.transcript(child)]
    assert kinds == ["user", "assistant", "tool", "assistant"], kinds
    [call] = entries(rt, child, "assistant")[0].data["tool_calls"]  # type: ignore[index]
    [tool] = entries(rt, child, "tool")
    assert tool.data is not None and tool.data["tool_call_id"] == call["id"]
    assert tool.data["name"] == "Bash" and tool.data.get("error") is True
    assert json.loads(tool.data["arguments"])["command"] == "sleep 300"
    # what the model read (the CLI adds a reminder of its own after it)
    assert tool.text and tool.text in _tool_result(server.requests_for(MODEL)[1])
