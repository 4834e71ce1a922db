"""The deterministic ``Scripted`` driver, for tests, demos and benchmarks, and its async
twin ``AsyncScripted`` (``"tether:AsyncScripted"``).

``message.data["steps"]`` is run in order with ``ctx.checkpoint()`` before every step. The
ops: docs/semantics.md section 11 and docs/design.md, section 12.4.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from tether.wire.errors import TetherError
from tether.wire.frames import Cancel, Steer
from tether.wire.text import escape

__all__ = ["AsyncScripted", "Scripted"]


class _Script:
    """What the two scripted drivers do alike: their state, a boundary's frames, the ops
    that never await, and how a tool's failure reads."""

    def __init__(self) -> None:
        self._ignore_cancel = False
        self._steps_done = 0
        self._ctx: Any = None

    def _take(self, frames: list[Steer | Cancel], steps: int) -> bool:
        """Act on a boundary's frames: each steer said as a model would read it; a cancel
        (unless ignored) said and True: the script stops."""
        for frame in frames:
            match frame:
                case Steer():
                    self._ctx.say(frame.render())
                case Cancel() if not self._ignore_cancel:
                    self._ctx.say(f"cancelled after {steps} steps: {escape(frame.reason)}")
                    return True
        return False

    def _say(self, step: dict[str, Any]) -> None:
        self._ctx.say(str(step.get("text", "")))

    def _block(self, step: dict[str, Any]) -> None:
        """A call that blocks the thread (and an async driver's loop): no boundary, no
        progress."""
        if "say" in step:
            self._ctx.say(str(step["say"]))
        time.sleep(float(step.get("seconds", 1.0)))

    def _unknown(self, op: Any) -> None:
        self._ctx.record_tool(f"unknown op {op!r}")

    def _failed(self, op: _ToolOp, exc: TetherError) -> None:
        self._ctx.record_tool(f"{op.name} failed: {exc.code}: {exc.message}")


class Scripted(_Script):
    """Runs the steps of its message; see semantics §11 for the ops."""

    def run(self, ctx: Any) -> str | None:
        self._ctx = ctx
        steps = (ctx.message.data or {}).get("steps")
        if steps is None:
            return f"ok: {ctx.message.content}"
        with contextlib.suppress(_Stop):
            self._steps(steps)
        return None

    def _steps(self, steps: list[dict[str, Any]]) -> None:
        for step in steps:
            if self._boundary():
                raise _Stop
            self._step(step)

    def _boundary(self) -> bool:
        """One checkpoint; True when a cancel was delivered and the script must stop."""
        self._steps_done += 1
        return self._take(self._ctx.checkpoint(), self._steps_done - 1)

    def _step(self, step: dict[str, Any]) -> None:
        match step.get("op"):
            case "say":
                self._say(step)
            case "work":
                self._work(step)
            case "hang":
                self._hang()
            case "sleep" | "block":  # a call that hangs: no boundary, no progress
                self._block(step)
            case "loop":  # the same tool call over and over, a boundary between, until stopped
                self._loop(step)
            case "shield":
                self._steps(list(step.get("steps", [])))
            case "ignore_cancel":
                self._ignore_cancel = True
            case op if op in _TOOL_OPS:
                self._tool(_TOOL_OPS[op], step)
            case other:
                self._unknown(other)

    def _work(self, step: dict[str, Any]) -> None:
        """``steps`` boundaries, ``every`` seconds of work before each."""
        every = float(step.get("every", 0.0))
        for _ in range(int(step.get("steps", 1))):
            if every:
                time.sleep(every)
            if self._boundary():
                raise _Stop

    def _hang(self) -> None:
        """Boundaries every 10 ms until a cancel stops the script."""
        while True:
            time.sleep(0.01)
            if self._boundary():
                raise _Stop

    def _loop(self, step: dict[str, Any]) -> None:
        while True:
            self._tool(_TOOL_OPS["tool"], step)
            if self._boundary():
                raise _Stop

    def _tool(self, op: _ToolOp, step: dict[str, Any]) -> None:
        """Run one tool; a refusal or failure is recorded and the script goes on."""
        try:
            result = op.invoke(self._ctx, step)
        except TetherError as exc:
            self._failed(op, exc)
            return
        self._ctx.record_tool(op.shape(step, result))


