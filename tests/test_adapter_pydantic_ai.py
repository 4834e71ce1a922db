"""``tether.adapters.pydantic_ai:PydanticAIAgent`` (SPEC §16.1) with the real framework.

A real ``pydantic_ai.Agent`` (its factory in tests/adapter_agents.py) runs in a worker
process and talks to the model server (``tether.testing.ModelServer``, a process of its
own on loopback) over real HTTP with the framework's own OpenAI client. Each test has its
own script, chosen by the model name it configures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import tether
from drivers import SCRIPTED, Recorder, entries, runtime, texts
from tether import User
from tether.testing import ModelServer

pytest.importorskip("pydantic_ai")

pytestmark = pytest.mark.timeout(90)

ADAPTER = "tether.adapters.pydantic_ai:PydanticAIAgent"
FACTORY = "adapter_agents:pydantic_ai_agent"
KEY_ENV = "TETHER_TEST_PYD_KEY"
SECRET = "sk-tether-pyd-0123456789abcdef"


@pytest.fixture(scope="module", autouse=True)
def api_key() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, SECRET)
        yield SECRET


@pytest.fixture(scope="module")
def server() -> Iterator[ModelServer]:
    # a process of its own: it sees a client's disconnect at once (see test_chat_agent)
    with ModelServer(process=True, realtime=True) as s:
        yield s


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
    root = rt.open_session(SCRIPTED)
    child = rt.spawn(root, ADAPTER, slug="agent", config=_config(server, script, **extra))
    assert isinstance(child, str)
    return root, child, User(parent=root)


def _said(rt: tether.Runtime, sid: str) -> list[tuple[str, str]]:
    return [(e.kind, e.text) for e in rt.transcript(sid)]


def test_a_turn_keeps_its_replies_tool_results_and_usage_and_the_next_turn_continues_it(
    server: ModelServer, db_path: str
) -> None:
    script = "pyd-tool-turn"
    replies = [
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
