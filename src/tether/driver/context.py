"""The context a sync driver's ``run(self, ctx)`` gets (``TurnContext``), what every
context has (``BaseContext``, shared with ``AsyncTurnContext``), and ``CommandResult``.

A context talks to its host through the worker (``WorkerPort``): ``say`` and the
boundaries' deliveries are frames; a tool call (``spawn_agent`` & co) is a frame answered
by the host, matched by call number; ``run_command`` runs in this worker's process group.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping
from typing import IO, Any, Literal, overload

import msgspec

from tether.driver._command import check_command, drain, wait_exit
from tether.driver._turn import WorkerPort, _TurnState
from tether.driver.calls import current_call_id
from tether.telemetry import spans
from tether.wire.approval import Approval
from tether.wire.budget import cost_microusd, merge_usage
from tether.wire.errors import Preempted, error_from_code
from tether.wire.frames import (
    Cancel,
    Delivered,
    Preempt,
    Progress,
    RunTurn,
    Say,
    Steer,
    ToolCall,
    ToolKilled,
    Usage,
)
from tether.wire.records import AgentInfo, Entry, Message, Recovered, StopReport, Via

__all__ = ["BaseContext", "CommandResult", "TurnContext"]

_PARTIAL_CAP = 4000  # characters of a preempted tool's output kept for the driver


class CommandResult(msgspec.Struct, frozen=True):
    returncode: int
    stdout: str
    stderr: str


def _interrupt_args(agent_id: str, kind: str, reason: str, scope: str) -> dict[str, Any]:
    """``interrupt_agent``'s host call, sync or async: ``scope`` only when not the default."""
    args = {"agent_id": agent_id, "kind": kind, "reason": reason}
    if scope != "session":
        args["scope"] = scope
    return args


def _interrupted(scope: str, result: Any) -> str | list[str] | None:
    """What ``interrupt_agent`` returns for its host call's ``result``: the turns stopped
    (a subtree), else the turn the stop was bound to, or None (a no-op)."""
    if scope != "session":
        return [str(t) for t in result]
    return None if result is None else str(result)


class _Command:
    """A ``run_command`` in flight, sync or async: its process, its tool call and its tag
    (``_TurnState.start_command``), and what it has written so far."""

    __slots__ = ("bufs", "err", "out", "pipes", "proc", "started", "tag", "tool")

    def __init__(self, proc: subprocess.Popen[bytes], tool: int, tag: str) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc, self.tool, self.tag = proc, tool, tag
        self.pipes: tuple[IO[bytes], IO[bytes]] = (proc.stdout, proc.stderr)
        self.out, self.err = bytearray(), bytearray()
        self.started = time.monotonic()
        self.bufs = {proc.stdout.fileno(): self.out, proc.stderr.fileno(): self.err}


