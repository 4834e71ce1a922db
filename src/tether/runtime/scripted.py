"""The deterministic ``Scripted`` driver (SPEC §11), for tests, demos and benchmarks.

``message.data["steps"]`` is run in order with ``ctx.checkpoint()`` before every step.
"""

from __future__ import annotations

import time
from typing import Any

from tether.wire.errors import TetherError
from tether.wire.frames import Cancel, Steer
from tether.wire.text import escape

__all__ = ["Scripted"]


class Scripted:
    """Runs the steps of its message; see SPEC §11 for the ops."""

    def __init__(self) -> None:
        self._ignore_cancel = False
        self._steps_done = 0
        self._ctx: Any = None

    def run(self, ctx: Any) -> str | None:
        self._ctx = ctx
        steps = (ctx.message.data or {}).get("steps")
        if steps is None:
            return f"ok: {ctx.message.content}"
        try:
            for step in steps:
                if self._boundary():
                    return None
                self._step(step)
        except _Stop:
            pass
        return None

    def _boundary(self) -> bool:
        """One checkpoint; True when a cancel was delivered and the script must stop."""
        self._steps_done += 1
        for frame in self._ctx.checkpoint():
            match frame:
                case Steer():
                    self._ctx.say(frame.render())
                case Cancel() if not self._ignore_cancel:
                    self._ctx.say(
                        f"cancelled after {self._steps_done - 1} steps: {escape(frame.reason)}"
                    )
                    return True
        return False

    def _step(self, step: dict[str, Any]) -> None:
        ctx = self._ctx
        match step.get("op"):
            case "say":
                ctx.say(str(step.get("text", "")))
            case "work":
                every = float(step.get("every", 0.0))
                for _ in range(int(step.get("steps", 1))):
                    if every:
                        time.sleep(every)
                    if self._boundary():
                        raise _Stop
            case "hang":
                while True:
                    time.sleep(0.01)
                    if self._boundary():
                        raise _Stop
            case "sleep":  # a model call that hangs: no boundary, no progress
                time.sleep(float(step.get("seconds", 1.0)))
            case "tool":
                self._tool("run_command", lambda: _fmt_command(ctx.run_command(step["argv"])))
            case "loop":  # the same tool call over and over, a boundary between, until stopped
                while True:
                    self._tool("run_command", lambda: _fmt_command(ctx.run_command(step["argv"])))
                    if self._boundary():
                        raise _Stop
            case "spawn":  # the child runs this same driver (the host chooses it)
                self._tool(
                    "spawn_agent",
                    lambda: (
                        "spawned "
                        + ctx.spawn_agent(
                            slug=step.get("slug"),
                            mode=step.get("mode", "continuable"),
                            prompt=_spawn_prompt(step),
                            data=step.get("data"),
                        )
                    ),
                )
            case "send":
                self._tool(
                    "send_message",
                    lambda: (
                        f"sent to {step['to']} as "
                        + ctx.send_message(step["to"], step.get("text", ""), data=step.get("data"))
                    ),
                )
            case "interrupt":
                self._tool(
                    "interrupt_agent",
                    lambda: (
                        f"{step.get('kind', 'cancel')} issued to {step['target']}: "
                        + str(
                            ctx.interrupt_agent(
                                step["target"],
                                kind=step.get("kind", "cancel"),
                                reason=step.get("reason", ""),
                            )
                            or "no-op"
                        )
                    ),
                )
            case "ignore_cancel":
                self._ignore_cancel = True
            case other:
                ctx.record_tool(f"unknown op {other!r}")

    def _tool(self, name: str, call: Any) -> None:
        """Run one tool; a refusal or failure is recorded and the script goes on."""
        try:
            result = call()
        except TetherError as exc:
            self._ctx.record_tool(f"{name} failed: {exc.code}: {exc.message}")
            return
        if name != "run_command":
            self._ctx.record_tool(str(result))
        elif result is not None:
            self._ctx.record_tool(result)


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
