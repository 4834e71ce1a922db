"""Framework agents for the adapter benchmarks, built in a worker from the session config
(`"agent": "benchmarks.adapter_agents:name"`). Neither has tools: the cancel cases cut a
plain streamed reply, and the adapter points each at the model server (config `model`).
"""

from __future__ import annotations

from typing import Any


def pydantic_ai_agent(config: dict[str, Any]) -> Any:
    """A tool-less `pydantic_ai.Agent`; its own model ("test") is overridden by the adapter."""
    from pydantic_ai import Agent

    return Agent("test", instructions="You are a benchmark agent.")


def openai_agents_agent(config: dict[str, Any]) -> Any:
    """A tool-less Agents SDK `Agent`; its model is the config's."""
    from agents import Agent

    return Agent(name="bench", instructions="You are a benchmark agent.")
