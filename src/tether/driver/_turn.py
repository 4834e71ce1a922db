"""A turn's state in the worker, shared by the reader thread (``runtime/worker.py``) and
the driver's context (``context.py``, ``async_context.py``), and the port through which a
context reaches its worker.

This room never imports the runtime: the worker hands each context itself as a
``WorkerPort`` (frames to the host, its event loop, the kill walk for a command's tree),
as the actors reach the pool through ``actors/ports.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from tether.driver._command import COMMAND_ENV, command_ids
from tether.driver.toolenv import spawn_options, tool_env
from tether.wire.errors import TetherError, error_from_code
from tether.wire.frames import (
    Cancel,
    Preempt,
    Progress,
    RunTurn,
    Steer,
    ToolFateName,
    ToolMark,
    ToolReply,
    TurnEnd,
)

__all__ = ["WorkerPort", "end_of"]


class WorkerPort(Protocol):
    """What a turn's context needs from the worker process that runs it."""

    def send(self, frame: msgspec.Struct) -> None:
        """Send a frame to the host (a broken pipe ends the worker quietly)."""
        ...

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The worker's one event loop, for async turns."""
        ...

    def kill_command(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill a running command and its descendants; never reaps."""
        ...

    def kill_leftovers(self, tag: str | None) -> None:
        """Kill and reap what a finished command left behind (``None``: everything)."""
        ...


class _TurnState:
    """What the reader thread shares with the main thread for the current turn."""

    def __init__(self, run: RunTurn, worker: WorkerPort) -> None:
        self.turn = run.turn
        self._worker = worker
        self._send = worker.send
        self._tools = itertools.count(1)
        self.lock = threading.Lock()
        self.steers: list[Steer] = []
        self.cancel: Cancel | None = None
        self.cancel_delivered = False
        self.escalating = False  # the host's deadline passed first: never deliver now
        self.progress = _ProgressMeter(run.progress_every, run.repeat)
        self.cancel_event = threading.Event()
        self.replies: dict[int, ToolReply] = {}
        self.reply_ready = threading.Condition(self.lock)
        # The commands in flight (a driver may run several at once, from threads), each
        # with the preempt that killed it, if one did.
        self.tools: dict[subprocess.Popen[bytes], Preempt | None] = {}
        self.starting = 0  # commands between Popen's fork and our holding their handle
        self.early: Preempt | None = None  # a preempt that came while one was starting
        # Held to start a command and to clean up after one: a clean-up that sweeps
        # every orphan (the last command out) never meets a command just forked.
        self.spawn_lock = threading.Lock()
        self.usage: dict[str, int | bool] = {}
        # An async turn (driver/async_context.py) hooks in here; the reader thread calls
        # each hook outside the lock (``on_reply`` inside it: it only pops a waiter and
        # schedules a callback), and the hooks hand the work to the event loop.
        self.on_cancel: Callable[[], None] | None = None
        self.on_preempt: Callable[[Preempt], None] | None = None
        self.on_reply: Callable[[ToolReply], bool] | None = None

    # ---- open tool calls, for the host's stop reports (semantics §15.6) ---------------------

    def tool_opened(self, name: str, call: str | None = None) -> int:
        """Tell the host a tool call started; its number, for ``tool_closed``.

        Every way of running a tool (``run_command``, an async or MCP call) brackets the
        call with these two, so the host knows which calls a stop finds open.
        """
        tool = next(self._tools)  # itertools.count is atomic under the GIL
        self._send(Progress(turn=self.turn, beat=False, tools=[ToolMark(tool, name, call=call)]))
        return tool

    def tool_closed(self, tool: int, fate: ToolFateName = "returned") -> None:
        """Tell the host how tool call ``tool`` ended (``returned``, ``preempted``,
        ``cancelled``, ``abandoned``, ``shielded``; ``killed`` is the host's to say)."""
        self._send(Progress(turn=self.turn, beat=False, tools=[ToolMark(tool, fate=fate)]))

    def preempt_commands(self, frame: Preempt) -> tuple[list[subprocess.Popen[bytes]], bool]:
        """Mark this turn's running commands as preempted by ``frame`` and return them
        for killing; a command still starting is killed once it has a pid. Also whether
        any command was hit: if none was, the preempt is for the innermost tool call
        (``on_preempt``). The caller kills outside the lock."""
        with self.lock:
            victims = [p for p, by in self.tools.items() if by is None]
            for p in victims:
                self.tools[p] = frame
            if self.starting and self.early is None:
                self.early = frame
            return victims, bool(victims) or bool(self.starting)

    def start_command(
        self, argv: list[str], cwd: str | None
    ) -> tuple[subprocess.Popen[bytes], int, str]:
        """Start one ``run_command`` (sync or async) once its progress is noted: opened
        as a tool call, tagged (its clean-up tells its orphans from another command's
        among the processes re-parented to us), and killed at once if a preempt came
        while it was starting. Returns the process, the tool call's id and the tag."""
        tool = self.tool_opened("run_command")
        tag = f"{os.getpid()}.{next(command_ids)}"
        with self.lock:
            self.starting += 1
        try:
            with self.spawn_lock:
                proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=tool_env(extra={COMMAND_ENV: tag}),
                    **spawn_options(),
                )
        except BaseException as exc:
            self.tool_closed(tool)  # it never ran: nothing of it was cut
            with self.lock:
                self.starting -= 1
                if self.starting == 0:
                    self.early = None
                self.progress.in_tool = bool(self.tools)
            if isinstance(exc, OSError):  # not found, not executable: the caller's input
                raise error_from_code("invalid-params", f"cannot run {argv[0]!r}: {exc}") from None
            raise
        with self.lock:
            self.starting -= 1
            early = self.tools[proc] = self.early
            if self.starting == 0:
                self.early = None
        if early is not None:
            self._worker.kill_command(proc)
        return proc, tool, tag


class _ProgressMeter:
    """Progress for the host's stall watchdog, rate-limited: no frame per boundary.

    Progress is a boundary, a ``say``, a tool call or its return; the same tool called
    with the same arguments ``repeat`` times in a row is a loop, and nothing counts as
    progress until a different call breaks it.
    """

    def __init__(self, every: float | None, repeat: int | None) -> None:
        self.every = every
        self.repeat = repeat
        self.reported = time.monotonic()
        self.pending = False
        self.last_call: tuple[str, str] | None = None
        self.same = 0
        self.in_tool = False

    def note(self, call: tuple[str, str] | None = None) -> bool:
        """Record progress; True when a report is due now."""
        if self.every is None:
            return False
        if call is not None:
            self.same = self.same + 1 if call == self.last_call else 1
            self.last_call = call
        if self.repeat is not None and self.same >= self.repeat:
            return False  # looping
        self.pending = True
        now = time.monotonic()
        if now - self.reported < self.every:
            return False
        self.reported = now
        self.pending = False
        return True


def end_of(
    run: RunTurn, state: _TurnState, *, final: Any = None, error: BaseException | None = None
) -> TurnEnd:
    """The turn's end as the driver left it: ``failed`` with a one-line error when it
    raised (``cancelled`` if a cancel had been handed to it), else ``completed`` (or
    ``cancelled`` once a cancel reached the worker) with its final text."""
    usage = dict(state.usage) or None
    if error is not None:
        return TurnEnd(
            turn=run.turn,
            outcome="cancelled" if state.cancel_delivered else "failed",
            error=_describe(error),
            usage=usage,
        )
    if final is not None and not isinstance(final, str):
        final = str(final)
    return TurnEnd(
        turn=run.turn,
        outcome="cancelled" if state.cancel_event.is_set() else "completed",
        final=final,
        usage=usage,
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TetherError):
        return f"{type(exc).__name__} ({exc.code}): {exc.message}"
    return f"{type(exc).__name__}: {exc}"
