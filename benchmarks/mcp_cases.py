"""The MCP client's stop (semantics §15.3): how soon a cancelled call reaches the server.

`cancel_ms`: the awaiting task is cancelled (wall clock read just before) → the stdio
server has received ``notifications/cancelled`` for that request (its own log's wall
clock, taken by its middleware on receipt). Both clocks are this machine's
``time.time()``. `echo_rtt_ms`: a whole ``echo`` call over the same pipe, for context: one
message each way plus the SDK's work on both ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks._case import Cfg, Samples, Skip

if TYPE_CHECKING:
    from tether.agents import McpTools

WAIT = 15.0


class _Tail:
    """The server's log, read from where the last read stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                data = f.read()
            complete = data[: data.rfind("\n") + 1]
            self.offset += len(complete.encode())
            self.records.extend(json.loads(line) for line in complete.splitlines() if line)
        return self.records

    async def until(self, want: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            for record in self.read():
                if all(record.get(k) == v for k, v in want.items()):
                    return record
            await asyncio.sleep(0.0005)
        raise RuntimeError(f"the server never logged {want}")


async def _one_cancel(tools: McpTools, tail: _Tail) -> float:
    task = asyncio.create_task(tools.call("mcp__b__hang", {"seconds": 60}))
    calls = len([r for r in tail.read() if r.get("tool") == "hang"])
    deadline = time.monotonic() + WAIT
    while len([r for r in tail.read() if r.get("tool") == "hang"]) == calls:
        if time.monotonic() > deadline:
            raise RuntimeError("the hang call never reached the server")
        await asyncio.sleep(0.0005)
    request = [r for r in tail.records if r.get("tool") == "hang"][-1]
    t0 = time.time()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if tools.last_fate != "cancelled":
        raise RuntimeError(f"the call ended {tools.last_fate}, not cancelled")
    got = await tail.until({"method": "notifications/cancelled", "requestId": request["id"]})
    return float(got["t"] - t0) * 1000


async def _one_echo(tools: McpTools) -> float:
    t0 = time.perf_counter_ns()
    await tools.call("mcp__b__echo", {"text": "x"})
    return (time.perf_counter_ns() - t0) / 1e6


def mcp_cancel(cfg: Cfg) -> Iterator[Samples]:
    """Cancel a `hang` call on a stdio server → the server has its notifications/cancelled."""
    try:
        from tether.agents import McpTools
        from tether.testing.mcp_server import LOG_ENV
    except ImportError as e:
        raise Skip(
            f"the mcp SDK is not installed ({e}); pip install 'tether-runtime[agents]'"
        ) from e
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "mcp.jsonl"
        path = os.pathsep.join(p for p in (*sys.path, os.environ.get("PYTHONPATH", "")) if p)
        server = {
            "command": [sys.executable, "-m", "tether.testing.mcp_server"],
            "env": {LOG_ENV: str(log), "PYTHONPATH": path},
        }
        tools = McpTools({"b": server}, grace=WAIT)
        tail = _Tail(log)
        loop = asyncio.new_event_loop()
        try:
            for _ in range(20):  # warm up both ends
                loop.run_until_complete(_one_echo(tools))
            while True:
                cancels = [
                    loop.run_until_complete(_one_cancel(tools, tail)) for _ in range(cfg.n(20, 100))
                ]
                echoes = [loop.run_until_complete(_one_echo(tools)) for _ in range(cfg.n(50, 200))]
                yield {"cancel_ms": cancels, "echo_rtt_ms": echoes}
        finally:
            loop.run_until_complete(tools.aclose())
            loop.close()
