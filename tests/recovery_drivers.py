"""Drivers of the durable-turn tests (tests/ is on the workers' path)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tether.driver.calls import calling


class SpawnsInACall:
    """A recoverable async driver whose one tool call spawns two children (no prompt),
    appends ``<first> <second> <pid>`` to the file ``config["ledger"]``, then, on its
    first run, hangs until killed. Recovered, it issues the same call again under its
    key (as an idempotent tool would run again) and records its result."""

    recoverable = True

    async def run(self, ctx: Any) -> str | None:
        if ctx.recovered is None:
            key = await ctx.begin_call("spawn_agent", "{}", "call_spawn")
        else:
            [unknown] = ctx.recovered.unknown_calls
            key = unknown.key
        with calling(key):
            first = await ctx.spawn_agent()
            second = await ctx.spawn_agent()
        with open(ctx.config["ledger"], "a") as f:
            f.write(f"{first} {second} {os.getpid()}\n")
        if ctx.recovered is None:
            await asyncio.sleep(300)  # killed here
        data = {"tool_call_id": "call_spawn", "name": "spawn_agent", "call": key}
        ctx.record_tool(f"{first} {second}", data=data)
        ctx.say("spawned")
        return None