class BaseContext:
    """What every driver's context has, sync or async: the turn's identity, its message
    and config, ``say``, ``cancel_requested``, progress and usage reports."""

    def __init__(self, worker: WorkerPort, run: RunTurn, state: _TurnState) -> None:
        self._worker = worker
        self._state = state
        self._history: list[Entry] | None = None
        self._next_call = 0
        self._spawns: dict[str, int] = {}  # call key -> spawns made under it so far
        self.session = run.session
        self.turn = run.turn
        self.message: Message = run.message
        # Set when a crash interrupted this turn and it runs on from its last step
        # (semantics §17.1); None on a fresh turn.
        self.recovered: Recovered | None = run.recovered
        self.config: dict[str, Any] = dict(run.config or {})
        self.permissions: dict[str, str] = dict(run.permissions or {})
        model = self.config.get("model")
        price = model.get("price") if isinstance(model, dict) else None
        self._price: dict[str, Any] | None = price if isinstance(price, dict) else None

    @property
    def cancel_requested(self) -> bool:
        """True as soon as a cancel for this turn reached the worker (before any boundary)."""
        return self._state.cancel_event.is_set()

    def _progress(self, call: tuple[str, str] | None = None) -> None:
        meter = self._state.progress
        if meter.note(call):
            self._worker.send(Progress(turn=self.turn, in_tool=meter.in_tool))

    def progress(self) -> None:
        """Report progress to the stall watchdog (semantics §14.5) without a boundary, e.g. for
        each streamed chunk of a model reply. Rate-limited: call it as often as you like."""
        self._progress()

    def add_usage(self, usage: Mapping[str, int | bool]) -> None:
        """Add one model response's token counts (``{"prompt_tokens": 12,
        "completion_tokens": 30}``, and ``cost_microusd`` where a framework reports a
        cost) to the turn's ``TurnRecord.usage``; ``"estimated": True`` where a count is
        an estimate (a cut reply's, semantics §15.2). Sent to the host at once, for the
        tree's budget (semantics §16.2); with ``model.price`` in the config, the tokens'
        cost is added as ``cost_microusd``. A response whose reply is said at once can
        bring its usage with it instead: ``say(text, usage=...)``, one frame, not two."""
        delta = self._counted(usage)
        if delta:
            self._worker.send(Usage(turn=self.turn, usage=delta))

    def _counted(self, usage: Mapping[str, int | bool]) -> dict[str, int | bool] | None:
        """``usage``'s non-zero counts, priced, added to the turn's total: the delta
        to send (None when nothing counts; the ``estimated`` flag alone is nothing)."""
        delta: dict[str, int | bool] = {
            key: value
            for key, value in usage.items()
            if isinstance(value, int) and not isinstance(value, bool) and value
        }
        price = self._price
        if price is not None and "cost_microusd" not in delta:
            prompt, completion = delta.get("prompt_tokens", 0), delta.get("completion_tokens", 0)
            if prompt or completion:
                cost = cost_microusd(price, prompt, completion)
                if cost:
                    delta["cost_microusd"] = cost
        if not delta:
            return None
        if usage.get("estimated") is True:
            delta["estimated"] = True
        merge_usage(self._state.usage, delta)
        return delta

    def say(
        self,
        text: str,
        *,
        data: dict[str, Any] | None = None,
        usage: Mapping[str, int | bool] | None = None,
    ) -> None:
        """Append an assistant entry to the transcript; with ``usage``, the model
        response it is the reply of is counted as ``add_usage`` counts it, in the same
        frame (a budget sees it as the reply is said)."""
        delta = None if usage is None else self._counted(usage)
        self._worker.send(Say(turn=self.turn, kind="assistant", text=text, data=data, usage=delta))
        if spans.content():  # the turn span's reply, when the driver returns none
            spans.said(text)
        self._progress()

    def record_tool(self, text: str, *, data: dict[str, Any] | None = None) -> None:
        """Append a ``tool`` entry (a tool call's visible result) to the transcript."""
        self._worker.send(Say(turn=self.turn, kind="tool", text=text, data=data))

    def _host_call_blocking(self, name: str, args: dict[str, Any]) -> Any:
        if name == "history":
            return self._blocking_call(name, args)
        self._progress((name, repr(sorted(args.items()))))
        with spans.tool(name, outer_only=True):
            return self._blocking_call(name, args)

    def _blocking_call(self, name: str, args: dict[str, Any]) -> Any:
        # Never overridden: the async context's ``history`` property blocks through it
        # too (its own ``_host_call_sent`` is a coroutine).
        self._next_call += 1
        call = self._next_call
        st = self._state
        frame = ToolCall(turn=self.turn, call=call, name=name, args=args, trace=spans.traceparent())
        self._worker.send(frame)
        with st.lock:
            while call not in st.replies:
                st.reply_ready.wait()
            reply = st.replies.pop(call)
        if reply.code is not None:
            raise error_from_code(reply.code, reply.message or reply.code)
        return reply.result

    def _preempted(
        self,
        preempt: Preempt,
        tool: str,
        started: float,
        out: bytes | bytearray = b"",
        err: bytes | bytearray = b"",
        *,
        via: Via = "walk",
    ) -> Preempted:
        """Report a preempt that took effect (the host writes its marker) and build the
        error the driver sees, with what the tool wrote until then."""
        self._worker.send(ToolKilled(turn=self.turn, stop=preempt.stop, via=via))
        stop = preempt.stop
        partial = (out.decode(errors="replace") + err.decode(errors="replace"))[-_PARTIAL_CAP:]
        return Preempted(
            stop.reason or f"{tool} was preempted",
            origin=stop.origin,
            by=stop.by,
            reason=stop.reason,
            elapsed=time.monotonic() - started,
            partial=partial,
        )

    # ---- run_command, the steps the sync and the async one share --------------------

    def _start_command(self, argv: list[str], cwd: str | None) -> _Command:
        """Check the command, note it as progress inside a tool, and start it."""
        check_command(self.permissions, argv)
        st = self._state
        st.progress.in_tool = True
        self._progress(("run_command", repr((argv, cwd))))
        return _Command(*st.start_command(argv, cwd))

    def _drained(self, cmd: _Command) -> None:
        """Once the command has exited and its clean-up is done: nothing writes any more,
        so read what is left in its pipes, and close them."""
        for fd, buf in cmd.bufs.items():
            drain(fd, buf)
        for pipe in cmd.pipes:
            pipe.close()
        self._progress()

    def _command_result(self, cmd: _Command, preempt: Preempt | None) -> CommandResult:
        """The command's result, or ``Preempted`` if the preempt that marked it killed it."""
        # A preempt that raced the command's own exit killed nothing: the command
        # completed, and no ToolKilled (no "preempted" marker) may say otherwise.
        preempted = preempt is not None and cmd.proc.returncode == -signal.SIGKILL
        self._state.tool_closed(cmd.tool, "preempted" if preempted else "returned")
        if preempt is not None and preempted:
            raise self._preempted(preempt, "run_command", cmd.started, cmd.out, cmd.err)
        return CommandResult(
            returncode=cmd.proc.returncode,
            stdout=cmd.out.decode(errors="replace"),
            stderr=cmd.err.decode(errors="replace"),
        )

    def _fetch_history(self) -> list[Entry]:
        # Page by page, each bounded by count and by size on the host: a long
        # transcript, or one of huge entries, never has to fit in one frame.
        history: list[Entry] = []
        while True:
            after = history[-1].seq if history else 0
            raw = self._host_call_blocking("history", {"after": after})
            page = msgspec.convert(raw["entries"], list[Entry])
            history.extend(page)
            if not raw["more"] or not page:
                return history

    @property
    def history(self) -> list[Entry]:
        """The session's transcript before this turn's own entries; fetched on first use."""
        if self._history is None:
            self._history = self._fetch_history()
        return self._history

    def _spawn_call(self) -> str | None:
        """The spawn's key inside a tool call (``<call key>/<n>``: its n-th spawn; None
        outside one): the call re-issued after a crash with the same key, in the same
        order, gets the children it made instead of new ones (semantics §17.1)."""
        key = current_call_id()
        if key is None:
            return None
        n = self._spawns[key] = self._spawns.get(key, 0) + 1
        return f"{key}/{n}"

    @staticmethod
    def _begin_args(name: str, arguments: str, tool_call_id: str | None) -> dict[str, Any]:
        args: dict[str, Any] = {"name": name, "arguments": arguments}
        if tool_call_id is not None:
            args["tool_call_id"] = tool_call_id
        return args


