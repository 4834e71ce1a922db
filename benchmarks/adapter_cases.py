"""The framework adapters' cancel (issue 27, semantics §16.1), measured as ChatAgent's is.

Each case runs one adapter agent (Pydantic AI, the OpenAI Agents SDK, Claude Code) with
the same hung reply as `cancel_inflight` and cancels its turns mid-stream through
`agent_cases._cancel_case`: each sample is `rt.interrupt(kind="cancel")` → the disconnect
the model server records (`disconnect_ms`), with the turn ended `cancelled` and its partial
reply kept. The ChatAgent figure they are paired with is the same series of
`cancel_inflight`, from the same run. The Claude Code row has a floor of its own for
context: the SDK's `interrupt()` on a freshly started CLI, with no Tether.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from benchmarks._case import Cfg, Samples, Skip
from benchmarks.agent_cases import HUNG, _cancel_case, _in_flight
from benchmarks.tether_cases import WAIT
from tether.testing import ModelServer

GRACE = 5.0  # as cancel_inflight's: a cancel not taken would show as a grace kill
CLAUDE_MODEL = "claude-sonnet-4-5"  # the CLI refuses model names it does not know
CLAUDE_KEY_ENV = "TETHER_BENCH_ANTHROPIC_KEY"


def _need(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"the adapter needs the extra tether-runtime[{extra}] ({module})")


def adapter_cancel_pydantic_ai(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="cancel")` → the disconnect, a Pydantic AI agent mid-stream."""
    _need("pydantic_ai", "pydantic-ai")

    def config(server: ModelServer) -> dict[str, Any]:
        model = {"base_url": server.url, "name": "pyd-inflight", "retries": 0}
        return {"agent": "benchmarks.adapter_agents:pydantic_ai_agent", "model": model}

    driver = "tether.adapters.pydantic_ai:PydanticAIAgent"
    yield from _cancel_case(cfg, driver, config, "pyd-inflight", GRACE, cfg.n(20, 60))


def adapter_cancel_openai_agents(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="cancel")` → the disconnect, an Agents SDK agent mid-stream."""
    _need("agents", "openai-agents")

    def config(server: ModelServer) -> dict[str, Any]:
        model = {"base_url": server.url, "name": "oai-inflight", "retries": 0}
        return {"agent": "benchmarks.adapter_agents:openai_agents_agent", "model": model}

    driver = "tether.adapters.openai_agents:OpenAIAgentsAgent"
    yield from _cancel_case(cfg, driver, config, "oai-inflight", GRACE, cfg.n(20, 60))


def adapter_cancel_claude_code(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="cancel")` → the disconnect, the real Claude Code CLI mid-stream
    against the model server's Anthropic wire. The adapter starts a CLI per turn (and
    resumes the session), so each sample pays a CLI start outside the timed span: few
    samples."""
    _need("claude_agent_sdk", "claude")
    os.environ[CLAUDE_KEY_ENV] = "x"  # this case's own process; the workers inherit it
    with tempfile.TemporaryDirectory(prefix="tether-bench-claude-") as home:

        def config(server: ModelServer) -> dict[str, Any]:
            claude = {"model": CLAUDE_MODEL, "cwd": home, "env": {"HOME": home}}
            return {
                "claude": claude,
                "model": {"base_url": server.root, "api_key_env": CLAUDE_KEY_ENV},
            }

        driver = "tether.adapters.claude_code:ClaudeCodeAgent"
        yield from _cancel_case(cfg, driver, config, CLAUDE_MODEL, GRACE, cfg.n(8, 20))


def claude_interrupt_floor(cfg: Cfg) -> Iterator[Samples]:
    """The floor under `adapter_cancel_p50_ms_claude_code`, with no Tether: in this
    process, `ClaudeSDKClient.interrupt()` on a CLI started for the sample (as the
    adapter starts one per turn) mid-stream in the same hung reply → the disconnect
    the server records. A CLI's first interrupt is slower than a warm one's."""
    _need("claude_agent_sdk", "claude")
    from claude_agent_sdk import ClaudeAgentOptions, ClaudeSDKClient

    from tether.adapters.claude_code import _stop

    with (
        tempfile.TemporaryDirectory(prefix="tether-bench-claude-") as home,
        ModelServer(process=True, realtime=True) as server,
    ):
        server.script(CLAUDE_MODEL, HUNG)
        env = {
            "CLAUDE_CONFIG_DIR": home,
            "HOME": home,
            "ANTHROPIC_BASE_URL": server.root,
            "ANTHROPIC_API_KEY": "x",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
        }
        options = ClaudeAgentOptions(
            model=CLAUDE_MODEL, cwd=home, env=env, include_partial_messages=True
        )
        count = 0

        async def once() -> float:
            nonlocal count
            client = ClaudeSDKClient(options)
            try:
                await client.connect()
                await client.query("go")
                reading = asyncio.ensure_future(_drain(client))
                count += 1
                request = await asyncio.to_thread(_in_flight, server, CLAUDE_MODEL, count)
                called = time.time()
                await client.interrupt()
                gone = await asyncio.to_thread(server.wait_disconnect, request, timeout=WAIT)
                await asyncio.wait_for(reading, WAIT)
                return (gone.time - called) * 1000
            finally:
                await _stop(client, None)

        async def batch(n: int) -> list[float]:
            return [await once() for _ in range(n)]

        while True:
            yield {"disconnect_ms": asyncio.run(batch(cfg.n(8, 20)))}


async def _drain(client: Any) -> None:
    async for _ in client.receive_response():
        pass
