"""A config mistake is refused when the session is opened, as ``invalid-params`` naming
the field (issue 42, item 8): ChatAgent's and each adapter's ``check_config`` runs the
same parse as the turn, in a real worker, and a good config still opens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tether
from tether_server import rpc_error, running_server

pytestmark = pytest.mark.timeout(120)

CHAT = "tether.agents:ChatAgent"
PYDANTIC = "tether.adapters.pydantic_ai:PydanticAIAgent"
OPENAI = "tether.adapters.openai_agents:OpenAIAgentsAgent"
CLAUDE = "tether.adapters.claude_code:ClaudeCodeAgent"

# importable by the workers, but not callable: a string constant of each adapter
PYD_NOT_CALLABLE = "tether.adapters.pydantic_ai:_NO_RESULT"
OAI_NOT_CALLABLE = "tether.adapters.openai_agents:_NO_RESULT"
PYD_AGENT = "adapter_agents:pydantic_ai_agent"
OAI_AGENT = "adapter_agents_oai:helper"

# (config, what the message must say) for each driver
CHAT_BAD: list[tuple[dict[str, Any], str]] = [
    ({"model": 5}, "config.model must be an object"),
    ({"model": {"base_url": 5}}, "config.model.base_url must be a string"),
    ({"model": {"name": 7}}, "config.model.name must be a string"),
    ({"model": {"timeout": "30"}}, "config.model.timeout must be a number"),
    ({"model": {"retries": 1.5}}, "config.model.retries must be an integer"),
    ({"model": {"headers": {"x": 1}}}, "config.model.headers"),
    ({"model": {"price": {"input_per_mtok": "1"}}}, "model.price.input_per_mtok"),
    ({"tools": "run_command"}, "config.tools must be a list of tool names"),
    ({"tools": [5]}, "config.tools must be a list of tool names"),
    ({"max_steps": "5"}, "config.max_steps must be an integer"),
    ({"max_steps": True}, "config.max_steps must be an integer"),
    ({"system": ["x"]}, "config.system must be a string"),
    ({"mcp": "servers"}, "config.mcp must be an object"),
    ({"tool_policy": {"run_command": "ask"}}, "config.tool_policy.run_command"),
    (
        {"mcp": {"servers": {"a": {"command": "srv"}}}},
        "config.mcp: mcp server 'a': 'command' must be",
    ),
    ({"tool_policy": {"mcp:a/b": {"preempt": "sometimes"}}}, "config.mcp: tool policy"),
]
PYD_BAD: list[tuple[dict[str, Any], str]] = [
    ({"agent": PYD_NOT_CALLABLE}, f"config.agent: {PYD_NOT_CALLABLE} is not callable"),
    ({"agent": 5}, "config.agent"),
    ({"agent": PYD_AGENT, "model": {"base_url": 5}}, "config.model.base_url must be a string"),
    ({"agent": PYD_AGENT, "model": {"name": 5}}, "config.model.name must be a string"),
    ({"agent": PYD_AGENT, "model": {"timeout": "x"}}, "config.model.timeout must be a number"),
    ({"agent": PYD_AGENT, "model": "gpt"}, "config.model must be an object"),
    ({"agent": PYD_AGENT, "tools": "spawn_agent"}, "config.tools must be a list of tool names"),
]
OAI_BAD: list[tuple[dict[str, Any], str]] = [
    ({"agent": OAI_NOT_CALLABLE}, f"config.agent: {OAI_NOT_CALLABLE} is not callable"),
    ({"agent": OAI_AGENT, "model": {"base_url": 5}}, "config.model.base_url must be a string"),
    ({"agent": OAI_AGENT, "model": {"retries": "3"}}, "config.model.retries must be an integer"),
    ({"agent": OAI_AGENT, "tools": "spawn_agent"}, "config.tools must be a list of tool names"),
    ({"agent": OAI_AGENT, "max_steps": "9"}, "config.max_steps must be an integer"),
]
CLAUDE_BAD: list[tuple[dict[str, Any], str]] = [
    ({"claude": 5}, "config.claude must be an object"),
    ({"model": {"base_url": 5}}, "config.model.base_url must be a string"),
    ({"model": 5}, "config.model must be an object"),
    ({"model": {"api_key_env": 5}}, "config.model.api_key_env must be a string"),
    ({"claude": {"allowed_tools": "Bash"}}, "config.claude.allowed_tools must be a list"),
    ({"claude": {"max_turns": "3"}}, "config.claude.max_turns must be an integer"),
    ({"claude": {"max_turns": 0}}, "config.claude.max_turns must be at least 1"),
    ({"claude": {"model": 4}}, "config.claude.model must be a string"),
    ({"claude": {"env": {"A": 1}}}, "config.claude.env"),
    ({"claude": {"env": "A=1"}}, "config.claude.env must be an object"),
    ({"mcp": {"servers": {"a": {"url": "ftp://x"}}}}, "config.mcp: mcp server 'a': 'url' must be"),
    ({"tools": "spawn_agent"}, "config.tools must be a list of tool names"),
]

BAD: list[tuple[str, dict[str, Any], str]] = [
    *[(CHAT, c, m) for c, m in CHAT_BAD],
    *[(PYDANTIC, c, m) for c, m in PYD_BAD],
    *[(OPENAI, c, m) for c, m in OAI_BAD],
    *[(CLAUDE, c, m) for c, m in CLAUDE_BAD],
]
GOOD: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"model": {"base_url": "http://x", "timeout": 30, "retries": 2}, "tools": []}),
    (PYDANTIC, {"agent": PYD_AGENT, "model": {"name": "m", "timeout": 5}}),
    (OPENAI, {"agent": OAI_AGENT, "model": {"name": "m"}, "max_steps": 3}),
    (CLAUDE, {"claude": {"allowed_tools": ["Bash"], "max_turns": 2}, "model": {}}),
]


def _needs(driver: str) -> None:
    """Skip a driver whose framework is not installed here."""
    module = {PYDANTIC: "pydantic_ai", OPENAI: "agents", CLAUDE: "claude_agent_sdk"}.get(driver)
    if module is not None:
        pytest.importorskip(module)


@pytest.fixture(scope="module")
def cfg_rt() -> Iterator[tether.Runtime]:
    """One runtime for every case: each open asks a real worker to check the config."""
    with tether.Runtime(workers=1, grace=1.0) as runtime:
        yield runtime


@pytest.mark.parametrize(("driver", "config", "says"), BAD)
def test_a_config_mistake_is_refused_at_open_naming_the_field(
    cfg_rt: tether.Runtime, driver: str, config: dict[str, Any], says: str
) -> None:
    _needs(driver)
    with pytest.raises(tether.InvalidParams) as refused:
        cfg_rt.open_session(driver, config=config)
    assert refused.value.code == "invalid-params"
    assert says in refused.value.message


@pytest.mark.parametrize(("driver", "config"), GOOD)
def test_a_good_config_still_opens(
    cfg_rt: tether.Runtime, driver: str, config: dict[str, Any]
) -> None:
    _needs(driver)
    session = cfg_rt.open_session(driver, config=config)
    assert session


def test_session_open_over_rpc_answers_invalid_params_naming_the_field(tmp_path: Path) -> None:
    pytest.importorskip("claude_agent_sdk")
    with running_server(tmp_path) as server:
        answer = server.rpc("session.open", {"driver": CLAUDE, "config": {"claude": 5}})
        _, code = rpc_error(answer)
        assert code == "invalid-params", answer
        assert "config.claude must be an object" in answer["error"]["message"], answer
