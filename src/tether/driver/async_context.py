"""Async drivers: ``async def run(self, ctx)`` on the worker's event loop.

A cancel is delivered at whatever the driver awaits and reported like a boundary's
delivery; a preempt cancels the innermost tool-call await. How the reader thread hands
them to the loop: docs/design.md, section 10.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar, cast, overload

import msgspec
import structlog

from tether.driver._command import exit_waits, pidfd, read_some
from tether.driver._turn import WorkerPort, _TurnState, end_of
from tether.driver.context import BaseContext, CommandResult, _interrupt_args, _interrupted
from tether.telemetry import spans
from tether.wire.approval import Approval, Decided
from tether.wire.errors import Preempted, error_from_code
from tether.wire.frames import (
    Cancel,
    Delivered,
    Preempt,
    RunTurn,
    Steer,
    ToolCall,
    ToolFateName,
    ToolReply,
    TurnEnd,
)
from tether.wire.records import AgentInfo, Entry, Stop, StopOrigin, StopReport

__all__ = ["AsyncTurnContext", "PreemptPolicy", "run_async_turn"]

log = structlog.get_logger("tether.worker")

T = TypeVar("T")
PreemptPolicy = Literal["cooperative", "kill", "never"]


class _Call:
    """One preemptable tool-call await in flight (innermost last in ``AsyncTurnContext``)."""

    __slots__ = ("ended", "name", "never", "preempt", "shielded", "started", "task", "tool")

    def __init__(self, name: str, task: asyncio.Future[Any] | None, never: bool) -> None:
        self.name = name
        self.task = task
        self.never = never
        self.preempt: Preempt | None = None
        self.shielded = False  # a preempt hit it and, by its policy, did nothing
        self.started = time.monotonic()
        self.tool: int | None = None  # its number as an open tool; None: not (or no longer)
        self.ended: ToolFateName = "returned"  # how it ended, as far as the await saw


class AsyncTurnContext(BaseContext):
    """What an async driver's ``run(ctx)`` gets: the sync context's surface, with every
    call that waits as a coroutine.

    ``await ctx.checkpoint()`` delivers steers (semantics §5); a driver that hands them to a
    framework peeks at them (``pending_steers()``) and says when the framework took them
    (``delivered``). A cancel needs no boundary: it arrives as ``asyncio.CancelledError``
    wherever the driver awaits. Catch it (or use ``finally``) to wrap up within ``grace``
    and return the final text; ``ctx.cancel`` then says who cancelled and why.
    ``with ctx.shield():`` holds a cancel back until the block exits (grace still bounds
    the turn). Host tools (``spawn_agent`` & co) await the host's reply without blocking
    the loop.
    """

    def __init__(self, worker: WorkerPort, run: RunTurn, state: _TurnState) -> None:
        super().__init__(worker, run, state)
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[Any] | None = None
        self._waiters: dict[int, asyncio.Future[ToolReply]] = {}
        self._calls: list[_Call] = []
        self._shield = 0
        self._deferred = False  # a cancel delivered inside a shield: raised at its exit
        self._arrival: Callable[[], object] | None = None

    # ---- cancel delivery --------------------------------------------------------------

    def on_cancel_arrival(self, hook: Callable[[], object] | None) -> None:
        """Run ``hook`` in the worker's reader thread the moment this turn's cancel
        arrives, before the loop (which may be busy) raises it in the driver's task: for
        a step a stop must not wait for, such as shutting a model connection's socket.
        It must be quick, thread-safe and touch nothing of the loop's; what it raises is
        logged and dropped. ``None`` removes it. Not run for a cancel issued before the
        turn started (that one is raised at the driver's first await)."""
        self._arrival = hook

    def _arrived(self) -> None:
        """In the reader thread: the cancel's arrival hook, then its delivery on the loop."""
        hook = self._arrival
        if hook is not None:
            try:
                hook()
            except Exception:  # a driver's hook never takes the reader thread down
                log.exception("driver.cancel_hook_failed", turn=self.turn)
        self._loop.call_soon_threadsafe(self._deliver)

    @property
    def cancel(self) -> Cancel | None:
        """The cancel handed to this turn (reason, origin, by), once it was delivered."""
        st = self._state
        with st.lock:
            return st.cancel if st.cancel_delivered else None

    def _deliver(self) -> None:
        """On the loop: hand a pending cancel over, unless the deadline's escalation or a
        natural end came first. Idempotent: scheduled from both threads."""
        st = self._state
        task = self._task
        with st.lock:
            if (
                st.cancel is None
                or st.cancel_delivered
                or st.escalating
                or task is None
                or task.done()
            ):
                return
            st.cancel_delivered = True
        held = self._shield > 0
        self._worker.send(
            Delivered(turn=self.turn, steers=[], cancel=True, via="cancel-at-await", held=held)
        )
        if held:
            self._deferred = True
        else:
            task.cancel()

    @contextlib.contextmanager
    def shield(self) -> Iterator[None]:
        """Hold a cancel back while the block runs (a commit, a migration): it is raised
        at the first await after the block. The host still force-breaks the turn when
        the block outlasts ``grace`` (counted from the cancel's arrival)."""
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1
            if not self._shield and self._deferred and self._task is not None:
                self._deferred = False
                # the cancel takes effect only now: the host's stop report says so
                self._worker.send(
                    Delivered(turn=self.turn, steers=[], cancel=True, via="cancel-at-await")
                )
                self._task.cancel()

    async def checkpoint(self) -> list[Steer | Cancel]:
        """A boundary: the steers pending, in order; ``[Cancel]`` once a cancel was handed
        over (inside a shield, or after the driver caught it). A pending cancel is raised
        here if it was not already."""
        st = self._state
        self._progress()
        self._deliver()
        await asyncio.sleep(0)  # a cancel just handed over is raised here
        with st.lock:
            if st.cancel is not None:
                return [st.cancel] if st.cancel_delivered else []
            steers, st.steers = st.steers, []
        if steers:
            self._worker.send(Delivered(turn=self.turn, steers=steers))
        return list(steers)

    def pending_steers(self) -> list[Steer]:
        """The steers waiting for this turn, in order, left where they are: for a driver
        that hands a steer to its framework as soon as it arrives and says when the
        framework took it (``delivered``). Not a boundary, so no progress for the stall
        watchdog: polling it does not hide a stalled turn. Empty once a cancel is in
        (the cancel discards them)."""
        st = self._state
        with st.lock:
            return [] if st.cancel is not None else list(st.steers)

    def delivered(self, steers: Iterable[Steer]) -> list[Steer]:
        """The framework took these steers (from ``pending_steers``) just now: they stop
        being pending and the host writes their ``steered`` markers here, in the
        transcript's order. Returns those that were still pending (none once a cancel
        discarded them; a steer already delivered is not delivered twice)."""
        st = self._state
        wanted = list(steers)
        with st.lock:
            if st.cancel is not None:
                return []
            taken = [s for s in st.steers if any(s is w for w in wanted)]
            st.steers = [s for s in st.steers if all(s is not t for t in taken)]
        if taken:
            self._progress()  # the framework's request boundary
            self._worker.send(Delivered(turn=self.turn, steers=taken))
        return taken

    # ---- host calls -------------------------------------------------------------------

    def _on_reply(self, reply: ToolReply) -> bool:
        """Reader thread, under the turn's lock: route a reply to its waiting future."""
        fut = self._waiters.pop(reply.call, None)
        if fut is None:
            return False  # a blocking call (``history``), or one abandoned by a cancel
        self._loop.call_soon_threadsafe(_resolve, fut, reply)
        return True

    async def _host_call(self, name: str, args: dict[str, Any]) -> Any:
        if name == "history":
            return await self._host_call_sent(name, args)
        self._progress((name, repr(sorted(args.items()))))
        with spans.tool(name, outer_only=True):
            return await self._host_call_sent(name, args)

    async def _host_call_sent(self, name: str, args: dict[str, Any]) -> Any:
        self._next_call += 1
        call = self._next_call
        st = self._state
        fut: asyncio.Future[ToolReply] = self._loop.create_future()
        with st.lock:
            self._waiters[call] = fut
        try:
            tp = spans.traceparent()
            self._worker.send(ToolCall(turn=self.turn, call=call, name=name, args=args, trace=tp))
            reply = await fut
        finally:
            with st.lock:
                self._waiters.pop(call, None)
        if reply.code is not None:
            raise error_from_code(reply.code, reply.message or reply.code)
        return reply.result

    async def load_history(self) -> list[Entry]:
        """``ctx.history`` without blocking the loop (the property fetches synchronously)."""
        if self._history is None:
            history: list[Entry] = []
            while True:
                after = history[-1].seq if history else 0
                raw = await self._host_call("history", {"after": after})
                page = msgspec.convert(raw["entries"], list[Entry])
                history.extend(page)
                if not raw["more"] or not page:
                    break
            self._history = history
        return self._history

    async def load_turn(self) -> list[Entry]:
        """This turn's own entries recorded so far: on a recovered turn (``recovered``),
        the steps kept from before the crash."""
        return [e for e in await self.load_history() if e.turn == self.turn]

    async def begin_call(
        self, name: str, arguments: str = "", tool_call_id: str | None = None
    ) -> str:
        """Write this tool call's start, durably, before the tool runs; returns its call
        key (semantics §17.1). A crash before its result is recorded makes it unknown."""
        args = self._begin_args(name, arguments, tool_call_id)
        return str(await self._host_call_sent("begin_call", args))

    async def ask_approval(
        self,
        name: str,
        arguments: str = "",
        tool_call_id: str | None = None,
        *,
        schema: dict[str, Any] | None = None,
        timeout: float | None = None,
        approver: str = "any",
    ) -> Decided:
        """Ask for this tool call to be approved, and wait for the decision (semantics
        §17.2), holding no worker slot meanwhile. Approved: its start is durable, as
        ``begin_call``'s, and the answer carries its key and the arguments to run it with
        (edited ones checked against ``schema``); else the text the model reads."""
        args = self._begin_args(name, arguments, tool_call_id)
        args["approval"] = {"timeout": timeout, "approver": approver, "schema": schema}
        return msgspec.convert(await self._host_call_sent("begin_call", args), Decided)

    async def spawn_agent(
        self,
        *,
        slug: str | None = None,
        mode: str = "continuable",
        prompt: str | None = None,
        data: dict[str, Any] | None = None,
        permissions: dict[str, str] | None = None,
        budget: dict[str, Any] | None = None,
        on_crash: str | None = None,
    ) -> str:
        """Spawn a child running this session's own driver and config."""
        args = {
            "slug": slug,
            "mode": mode,
            "prompt": prompt,
            "data": data,
            "permissions": permissions,
            "budget": budget,
            "on_crash": on_crash,
            "call": self._spawn_call(),
        }
        return str(await self._host_call("spawn_agent", args))

    async def budget(self) -> dict[str, Any]:
        """What this session's tree may still spend (semantics §16.2): ``left`` (the least
        each budget on it or above has left, per limit), ``spent``, ``state``."""
        result: dict[str, Any] = await self._host_call("budget", {})
        return result

    async def send_message(
        self, to: str, text: str, *, data: dict[str, Any] | None = None, wake: bool = True
    ) -> str:
        """Send to a direct child (id or slug); returns the new message's id."""
        args = {"to": to, "text": text, "data": data, "wake": wake}
        return str(await self._host_call("send_message", args))

    async def list_agents(self, *, scope: str = "children") -> list[AgentInfo]:
        raw = await self._host_call("list_agents", {"scope": scope})
        return msgspec.convert(raw, list[AgentInfo])

    @overload
    async def interrupt_agent(
        self,
        agent_id: str,
        *,
        kind: str = ...,
        reason: str = ...,
        scope: Literal["session"] = ...,
    ) -> str | None: ...

    @overload
    async def interrupt_agent(
        self, agent_id: str, *, kind: str = ..., reason: str = ..., scope: Literal["subtree"]
    ) -> list[str]: ...

    async def interrupt_agent(
        self, agent_id: str, *, kind: str = "cancel", reason: str = "", scope: str = "session"
    ) -> str | list[str] | None:
        """Interrupt an agent below; the turn it was bound to, or None (a no-op). With
        ``scope="subtree"`` (cancel or abort): the turns stopped."""
        args = _interrupt_args(agent_id, kind, reason, scope)
        return _interrupted(scope, await self._host_call("interrupt_agent", args))

    async def stop_report(self, turn: str) -> StopReport | None:
        """What a stop did to ``turn`` (of this session or one below), or None."""
        raw = await self._host_call("stop_report", {"turn": turn})
        return None if raw is None else msgspec.convert(raw, StopReport)

    async def pause_agent(
        self, agent_id: str, *, scope: str = "session", reason: str = ""
    ) -> list[str]:
        args = {"agent_id": agent_id, "scope": scope, "reason": reason}
        return [str(t) for t in await self._host_call("pause_agent", args)]

    async def resume_agent(self, agent_id: str, *, scope: str = "session") -> list[str]:
        args = {"agent_id": agent_id, "scope": scope}
        return [str(t) for t in await self._host_call("resume_agent", args)]

    async def list_approvals(self) -> list[Approval]:
        """The pending approvals of the sessions below this one, oldest first (semantics
        §17.2)."""
        raw = await self._host_call("list_approvals", {})
        return msgspec.convert(raw, list[Approval])

    async def decide_approval(
        self,
        approval: str,
        decision: str = "approve",
        *,
        reason: str = "",
        arguments: dict[str, Any] | None = None,
    ) -> Approval:
        """Decide a pending approval of a session below this one, as its ancestor."""
        args = {
            "approval": approval,
            "decision": decision,
            "reason": reason,
            "arguments": arguments,
        }
        return msgspec.convert(await self._host_call("decide_approval", args), Approval)

    # ---- tools ------------------------------------------------------------------------

    async def run_command(
        self, argv: list[str], *, timeout: float | None = None, cwd: str | None = None
    ) -> CommandResult:
        """Run a subprocess in this worker's process group, as the sync ``run_command``
        does: it returns when the command exits, whatever the command leaves running is
        killed, a preempt kills its tree (``Preempted`` here, with its partial output).
        A cancel of the turn kills the command and raises ``CancelledError`` here.
        Other children of the worker (a tool server's process, a command awaited
        alongside) are not its leftovers and stay.
        """
        with spans.tool("run_command", outer_only=True):
            return await self._run_command(argv, timeout, cwd)

    async def _run_command(
        self, argv: list[str], timeout: float | None, cwd: str | None
    ) -> CommandResult:
        cmd = self._start_command(argv, cwd)
        st = self._state
        try:
            await _exited(cmd.proc, cmd.bufs, timeout, self._worker.kill_command)
        except BaseException:
            # the turn was cancelled: the command goes with it
            self._worker.kill_command(cmd.proc)
            st.tool_closed(cmd.tool, "cancelled")
            raise
        finally:
            if cmd.proc.poll() is None:
                cmd.proc.wait()  # killed just above: its exit is immediate
            with st.spawn_lock:
                with st.lock:
                    preempt = st.tools.pop(cmd.proc, None)
                    st.progress.in_tool = bool(st.tools) or bool(st.starting)
                # Its own tag, as for the sync run_command: its clean-up kills the orphans
                # that carry it, and only those, so a tool server the driver keeps (a child
                # of this worker too) and commands awaited alongside it are never taken
                # for leftovers.
                self._worker.kill_leftovers(cmd.tag)
            self._drained(cmd)
        return self._command_result(cmd, preempt)

    async def call_tool(self, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
        """Validate a model's call of a host tool and run it; errors come back as
        ``{"error": ...}``, except a preempt, which raises ``Preempted`` here."""
        from tether.driver import tools

        # run_command reports its own open call (as the sync one does)
        track = name != "run_command"
        return await self.preemptable(name, tools.acall_tool(self, name, arguments), track=track)

    async def preemptable(
        self,
        name: str,
        awaitable: Awaitable[T],
        *,
        preempt: PreemptPolicy = "cooperative",
        track: bool = True,
        fate: Callable[[], str | None] | None = None,
    ) -> T:
        """Await a tool call of your own (an MCP call, an HTTP request) as the innermost
        preemptable one: a preempt cancels it (the awaitable gets ``CancelledError`` and
        may clean up) and raises ``Preempted`` here, and the host writes the marker.
        ``preempt="never"``: a preempt is a no-op (reported ``shielded``) and a cancel of
        the turn waits for the call (it runs inside ``shield()``); abort still kills.
        The call is reported to the host as an open tool (stop reports, semantics §15.6)
        unless ``track=False`` (a caller that reports it itself); ``fate``, when given,
        says how a call stopped by the turn's cancel or by its own limit really ended
        (``cancelled``, ``abandoned``, ``killed``: what only the tool's client knows)."""
        st = self._state
        me = asyncio.current_task()
        base = me.cancelling() if me is not None else 0
        never = preempt == "never"
        inner = None if never else asyncio.ensure_future(awaitable)
        call = _Call(name, inner, never)
        self._calls.append(call)
        st.progress.in_tool = True
        self._progress((name, ""))
        call.tool = st.tool_opened(name) if track else None
        try:
            if inner is None:
                return await self._shielded_call(call, awaitable)
            return await self._cancellable_call(call, inner, me, base)
        finally:
            self._calls.remove(call)
            if call.tool is not None:
                ended = call.ended
                st.tool_closed(call.tool, ended if ended == "shielded" else _known(fate, ended))
            st.progress.in_tool = any(not c.never for c in self._calls)
            self._progress()

    async def _shielded_call(self, call: _Call, awaitable: Awaitable[T]) -> T:
        """A ``preempt="never"`` call: inside ``shield()``; a preempt that hit it did nothing."""
        with self.shield():
            result: T = await awaitable
        if call.shielded:
            call.ended = "shielded"
        return result

    async def _cancellable_call(
        self, call: _Call, inner: asyncio.Future[T], me: asyncio.Task[Any] | None, base: int
    ) -> T:
        """Await a preemptable call's own task: a preempt that cancelled it raises
        ``Preempted``, unless the turn (``me``, past ``base`` cancels) is cancelled too."""
        try:
            result = await inner
        except asyncio.CancelledError:
            call.ended = "cancelled"
            if call.preempt is not None and inner.cancelled():
                error = self._call_preempted(call, call.preempt)
                if not _cancelling(me, base):
                    raise error from None  # only the tool was stopped: the turn goes on
            raise
        except BaseException:
            call.ended = "returned"  # it ended on its own, with an error (or a limit's stop)
            raise
        if _cancelling(me, base):
            # the call swallowed the turn's cancel on its way through: re-raise it
            raise asyncio.CancelledError
        return result

    def _call_preempted(self, call: _Call, frame: Preempt) -> Preempted:
        """The ``Preempted`` of a call a preempt cancelled, its tool closed first (before
        ToolKilled: its report lists it)."""
        if call.tool is not None:
            self._state.tool_closed(call.tool, "preempted")
            call.tool = None
        return self._preempted(frame, call.name, call.started, via="cancel-at-await")

    def report_preempt(
        self,
        tool: str,
        reason: str,
        *,
        started: float,
        partial: str = "",
        origin: StopOrigin = "system",
        by: str = "policy",
    ) -> Preempted:
        """A tool call you stopped yourself by its policy (an MCP call past its
        ``max_duration``): the host writes the ``preempted`` marker and a stop report as
        for any preempt; returns the ``Preempted`` to describe it (``started`` is the
        call's ``time.monotonic()`` start)."""
        frame = Preempt(self.turn, Stop("preempt", origin, by, reason))
        return self._preempted(frame, tool, started, partial.encode(), via="cancel-at-await")

    def preempt_now(self, frame: Preempt) -> None:
        """Preempt this turn's innermost tool from inside the worker, on the loop: what a
        host's preempt does (kill a running command, or stop the innermost call), for a
        tool policy's own limits (``max_duration``: origin ``system``)."""
        victims, busy = self._state.preempt_commands(frame)
        for p in victims:
            self._worker.kill_command(p)
        if not busy:
            self._on_preempt(frame)

    def _on_preempt(self, frame: Preempt) -> None:
        """On the loop: a preempt with no command running stops the innermost call."""
        st = self._state
        with st.lock:
            if st.tools or st.starting:
                return  # a command started meanwhile: the reader killed it
        if not self._calls:
            return  # nothing to stop: an accepted no-op
        call = self._calls[-1]
        if call.never:
            # a no-op: no marker; the call's stop-report fate says ``shielded``
            call.shielded = True
            log.info("preempt.shielded", turn=self.turn, tool=call.name)
            return
        if call.preempt is None and call.task is not None and not call.task.done():
            call.preempt = frame
            call.task.cancel()


_FATES: frozenset[str] = frozenset(
    ("returned", "preempted", "cancelled", "abandoned", "killed", "shielded")
)


def _known(fate: Callable[[], str | None] | None, default: ToolFateName) -> ToolFateName:
    """The tool client's own word on how a stopped call ended, if it has one."""
    if fate is None:
        return default
    said = fate()
    return cast(ToolFateName, said) if said in _FATES else default


def _cancelling(me: asyncio.Task[Any] | None, base: int) -> bool:
    """The task ``me`` has a cancel pending beyond the ``base`` it had at the start."""
    return me is not None and me.cancelling() > base


def _resolve(fut: asyncio.Future[ToolReply], reply: ToolReply) -> None:
    if not fut.done():
        fut.set_result(reply)


async def _exited(
    proc: subprocess.Popen[bytes],
    bufs: dict[int, bytearray],
    timeout: float | None,
    kill: Callable[[subprocess.Popen[bytes]], None],
) -> None:
    """Collect the command's output until the command itself exits (or times out), on the
    loop: readers for its pipes and for its pidfd (readable once it exits)."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    watched: list[int] = []

    def readable(fd: int) -> None:
        if not read_some(fd, bufs[fd]):
            loop.remove_reader(fd)  # end of that pipe

    def exited() -> None:
        if not gone.done():
            gone.set_result(None)

    exit_fd = pidfd(proc.pid)
    try:
        for fd in bufs:
            os.set_blocking(fd, False)
            loop.add_reader(fd, readable, fd)
            watched.append(fd)
        if exit_fd is not None:
            loop.add_reader(exit_fd, exited)
            watched.append(exit_fd)
        deadline = None if timeout is None else time.monotonic() + timeout
        for wait in exit_waits(proc, deadline, exit_fd, kill):
            await asyncio.wait([gone], timeout=wait)
    finally:
        for fd in watched:
            loop.remove_reader(fd)
        if exit_fd is not None:
            os.close(exit_fd)


def run_async_turn(worker: WorkerPort, run: RunTurn, state: _TurnState, cls: type[Any]) -> TurnEnd:
    """Run one async driver turn on the worker's loop; the turn's end as the driver left it
    (a cancel that unwound the driver ends it ``cancelled``)."""
    loop = worker.event_loop()

    async def main() -> Any:
        ctx = AsyncTurnContext(worker, run, state)
        ctx._task = asyncio.current_task()
        driver = cls()

        def on_preempt(frame: Preempt) -> None:
            loop.call_soon_threadsafe(ctx._on_preempt, frame)

        with state.lock:
            state.on_cancel = ctx._arrived
            state.on_preempt = on_preempt
            state.on_reply = ctx._on_reply
            held = state.cancel is not None
        if held:  # issued before the turn started: raised at the driver's first await
            loop.call_soon(ctx._deliver)
        return await driver.run(ctx)

    try:
        final = loop.run_until_complete(main())
    except asyncio.CancelledError:
        _settle(loop)
        if state.cancel_delivered:
            return end_of(run, state)
        return end_of(run, state, error=RuntimeError("the driver's task was cancelled"))
    except Exception as exc:  # a driver's failure ends its turn, never the worker
        _settle(loop)
        return end_of(run, state, error=exc)
    finally:
        with state.lock:
            state.on_cancel = state.on_preempt = state.on_reply = None
    _settle(loop)
    return end_of(run, state, final=final)


def _settle(loop: asyncio.AbstractEventLoop) -> None:
    """Run what the turn left ready on the loop before its end is reported: a transport
    closed in the driver's last steps closes its socket in a callback (asyncio's
    ``connection_lost``), and a cancelled stream's connection must be gone before the
    turn's end is recorded, not at the worker's next turn."""
    loop.run_until_complete(_ticks(3))


async def _ticks(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)
