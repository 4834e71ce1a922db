"""``tether serve`` started in a project's directory (issue 42, item 15): its workers
import the project's modules, as a script's would, and an adapter factory they cannot
import is refused when the session is opened, never at its first prompt."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tether.testing import ModelServer
from tether_server import rpc_error, running_server, wait_until

pytest.importorskip("pydantic_ai")

pytestmark = pytest.mark.timeout(120)

ADAPTER = "tether.adapters.pydantic_ai:PydanticAIAgent"
# A project's own factory, as docs/adapters-pydantic_ai.md writes one: its own model
# needs a key, but the session's config.model replaces it.
FACTORY = """\
from pydantic_ai import Agent


def research_agent(config: dict) -> Agent:
    return Agent("openai:gpt-4o", instructions="You are a careful researcher.")
"""


def _env() -> dict[str, str]:
    """The test's environment with nothing that would put the project on the path."""
    return {"PYTHONPATH": "", "OPENAI_API_KEY": ""} | {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OPENAI_API_KEY")
    }


def test_serve_started_in_a_project_runs_its_factory_and_refuses_a_missing_one_at_open(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "research.py").write_text(FACTORY)
    state = tmp_path / "state"
    state.mkdir()
    with (
        ModelServer([{"text": "Read from the project's own factory."}]) as model,
        running_server(state, env=_env(), cwd=project) as server,
    ):
        config: dict[str, Any] = {
            "agent": "research:research_agent",
            "model": {"base_url": model.url, "name": "serve-project"},
        }
        opened = server.call("session.open", {"driver": ADAPTER, "config": config})
        sid = opened["session"]
        server.call("session.prompt", {"session": sid, "content": "what did you read?"})

        def ended() -> dict[str, Any] | None:
            turns = server.call("subagent.turns", {"session": sid})["turns"]
            return turns[0] if turns and turns[0]["outcome"] is not None else None

        turn = wait_until(ended, timeout=60.0, what="the turn to end")
        assert turn["outcome"] == "completed", turn
        entries = server.call("subagent.transcript", {"session": sid})["entries"]
        said = [e["text"] for e in entries if e["kind"] == "assistant"]
        assert said == ["Read from the project's own factory."]

        # A module the workers cannot import: refused by session.open, naming it; on the
        # RPC wire an unknown driver's code is invalid-params (-32602), as published.
        missing = {**config, "agent": "nowhere:research_agent"}
        answer = server.rpc("session.open", {"driver": ADAPTER, "config": missing})
        assert rpc_error(answer) == (-32602, "invalid-params"), answer
        message = answer["error"]["message"]
        assert "config.agent" in message and "'nowhere'" in message, message
        assert "model-error" not in message
