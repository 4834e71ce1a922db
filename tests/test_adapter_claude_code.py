"""``tether.adapters.claude_code:ClaudeCodeAgent`` (SPEC §16.1) with the real Claude Code CLI.

The CLI (bundled with ``claude-agent-sdk``) runs as a child of a worker and talks the
Anthropic Messages wire to ``tether.testing.ModelServer`` on loopback: no key, no
network. Each test has a server of its own (the CLI names its script by its model name).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tether
from drivers import SCRIPTED, Recorder, entries, eventually, runtime, texts
from test_chat_agent import _all_read
from tether import User
from tether.testing import ModelServer

pytest.importorskip("claude_agent_sdk")

pytestmark = pytest.mark.timeout(120)

AGENT = "tether.adapters.claude_code:ClaudeCodeAgent"
MODEL = "claude-sonnet-4-5"  # the CLI refuses model names it does not know
KEY_ENV = "TETHER_TEST_ANTHROPIC_KEY"
SECRET = "sk-ant-tether-test-0123456789"
TIMEOUT = 60.0  # a CLI starts in a second or two, more on a loaded machine


@pytest.fixture(scope="module", autouse=True)
def api_key() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, SECRET)
        yield SECRET


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
    root = rt.open_session(SCRIPTED)
    child = rt.spawn(root, AGENT, slug="claude", config=_config(server, home))
    assert isinstance(child, str)
    return root, child, User(parent=root)


def _bash(command: str) -> dict[str, Any]:
    return {"name": "Bash", "arguments": {"command": command, "description": "run it"}}


def _said(request: Any) -> str:
    """Everything the model was sent in a request's messages, as one text."""
    return json.dumps(request.body.get("messages", []))


def test_a_turn_runs_bash_and_answers_and_the_next_turn_continues_it_also_after_a_restart(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    replies = [
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
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    text = "I am halfway through a long answer about everything"
    _root, child, me = _agent(
        rt, server, tmp_path / "home", [{"text": text, "chunk": 4, "hang": True}]
    )
    rt.send(child, "tell me everything", authority=me)
    [request] = server.wait_requests(1, script=MODEL, timeout=TIMEOUT)
    server.wait_for(lambda s: s.requests_for(MODEL)[0].hanging, what="the hang")
    eventually(lambda: _all_read(server), timeout=10.0, what="the CLI to read what was sent")

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
