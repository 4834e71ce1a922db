"""Agents SDK agents for tests/test_adapter_openai_agents.py, built in the worker from the
session config (``"agent": "adapter_agents_oai:name"``). Workers import it by name, as
they import ``tests/drivers.py``."""

from __future__ import annotations

import asyncio
from typing import Any

from agents import Agent, function_tool


@function_tool
async def lookup(topic: str) -> str:
    """Look a topic up."""
    return f"notes on {topic}"


@function_tool
async def slow_probe(target: str) -> str:
    """Probe a target (slowly: it hangs until stopped)."""
    await asyncio.sleep(60)
    return f"{target} is fine"


def helper(config: dict[str, Any]) -> Agent[Any]:
    """A plain agent with two tools of its own; its model is the config's."""
    return Agent(name="helper", instructions="You are a test agent.", tools=[lookup, slow_probe])