class TurnContext(BaseContext):
    """What a sync driver's ``run(ctx)`` gets. Tool calls go to the host, bound to this
    session, and block until the host answers."""

    # ---- boundaries -----------------------------------------------------------------

    def checkpoint(self) -> list[Steer | Cancel]:
        """The frames delivered at this boundary: pending steers in order, then a cancel."""
        st = self._state
        self._progress()
        with st.lock:
            if st.cancel is not None:
                if st.cancel_delivered:
                    return [st.cancel]
                if st.escalating:
                    return []  # the turn is being killed: its deadline passed first
                st.cancel_delivered = True
                frames: list[Steer | Cancel] = [st.cancel]
                self._worker.send(Delivered(turn=self.turn, steers=[], cancel=True))
                return frames
            steers, st.steers = st.steers, []
        if steers:
            self._worker.send(Delivered(turn=self.turn, steers=steers))
        return list(steers)

    # ---- tools ----------------------------------------------------------------------

    def _host_call(self, name: str, args: dict[str, Any]) -> Any:
        return self._host_call_blocking(name, args)

    def spawn_agent(
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
        """Spawn a child running this session's own driver and config (the host chooses
        what loads code); ``permissions`` can only narrow this session's own."""
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
        return str(self._host_call("spawn_agent", args))

    def send_message(
        self, to: str, text: str, *, data: dict[str, Any] | None = None, wake: bool = True
    ) -> str:
        """Send to a direct child (id or slug); returns the new message's id."""
        args = {"to": to, "text": text, "data": data, "wake": wake}
        return str(self._host_call("send_message", args))

    def list_agents(self, *, scope: str = "children") -> list[AgentInfo]:
        raw = self._host_call("list_agents", {"scope": scope})
        return msgspec.convert(raw, list[AgentInfo])

    @overload
    def interrupt_agent(
        self,
        agent_id: str,
        *,
        kind: str = ...,
        reason: str = ...,
        scope: Literal["session"] = ...,
    ) -> str | None: ...

    @overload
    def interrupt_agent(
        self, agent_id: str, *, kind: str = ..., reason: str = ..., scope: Literal["subtree"]
    ) -> list[str]: ...

    def interrupt_agent(
        self, agent_id: str, *, kind: str = "cancel", reason: str = "", scope: str = "session"
    ) -> str | list[str] | None:
        """Interrupt an agent below; the turn it was bound to, or None (a no-op). With
        ``scope="subtree"`` (cancel or abort), that agent and every one below it: the
        list of the turns stopped."""
        args = _interrupt_args(agent_id, kind, reason, scope)
        return _interrupted(scope, self._host_call("interrupt_agent", args))

    def budget(self) -> dict[str, Any]:
        """What this session's tree may still spend (semantics §16.2): ``left`` (the least
        each budget on it or above has left, per limit), ``spent``, ``state``."""
        result: dict[str, Any] = self._host_call("budget", {})
        return result

    def stop_report(self, turn: str) -> StopReport | None:
        """What a stop did to ``turn`` (a turn of this session or of one below it), or
        None when no stop reached it (semantics §15.6)."""
        raw = self._host_call("stop_report", {"turn": turn})
        return None if raw is None else msgspec.convert(raw, StopReport)

    def pause_agent(self, agent_id: str, *, scope: str = "session", reason: str = "") -> list[str]:
        """Freeze an agent below (``subtree``: and its running descendants) in place;
        the turns frozen, ``[]`` when nothing was running (semantics §14.4)."""
        args = {"agent_id": agent_id, "scope": scope, "reason": reason}
        return [str(t) for t in self._host_call("pause_agent", args)]

    def resume_agent(self, agent_id: str, *, scope: str = "session") -> list[str]:
        """Thaw what ``pause_agent`` froze; the turns resumed."""
        args = {"agent_id": agent_id, "scope": scope}
        return [str(t) for t in self._host_call("resume_agent", args)]

    def list_approvals(self) -> list[Approval]:
        """The pending approvals of the sessions below this one, oldest first (semantics
        §17.2)."""
        raw = self._host_call("list_approvals", {})
        return msgspec.convert(raw, list[Approval])

    def decide_approval(
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
        return msgspec.convert(self._host_call("decide_approval", args), Approval)

    def run_command(
        self, argv: list[str], *, timeout: float | None = None, cwd: str | None = None
    ) -> CommandResult:
        """Run a subprocess in this worker's process group; preemptable and abortable.

        Whatever the command leaves running when it returns is killed with it, and only
        that: commands run at once from several threads never touch each other's.
        """
        with spans.tool("run_command", outer_only=True):
            return self._run_command(argv, timeout, cwd)

    def _run_command(
        self, argv: list[str], timeout: float | None, cwd: str | None
    ) -> CommandResult:
        cmd = self._start_command(argv, cwd)
        st = self._state
        try:
            wait_exit(cmd.proc, cmd.bufs, timeout, self._worker.kill_command)
        finally:
            # From here a preempt finds no command to kill: it is an accepted no-op.
            with st.spawn_lock:
                with st.lock:
                    preempt = st.tools.pop(cmd.proc, None)
                    last = not st.tools and st.starting == 0
                    st.progress.in_tool = not last
                self._worker.kill_leftovers(None if last else cmd.tag)
            self._drained(cmd)
        return self._command_result(cmd, preempt)

    def begin_call(self, name: str, arguments: str = "", tool_call_id: str | None = None) -> str:
        """Write this tool call's start, durably, before the tool runs; returns its call
        key (semantics §17.1). A crash before its result is recorded makes it unknown."""
        args = self._begin_args(name, arguments, tool_call_id)
        return str(self._blocking_call("begin_call", args))

    def call_tool(self, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
        """Validate a model's tool call and run it; errors come back as ``{"error": ...}``."""
        from tether.driver import tools

        return tools.call_tool(self, name, arguments)
