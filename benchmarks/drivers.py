"""Benchmark-only drivers, loaded by Tether workers as `"benchmarks.drivers:Name"`.

Both report a `time.perf_counter_ns()` reading taken inside the worker. On Linux that is
CLOCK_MONOTONIC, one clock for every process on the machine, so the host can subtract
its own reading taken when it issued the interrupt.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tether import Cancel, Scripted, Steer

if TYPE_CHECKING:
    from tether import TurnContext

POLLING = "probe: polling"
SEEN = "probe: seen "
STARTED = "stamp: started "
_POLL_S = 50e-6
_PROBE_LIMIT_S = 30.0  # a probe that never sees a cancel ends its turn instead of hanging


class CancelProbe:
    """Says it is polling, polls `ctx.cancel_requested`, says when it saw it become true.

    The loop sleeps 50 µs between polls, so the GIL is free most of the time and the
    worker's reader thread (which sets the flag) runs as soon as its frame arrives, as it
    would beside a real driver waiting on I/O. Measured alternatives: a pure spin holds
    the GIL, so the reader waits out the 5 ms switch interval (~5.5 ms p50); `sleep(0)`
    hands the GIL back but re-takes it at once and still delays the reader (~400 µs).
    The price is up to one poll period (~0.1 ms with the kernel's timer slack) added to
    each sample, so the figure is an upper bound.
    """

    def run(self, ctx: TurnContext) -> str | None:
        ctx.say(POLLING)
        deadline = time.monotonic() + _PROBE_LIMIT_S
        while not ctx.cancel_requested:
            if time.monotonic() > deadline:
                return "probe: no cancel arrived"
            time.sleep(_POLL_S)
        seen = time.perf_counter_ns()
        ctx.say(f"{SEEN}{seen}")
        ctx.checkpoint()  # take the Cancel at a boundary, as a driver must
        return None


class Stamped(Scripted):
    """The Scripted driver, saying first the moment its turn started running in a worker.

    The runtime's `turn.started` event fires when a turn is claimed, which can be long
    before a worker is free (`respawn_ms` measures exactly that wait), so the start is
    read from the worker itself.
    """

    def run(self, ctx: TurnContext) -> str | None:
        ctx.say(f"{STARTED}{time.perf_counter_ns()}")
        return super().run(ctx)


class SyncStreamer:
    """A sync driver streaming one chat completion with the sync `openai` client, blocking
    on each chunk: the contrast to the async ChatAgent. It hears a cancel only at a
    boundary, which a hung stream never reaches, so a cancel ends it by the grace kill.
    Config: `{"base_url": ..., "model": ...}`."""

    def run(self, ctx: TurnContext) -> str | None:
        import openai

        client = openai.OpenAI(base_url=ctx.config["base_url"], api_key="unused", max_retries=0)
        text = ""
        for chunk in client.chat.completions.create(
            model=ctx.config["model"], messages=[{"role": "user", "content": "go"}], stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        ctx.checkpoint()
        return text


CROSSED = "budget: crossed "


class BudgetCrosser:
    """A boundary every 1 ms until stopped. At a steer it reports ``data["tokens"]`` tokens
    (``ctx.add_usage``, once) and says the moment just before it sent that report."""

    def run(self, ctx: TurnContext) -> str | None:
        tokens = int((ctx.message.data or {}).get("tokens", 0))
        while True:
            for frame in ctx.checkpoint():
                if isinstance(frame, Cancel):
                    return "stopped"
                if isinstance(frame, Steer) and tokens:
                    stamp = time.perf_counter_ns()
                    ctx.add_usage({"prompt_tokens": tokens})
                    ctx.say(f"{CROSSED}{stamp}")
                    tokens = 0
            time.sleep(0.001)


_USAGE = {"prompt_tokens": 120, "completion_tokens": 30}


class Responder:
    """``data["responses"]`` model-like replies: a boundary, the reply's assistant entry and
    (with ``data["usage"]``) the usage report a model reply brings, as ChatAgent does."""

    def run(self, ctx: TurnContext) -> str | None:
        data = ctx.message.data or {}
        usage = bool(data.get("usage"))
        for i in range(int(data.get("responses", 1))):
            ctx.checkpoint()
            # as ChatAgent reports a response: its usage in its reply's frame
            ctx.say(f"reply {i}", usage=_USAGE if usage else None)
        return "ok"
