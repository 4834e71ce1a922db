"""``tether.agents.drain.drained``: a cancelled model stream keeps what had arrived.

A real event loop; the stream is a coroutine awaiting data the test hands it. The race is
made exact, not hoped for: the data lands and the cancel comes in the same step, before
the reader has run, as when bytes reach the worker's buffer just as the cancel does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tether.agents.drain import DRAIN_LIMIT, drained

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

Wrap = Callable[[Any, Callable[[], int]], Awaitable[Any]]


async def _plain(read: Any, progress: Callable[[], int]) -> Any:
    return await read  # what a stream's reader did before: the cancel thrown in at once


async def _cut_with_data_waiting(wrap: Wrap) -> list[bytes]:
    """Hand the reader data and cancel its caller in one step; what the reader took."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[bytes] = loop.create_future()
    got: list[bytes] = []

    async def read() -> None:
        data = await arrived
        await asyncio.sleep(0)  # a checkpoint between the read and the parse, as anyio's
        await asyncio.sleep(0)
        got.append(data)
        await loop.create_future()  # then the stream hangs, as a model's may

    caller = asyncio.ensure_future(wrap(read(), lambda: len(got)))
    for _ in range(5):  # the reader waits on its data
        await asyncio.sleep(0)
    arrived.set_result(b"the first words")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    return got


def test_a_cancel_as_data_arrives_lets_the_stream_take_it_first() -> None:
    assert asyncio.run(_cut_with_data_waiting(drained)) == [b"the first words"]
    # the race is real: awaited plainly, the same cancel drops what had arrived
    assert asyncio.run(_cut_with_data_waiting(_plain)) == []


def test_a_stream_that_keeps_moving_is_cut_after_the_drain_limit() -> None:
    async def main() -> float:
        moved = 0

        async def read() -> None:
            nonlocal moved
            while True:
                moved += 1
                await asyncio.sleep(0)

        caller = asyncio.ensure_future(drained(read(), lambda: moved))
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        began = loop.time()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        return loop.time() - began

    took = asyncio.run(main())
    assert DRAIN_LIMIT <= took < DRAIN_LIMIT + 1.0, took


def test_the_stream_is_closed_before_the_cancel_goes_on_and_its_error_gives_way() -> None:
    async def main() -> list[str]:
        seen: list[str] = []

        async def read() -> None:
            try:
                await asyncio.get_running_loop().create_future()
            finally:
                seen.append("closed")
                raise OSError("the connection broke as it was cut")

        caller = asyncio.ensure_future(drained(read(), lambda: 0))
        await asyncio.sleep(0)
        caller.cancel()
        try:
            await caller
        except asyncio.CancelledError:
            seen.append("cancelled")
        return seen

    assert asyncio.run(main()) == ["closed", "cancelled"]


def test_without_a_cancel_the_read_answers_and_raises_as_it_would() -> None:
    async def ok() -> str:
        return "reply"

    async def broken() -> str:
        raise ConnectionError("refused")

    assert asyncio.run(drained(ok(), lambda: 0)) == "reply"
    with pytest.raises(ConnectionError):
        asyncio.run(drained(broken(), lambda: 0))
