"""Framework agents for the adapter tests (tests/ is on the workers' path).

Each factory takes the session's config and returns the framework's agent; the adapter
points it at the test's model server (config ``model``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any


def pydantic_ai_agent(config: dict[str, Any]) -> Any:
    """A Pydantic AI agent with two tools of its own: ``lookup`` answers at once,
    ``slow_search`` takes a minute (a preempt's target)."""
    from pydantic_ai import Agent

    # its own model never answers: the adapter's ``model`` must override it
    agent: Agent[None, str] = Agent("test", instructions="You are a test agent.")

    @agent.tool_plain
    async def lookup(key: str) -> str:
        """Look a key up."""
        return f"value-of-{key}"

    @agent.tool_plain
    async def slow_search(query: str, started: str = "") -> str:
        """Search slowly; ``started``: a file to create once the search runs."""
        if started:
            Path(started).touch()
        await asyncio.sleep(60)
        return f"found {query}"

    return agent
