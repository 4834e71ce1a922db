"""Agents SDK agents for tests/agent/test_adapter_openai_agents.py, built in the worker from the
session config (``"agent": "adapter_agents_oai:name"``). Workers import it by name, as
they import ``tests/drivers.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agents import Agent, function_tool

from adapter_agents import ledger_step as _ledger_step


@function_tool
async def lookup(topic: str) -> str:
    """Look a topic up."""
    return f"notes on {topic}"


def helper(config: dict[str, Any]) -> Agent[Any]:
    """A plain agent with a tool of its own; its model is the config's."""
    return Agent(name="helper", instructions="You are a test agent.", tools=[lookup])


@function_tool
async def ledger_step(step: str, ledger: str) -> str:
    """A step of the durable-turn tests (adapter_agents.ledger_step)."""
    return await _ledger_step(step, ledger)


def ledgered(config: dict[str, Any]) -> Agent[Any]:
    """An agent whose tool ``ledger_step`` notes each of its runs in a file."""
    return Agent(name="ledgered", instructions="You are a test agent.", tools=[ledger_step])


def prober(config: dict[str, Any]) -> Agent[Any]:
    """An agent whose tool ``slow_probe`` hangs until stopped; it creates the file
    ``config["probe_file"]`` once it runs, so that a test knows when to stop it."""
    started = Path(config["probe_file"])

    @function_tool
    async def slow_probe(target: str) -> str:
        """Probe a target (slowly)."""
        started.write_text(target)
        await asyncio.sleep(60)
        return f"{target} is fine"

    return Agent(name="prober", instructions="You are a test agent.", tools=[slow_probe])


def triage(config: dict[str, Any]) -> Agent[Any]:
    """An agent that hands off to ``prober`` (its tool hangs until stopped)."""
    return Agent(
        name="triage", instructions="Hand probes to the prober.", handoffs=[prober(config)]
    )
