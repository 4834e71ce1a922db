"""Framework agents for the adapter tests (tests/ is on the workers' path).

Each factory takes the session's config and returns the framework's agent; the adapter
points it at the test's model server (config ``model``).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any


def pydantic_ai_agent(config: dict[str, Any]) -> Any:
    """A Pydantic AI agent with tools of its own: ``lookup`` answers at once,
    ``slow_search`` takes a minute (a preempt's target), ``wait_for_file`` returns once a
    file appears (a test decides when it returns)."""
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

    @agent.tool_plain
    async def ledger_step(step: str, ledger: str) -> str:
        """A step of the durable-turn tests: see ``ledger_step``."""
        return await _ledger_step(step, ledger)

    @agent.tool_plain
    async def wait_for_file(path: str, started: str) -> str:
        """Return once ``path`` exists; ``started``: a file to write the worker's pid to
        once the call runs."""
        Path(started).write_text(str(os.getpid()))
        while not Path(path).exists():
            await asyncio.sleep(0.01)
        return f"{path} appeared"

    return agent


async def ledger_step(step: str, ledger: str) -> str:
    """A tool of the durable-turn tests (semantics §17.1): it appends ``<step> <call key>
    <worker pid>`` to the file ``ledger`` as it starts, so a test counts its runs and kills
    its worker; a step named ``hang…`` then waits until ``<ledger>.go`` exists."""
    import tether

    with open(ledger, "a") as f:
        f.write(f"{step} {tether.current_call_id()} {os.getpid()}\n")
    go = Path(ledger + ".go")
    while step.startswith("hang") and not go.exists():
        await asyncio.sleep(0.01)
    return f"{step} done"


_ledger_step = ledger_step


class LoopHoldingClaudeCode:
    """``ClaudeCodeAgent`` whose worker's event loop is held (blocked, as a busy loop
    would be) from the moment the file ``<config["hold"]>.on`` appears until
    ``<config["hold"]>.off`` does (10 s at most); it writes ``.held`` once holding. For a
    stop that must not wait for the loop."""

    async def run(self, ctx: Any) -> str | None:
        from tether.adapters.claude_code import ClaudeCodeAgent

        config = dict(ctx.config)
        hold = Path(config.pop("hold"))
        ctx.config = config  # the adapter refuses keys it does not know
        holder = asyncio.ensure_future(_hold_when_asked(hold))
        try:
            return await ClaudeCodeAgent().run(ctx)
        finally:
            holder.cancel()


async def _hold_when_asked(hold: Path) -> None:
    import time

    on, off, held = (hold.with_suffix(s) for s in (".on", ".off", ".held"))
    while not on.exists():
        await asyncio.sleep(0.005)
    held.touch()
    deadline = time.monotonic() + 10.0
    while not off.exists() and time.monotonic() < deadline:
        time.sleep(0.005)  # on the loop: nothing else of the turn runs meanwhile
