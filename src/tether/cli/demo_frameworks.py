"""The framework agents ``tether demo --adapters`` runs (semantics §16.1), built in the worker
from the session config (``"agent": "tether.cli.demo_frameworks:<factory>"``).

Each gets its model from the adapter (the config's ``model``), so its own never answers;
each has one tool of its own, ``lookup``, which the scripted model calls.
"""

from __future__ import annotations

from typing import Any

__all__ = ["openai_agents_agent", "pydantic_ai_agent"]

_INSTRUCTIONS = "You are the team's planner."


def _lookup(topic: str) -> str:
    return f"notes on {topic}: the fast path skips the full rebuild"


def pydantic_ai_agent(config: dict[str, Any]) -> Any:
    """A ``pydantic_ai.Agent`` with a ``lookup`` tool (extra ``tether-runtime[pydantic-ai]``)."""
    from pydantic_ai import Agent

    agent: Agent[None, str] = Agent("test", instructions=_INSTRUCTIONS)

    @agent.tool_plain
    async def lookup(topic: str) -> str:
        """Look a topic up in the team's notes."""
        return _lookup(topic)

    return agent


def openai_agents_agent(config: dict[str, Any]) -> Any:
    """An ``agents.Agent`` (OpenAI Agents SDK) with a ``lookup`` tool (extra
    ``tether-runtime[openai-agents]``)."""
    from agents import Agent, function_tool

    @function_tool
    async def lookup(topic: str) -> str:
        """Look a topic up in the team's notes."""
        return _lookup(topic)

    return Agent(name="planner", instructions=_INSTRUCTIONS, tools=[lookup])