class AsyncScripted(_Script):
    """The async twin of ``Scripted`` (``"tether:AsyncScripted"``): the same ops, awaited.

    A cancel arrives as ``CancelledError`` wherever the script awaits; the script then
    says ``cancelled after N steps: <reason>`` and returns, as the sync one does at a
    boundary. After ``ignore_cancel`` it swallows the error and goes on (to test
    force-break).
    """

    async def run(self, ctx: Any) -> str | None:
        self._ctx = ctx
        steps = (ctx.message.data or {}).get("steps")
        if steps is None:
            return f"ok: {ctx.message.content}"
        try:
            await self._steps(steps)
        except _Stop:
            pass
        except asyncio.CancelledError:
            cancel = ctx.cancel
            if cancel is None:
                raise  # not our turn's cancel: let it end the turn
            ctx.say(f"cancelled after {self._steps_done} steps: {escape(cancel.reason)}")
        return None

    async def _steps(self, steps: list[dict[str, Any]]) -> None:
        for step in steps:
            if await self._boundary():
                raise _Stop
            await self._step(step)

    async def _wait(self, awaitable: Any) -> Any:
        """Await; after ``ignore_cancel``, a cancel landing here is swallowed (None)."""
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._ignore_cancel and self._ctx.cancel is not None:
                return None
            raise

    async def _boundary(self) -> bool:
        self._steps_done += 1
        frames = await self._wait(self._ctx.checkpoint())
        return self._take(frames or [], self._steps_done - 1)

    async def _step(self, step: dict[str, Any]) -> None:
        match step.get("op"):
            case "say":
                self._say(step)
            case "work":
                await self._work(step)
            case "hang":
                await self._hang()
            case "sleep":  # an awaited call that hangs: a cancel lands here at once
                await self._wait(asyncio.sleep(float(step.get("seconds", 1.0))))
            case "block":  # a driver that blocks its own loop
                self._block(step)
            case "loop":
                await self._loop(step)
            case "shield":
                with self._ctx.shield():
                    await self._steps(list(step.get("steps", [])))
            case "ignore_cancel":
                self._ignore_cancel = True
            case op if op in _TOOL_OPS:
                await self._tool(_TOOL_OPS[op], step)
            case other:
                self._unknown(other)

    async def _work(self, step: dict[str, Any]) -> None:
        every = float(step.get("every", 0.0))
        for _ in range(int(step.get("steps", 1))):
            if every:
                await self._wait(asyncio.sleep(every))
            if await self._boundary():
                raise _Stop

    async def _hang(self) -> None:
        while True:
            await self._wait(asyncio.sleep(0.01))
            if await self._boundary():
                raise _Stop

    async def _loop(self, step: dict[str, Any]) -> None:
        while True:
            await self._tool(_TOOL_OPS["tool"], step)
            if await self._boundary():
                raise _Stop

    async def _tool(self, op: _ToolOp, step: dict[str, Any]) -> None:
        try:
            result = await self._wait(op.invoke(self._ctx, step))
        except TetherError as exc:
            self._failed(op, exc)
            return
        if result is not None:  # None: a swallowed cancel cut it
            self._ctx.record_tool(op.shape(step, result))


class _ToolOp:
    """A tool op: how to call it on a context (a value, or an awaitable for an async one)
    and how its result reads in the transcript."""

    def __init__(
        self,
        name: str,
        invoke: Callable[[Any, dict[str, Any]], Any],
        shape: Callable[[dict[str, Any], Any], str],
    ) -> None:
        self.name = name
        self.invoke = invoke
        self.shape = shape


def _interrupt_text(step: dict[str, Any], turn: Any) -> str:
    return f"{step.get('kind', 'cancel')} issued to {step['target']}: {turn or 'no-op'}"


_TOOL_OPS: dict[str, _ToolOp] = {
    "tool": _ToolOp(
        "run_command", lambda ctx, st: ctx.run_command(st["argv"]), lambda st, r: _fmt_command(r)
    ),
    "spawn": _ToolOp(
        "spawn_agent",
        lambda ctx, st: ctx.spawn_agent(
            slug=st.get("slug"),
            mode=st.get("mode", "continuable"),
            prompt=_spawn_prompt(st),
            data=st.get("data"),
            budget=st.get("budget"),
        ),
        lambda st, child: f"spawned {child}",
    ),
    "send": _ToolOp(
        "send_message",
        lambda ctx, st: ctx.send_message(st["to"], st.get("text", ""), data=st.get("data")),
        lambda st, message: f"sent to {st['to']} as {message}",
    ),
    "interrupt": _ToolOp(
        "interrupt_agent",
        lambda ctx, st: ctx.interrupt_agent(
            st["target"], kind=st.get("kind", "cancel"), reason=st.get("reason", "")
        ),
        _interrupt_text,
    ),
}


class _Stop(BaseException):
    """Unwinds a multi-boundary op once a cancel was delivered."""


def _fmt_command(result: Any) -> str:
    text = f"exit {result.returncode}"
    out = (result.stdout or "").strip()
    return f"{text}: {out[-500:]}" if out else text


def _spawn_prompt(step: dict[str, Any]) -> str | None:
    """A spawn step with ``data`` (or a text) gives the child its first message."""
    prompt = step.get("prompt", step.get("text"))
    if prompt is None and step.get("data") is not None:
        return str(step.get("slug") or "task")
    return None if prompt is None else str(prompt)
