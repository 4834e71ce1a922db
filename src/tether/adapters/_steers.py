"""Steers handed to a framework as they arrive, marked when it takes them (semantics §16.1).

For the adapters whose framework takes a message mid-run (Pydantic AI's ``enqueue``, a
message written to the Claude Code CLI mid-turn): a steer is offered to the framework at
once, and stays pending in the turn until the framework's own delivery (the request that
carries it), when the host writes its ``steered`` marker. Looking is no boundary, so a
poll never hides a stalled turn from the watchdog.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from tether.driver.async_context import AsyncTurnContext
from tether.wire.frames import Steer

__all__ = ["SteerRelay"]

POLL = 0.02  # seconds between looks for a steer that arrived


class SteerRelay:
    """The steers of one turn offered to its framework and not taken yet."""

    def __init__(self, ctx: AsyncTurnContext) -> None:
        self.ctx = ctx
        self.offered: list[Steer] = []

    def new(self) -> list[Steer]:
        """The steers that arrived since the last look, counted as offered from now on
        (before the offer, which may await: the turn's end waits for them)."""
        fresh = [s for s in self.ctx.pending_steers() if all(s is not o for o in self.offered)]
        self.offered.extend(fresh)
        return fresh

    async def run(self, offer: Callable[[Steer], Awaitable[None]]) -> None:
        """Offer each steer as it arrives, until cancelled."""
        while True:
            await asyncio.sleep(POLL)
            for steer in self.new():
                await offer(steer)

    def taken(self, steers: Iterable[Steer] | None = None) -> None:
        """The framework took these steers (every one offered, by default) just now."""
        took = list(self.offered if steers is None else steers)
        if not took:
            return
        self.offered = [s for s in self.offered if all(s is not t for t in took)]
        self.ctx.delivered(took)
