"""What every hosted agent's next turn remembers of a turn that ended early (semantics §16.1).

Each adapter (Pydantic AI, the OpenAI Agents SDK, Claude Code through its bundled CLI)
runs its real framework against the model server over HTTP. A first turn is stopped
(cancelled or aborted, before the model's first token or after it) or fails; the second
turn's request must still carry the first turn's user message, before its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from drivers import SCRIPTED, Recorder, alive, eventually, family
from model_helpers import all_read
from tether import User
from tether.testing import ModelServer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("api_key")]

KEY_ENV = "TETHER_TEST_HISTORY_KEY"
SECRET = "sk-tether-history-0123456789"
CLAUDE_MODEL = "claude-sonnet-4-5"  # the CLI refuses model names it does not know
FIRST = "first message, from a turn that ended early"
SECOND = "second message"


@dataclass(frozen=True)
class Adapter:
    name: str
    driver: str
    module: str  # the framework package the adapter needs


ADAPTERS = [
    Adapter("pydantic_ai", "tether.adapters.pydantic_ai:PydanticAIAgent", "pydantic_ai"),
    Adapter("openai_agents", "tether.adapters.openai_agents:OpenAIAgentsAgent", "agents"),
    Adapter("claude_code", "tether.adapters.claude_code:ClaudeCodeAgent", "claude_agent_sdk"),
]


@pytest.fixture(params=ADAPTERS, ids=[a.name for a in ADAPTERS])
def adapter(request: pytest.FixtureRequest) -> Adapter:
    chosen: Adapter = request.param
    pytest.importorskip(chosen.module)
    return chosen


@pytest.fixture
def server() -> Iterator[ModelServer]:
    # one server per test: the Claude Code CLI names its script by a real model's name
    with ModelServer(process=True, realtime=True) as s:
        yield s


def _script(adapter: Adapter) -> str:
    return CLAUDE_MODEL if adapter.name == "claude_code" else f"history-{adapter.name}"


def _config(adapter: Adapter, server: ModelServer, home: Path) -> dict[str, Any]:
    if adapter.name == "claude_code":
        home.mkdir(exist_ok=True)
        return {
            "claude": {
                "model": CLAUDE_MODEL,
                "allowed_tools": ["Bash"],
                "cwd": str(home),
                "env": {"HOME": str(home)},
            },
            "model": {"base_url": server.root, "api_key_env": KEY_ENV},
        }
    factory = {
        "pydantic_ai": "adapter_agents:pydantic_ai_agent",
        "openai_agents": "adapter_agents_oai:helper",
    }[adapter.name]
    model = {"base_url": server.url, "name": _script(adapter), "api_key_env": KEY_ENV}
    return {"agent": factory, "model": {**model, "timeout": 30}}


def _agent(
    rt: tether.Runtime,
    adapter: Adapter,
    server: ModelServer,
    home: Path,
    replies: list[dict[str, Any]],
) -> tuple[str, str, User]:
    server.script(_script(adapter), replies)
    return family(
        rt,
        adapter.driver,
        root_driver=SCRIPTED,
        slug="agent",
        config=_config(adapter, server, home),
    )


def _user_texts(request: Any) -> list[str]:
    """The texts of a request's user messages, in order, on either wire (a message's
    content is a string, or a list of parts whose text parts count)."""
    out: list[str] = []
    for m in request.body.get("messages", []):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(str(p["text"]) for p in content if p.get("type") == "text" and "text" in p)
    return out


def _second_turn_remembers_the_first(
    rt: tether.Runtime, rec: Recorder, adapter: Adapter, server: ModelServer, child: str, me: User
) -> None:
    rt.send(child, SECOND, authority=me)
    ended = rec.turn_ended(child, count=2, timeout=90.0)
    assert ended["outcome"] == "completed", ended
    # the user's texts of the second turn's request, in order (the CLI may add a line end)
    said = "\n".join(_user_texts(server.requests_for(_script(adapter))[-1]))
    assert 0 <= said.find(FIRST) < said.find(SECOND), said


# (the stop, the first reply: held before its first token, or after some text)
STOPS = [
    ("cancel", "before"),
    ("cancel", "after"),
    ("abort", "before"),
    ("abort", "after"),
]


@pytest.mark.parametrize(("kind", "when"), STOPS, ids=[f"{k}-{w}" for k, w in STOPS])
def test_a_turn_stopped_before_or_after_the_first_token_keeps_its_user_message(
    rt: tether.Runtime, adapter: Adapter, server: ModelServer, tmp_path: Path, kind: str, when: str
) -> None:
    rec = Recorder(rt)
    first: dict[str, Any] = {"hang": True}
    if when == "after":
        first["text"] = "I was just saying"
    replies = [first, {"text": "Second answer."}]
    _root, child, me = _agent(rt, adapter, server, tmp_path / "home", replies)
    script = _script(adapter)
    rt.send(child, FIRST, authority=me)
    server.wait_requests(1, script=script, timeout=90.0)
    server.wait_for(lambda s: s.requests_for(script)[0].hanging, what="the first reply's hang")
    if when == "after":
        eventually(lambda: all_read(server), timeout=10.0, what="the agent to read the text")
    rt.interrupt(child, authority=me, kind=kind, reason="stop")
    outcome = {"cancel": "cancelled", "abort": "aborted"}[kind]
    assert rec.turn_ended(child, timeout=60.0)["outcome"] == outcome
    _second_turn_remembers_the_first(rt, rec, adapter, server, child, me)


def test_a_turn_that_failed_before_any_reply_keeps_its_user_message(
    rt: tether.Runtime, adapter: Adapter, server: ModelServer, tmp_path: Path
) -> None:
    rec = Recorder(rt)
    # refused every time it is asked (the Claude Code CLI asks again after a 400)
    replies = [{"status": 400, "message": "refused", "count": 10}]
    _root, child, me = _agent(rt, adapter, server, tmp_path / "home", replies)
    rt.send(child, FIRST, authority=me)
    assert rec.turn_ended(child, timeout=90.0)["outcome"] == "failed"
    server.script(_script(adapter), [{"text": "Second answer."}])
    _second_turn_remembers_the_first(rt, rec, adapter, server, child, me)


def _cli_started(rt: tether.Runtime) -> bool:
    """A worker has a live Claude Code CLI among its descendants."""
    for pid in rt.worker_pids:
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(pid).children(recursive=True)
            if any(alive(p) and p.name() == "claude" for p in kids):
                return True
    return False


def test_a_claude_code_turn_cancelled_while_its_cli_starts_ends_within_grace_and_keeps_its_message(
    rt: tether.Runtime, server: ModelServer, tmp_path: Path
) -> None:
    # cancelled once the CLI's process runs: it has sent no model request yet, and has
    # no session file to keep (a second or so of start-up)
    pytest.importorskip("claude_agent_sdk")
    claude = ADAPTERS[2]
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [{"hang": True}, {"text": "Second answer."}]
    _root, child, me = _agent(rt, claude, server, tmp_path / "home", replies)
    rt.send(child, FIRST, authority=me)
    eventually(lambda: _cli_started(rt), timeout=60.0, what="the CLI's process")
    rt.interrupt(child, authority=me, kind="cancel", reason="stop")
    ended = rec.turn_ended(child, timeout=60.0)
    # within the grace: a CLI killed as the cancel lands, not waited for
    assert (ended["outcome"], ended["forced"]) == ("cancelled", False), ended
    # the second turn's request gets the answer, whether or not the first one asked
    server.script(CLAUDE_MODEL, [{"text": "Second answer."}])
    _second_turn_remembers_the_first(rt, rec, claude, server, child, me)
