"""A cancelled model stream keeps what the worker had already read of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["DRAIN_LIMIT", "drained", "settle"]

T = TypeVar("T")

# The most a cancel waits for what was read to be parsed: the stream is cut after this
# even when it still moves (a fast stream would otherwise hold the cancel back).
DRAIN_LIMIT = 0.05
# Loop rounds in a row with no progress: the stream waits on the network, not on us.
# A read whose bytes are buffered resumes within two rounds (its wakeup, a checkpoint).
_IDLE_ROUNDS = 5


async def drained(read: Coroutine[Any, Any, T], progress: Callable[[], int]) -> T:
    """Await ``read`` (a coroutine that reads a model stream) so that the caller's cancel
    first lets it take what has arrived: asyncio may hold bytes that the stream's parser
    has not seen yet, and a cancel thrown in at that await would drop them, and with them
    the partial reply the cut must keep.

    On the caller's cancel, ``read`` runs on while ``progress()`` still moves between
    loop rounds (at most ``DRAIN_LIMIT``), is then cancelled and awaited (so its stream
    is closed), and the caller's ``CancelledError`` goes on. Shielded only for that."""
    task = asyncio.ensure_future(read)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await _drain(task, progress)
        raise


async def settle(progress: Callable[[], int], done: Callable[[], bool] = lambda: False) -> None:
    """Give the loop back while ``progress()`` still moves between its rounds, at most
    ``DRAIN_LIMIT`` (until ``done()``): a stream read in another task takes what has
    arrived. A cancel of the caller ends the wait at once."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DRAIN_LIMIT
    seen, idle = progress(), 0
    with contextlib.suppress(asyncio.CancelledError):  # cancelled again: no more waiting
        while not done() and idle < _IDLE_ROUNDS and loop.time() < end:
            await asyncio.sleep(0)
            now = progress()
            idle = idle + 1 if now == seen else 0
            seen = now


async def _drain(task: asyncio.Future[Any], progress: Callable[[], int]) -> None:
    try:
        await settle(progress, task.done)
    finally:
        task.cancel()
        # its own unwinding closes the connection before the turn ends; what it raises
        # (its cancel, or an error the stream hit meanwhile) gives way to the caller's
        with contextlib.suppress(BaseException):
            await task
