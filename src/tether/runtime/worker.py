"""The worker process: a turn loop that runs one driver turn at a time.

::

    host (pool reader thread)                worker process (own session + group)
    ─────────────────────────                ───────────────────────────────────────
    RunTurn ───────────────────────────────► main thread: driver.run(ctx)
    SteerFrame / CancelFrame / Preempt ────► reader thread: queue for the next boundary,
                                               set cancel_requested, kill the tool tree
    ◄──────────────────── Say / Delivered     ctx.say(), ctx.checkpoint()
    ◄──────────────────── ToolCall            ctx.spawn_agent() & co block on ...
    ToolReply ─────────────────────────────►   ... the reply, matched by call number
    ◄──────────────────── ToolKilled          a preempt killed run_command's tree
    ◄──────────────────── Progress            boundaries, says, tool calls (rate-limited,
                                               only for a session with a stall watchdog)
    Escalate ──────────────────────────────► reader thread: the cancel is never handed
    ◄──────────────────── Escalating            over now (unless it already was)
    ◄──────────────────── TurnEnd             driver returned or raised

The reader thread never runs driver code; the main thread never reads the socket. A
frame for another turn than the current one is stale and dropped. When the channel ends
(the host died), the reader kills every descendant, escapees included (the worker is
their subreaper), and then its own process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import inspect
import itertools
import multiprocessing.forkserver
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn, overload

import msgspec

from tether.runtime._log import configure_logging
from tether.runtime._procs import TREE_ENV, carries, child_pids, kill_tree, sweep
from tether.wire.codec import Channel
from tether.wire.errors import DriverNotFound, Preempted, TetherError, error_from_code
from tether.wire.frames import (
    Cancel,
    CancelFrame,
    Delivered,
    Escalate,
    Escalating,
    HostFrame,
    Preempt,
    Probe,
    ProbeReply,
    Progress,
    Ready,
    RunTurn,
    Say,
    Shutdown,
    Steer,
    SteerFrame,
    ToolCall,
    ToolFateName,
    ToolKilled,
    ToolMark,
    ToolReply,
    TurnEnd,
)
from tether.wire.records import AgentInfo, Entry, Message, StopReport

__all__ = ["BaseContext", "CommandResult", "TurnContext", "load_driver", "worker_main"]

_PR_SET_CHILD_SUBREAPER = 36
_PARTIAL_CAP = 4000  # characters of a preempted tool's output kept for the driver
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def set_subreaper() -> bool:
    """Make this process a child subreaper (Linux); False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux)."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


_drivers: dict[str, type[Any]] = {}


def load_driver(spec: str) -> type[Any]:
    """Load ``"package.module:Class"``; DriverNotFound with the reason otherwise."""
    cls = _drivers.get(spec)
    if cls is not None:
        return cls
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise DriverNotFound(f"driver {spec!r} is not of the form 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DriverNotFound(f"driver {spec!r}: cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "run", None)):
        raise DriverNotFound(f"driver {spec!r}: {attr!r} is not a class with a run(ctx) method")
    _drivers[spec] = cls
    return cls


class CommandResult(msgspec.Struct, frozen=True):
    returncode: int
    stdout: str
    stderr: str


class _TurnState:
    """What the reader thread shares with the main thread for the current turn."""

    def __init__(self, run: RunTurn, send: Callable[[msgspec.Struct], None]) -> None:
        self.turn = run.turn
        self._send = send
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
        self.usage: dict[str, int] = {}
        # An async turn (runtime/async_context.py) hooks in here; the reader thread calls
        # each hook outside the lock (``on_reply`` inside it: it only pops a waiter and
        # schedules a callback), and the hooks hand the work to the event loop.
        self.on_cancel: Callable[[], None] | None = None
        self.on_preempt: Callable[[Preempt], None] | None = None
        self.on_reply: Callable[[ToolReply], bool] | None = None

    # ---- open tool calls, for the host's stop reports (SPEC §15.6) ---------------------

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

    def start_command(
        self, argv: list[str], cwd: str | None
    ) -> tuple[subprocess.Popen[bytes], int, str]:
        """Start one ``run_command`` (sync or async) once its progress is noted: opened
        as a tool call, tagged (its clean-up tells its orphans from another command's
        among the processes re-parented to us), and killed at once if a preempt came
        while it was starting. Returns the process, the tool call's id and the tag."""
        tool = self.tool_opened("run_command")
        tag = f"{os.getpid()}.{next(_command_ids)}"
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
                    env={**os.environ, COMMAND_ENV: tag},
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
            _kill_command(proc)
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


class BaseContext:
    """What every driver's context has, sync or async: the turn's identity, its message
    and config, ``say``, ``cancel_requested``, progress and usage reports."""

    def __init__(self, worker: _Worker, run: RunTurn, state: _TurnState) -> None:
        self._worker = worker
        self._state = state
        self._history: list[Entry] | None = None
        self._next_call = 0
        self.session = run.session
        self.turn = run.turn
        self.message: Message = run.message
        self.config: dict[str, Any] = dict(run.config or {})
        self.permissions: dict[str, str] = dict(run.permissions or {})

    @property
    def cancel_requested(self) -> bool:
        """True as soon as a cancel for this turn reached the worker (before any boundary)."""
        return self._state.cancel_event.is_set()

    def _progress(self, call: tuple[str, str] | None = None) -> None:
        meter = self._state.progress
        if meter.note(call):
            self._worker.send(Progress(turn=self.turn, in_tool=meter.in_tool))

    def progress(self) -> None:
        """Report progress to the stall watchdog (SPEC §14.5) without a boundary, e.g. for
        each streamed chunk of a model reply. Rate-limited: call it as often as you like."""
        self._progress()

    def add_usage(self, usage: Mapping[str, int]) -> None:
        """Add token counts (``{"prompt_tokens": 12, ...}``) to the turn's
        ``TurnRecord.usage``; summed over the turn, stored when it ends."""
        total = self._state.usage
        for key, value in usage.items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value

    def say(self, text: str, *, data: dict[str, Any] | None = None) -> None:
        """Append an assistant entry to the transcript."""
        self._worker.send(Say(turn=self.turn, kind="assistant", text=text, data=data))
        self._progress()

    def record_tool(self, text: str, *, data: dict[str, Any] | None = None) -> None:
        """Append a ``tool`` entry (a tool call's visible result) to the transcript."""
        self._worker.send(Say(turn=self.turn, kind="tool", text=text, data=data))

    def _host_call_blocking(self, name: str, args: dict[str, Any]) -> Any:
        if name != "history":
            self._progress((name, repr(sorted(args.items()))))
        self._next_call += 1
        call = self._next_call
        st = self._state
        self._worker.send(ToolCall(turn=self.turn, call=call, name=name, args=args))
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
        via: str = "walk",
    ) -> Preempted:
        """Report a preempt that took effect (the host writes its marker) and build the
        error the driver sees, with what the tool wrote until then."""
        self._worker.send(
            ToolKilled(
                turn=self.turn,
                reason=preempt.reason,
                origin=preempt.origin,
                by=preempt.by,
                via=via,
            )
        )
        partial = (out.decode(errors="replace") + err.decode(errors="replace"))[-_PARTIAL_CAP:]
        return Preempted(
            preempt.reason or f"{tool} was preempted",
            origin=preempt.origin,
            by=preempt.by,
            reason=preempt.reason,
            elapsed=time.monotonic() - started,
            partial=partial,
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
    ) -> str:
        """Spawn a child running this session's own driver and config (the host chooses
        what loads code); ``permissions`` can only narrow this session's own."""
        args = {
            "slug": slug,
            "mode": mode,
            "prompt": prompt,
            "data": data,
            "permissions": permissions,
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
        args = {"agent_id": agent_id, "kind": kind, "reason": reason}
        if scope != "session":
            args["scope"] = scope
            return [str(t) for t in self._host_call("interrupt_agent", args)]
        turn = self._host_call("interrupt_agent", args)
        return None if turn is None else str(turn)

    def stop_report(self, turn: str) -> StopReport | None:
        """What a stop did to ``turn`` (a turn of this session or of one below it), or
        None when no stop reached it (SPEC §15.6)."""
        raw = self._host_call("stop_report", {"turn": turn})
        return None if raw is None else msgspec.convert(raw, StopReport)

    def pause_agent(self, agent_id: str, *, scope: str = "session", reason: str = "") -> list[str]:
        """Freeze an agent below (``subtree``: and its running descendants) in place;
        the turns frozen, ``[]`` when nothing was running (SPEC §14.4)."""
        args = {"agent_id": agent_id, "scope": scope, "reason": reason}
        return [str(t) for t in self._host_call("pause_agent", args)]

    def resume_agent(self, agent_id: str, *, scope: str = "session") -> list[str]:
        """Thaw what ``pause_agent`` froze; the turns resumed."""
        args = {"agent_id": agent_id, "scope": scope}
        return [str(t) for t in self._host_call("resume_agent", args)]

    def run_command(
        self, argv: list[str], *, timeout: float | None = None, cwd: str | None = None
    ) -> CommandResult:
        """Run a subprocess in this worker's process group; preemptable and abortable.

        Whatever the command leaves running when it returns is killed with it, and only
        that: commands run at once from several threads never touch each other's.
        """
        check_command(self.permissions, argv)
        st = self._state
        st.progress.in_tool = True
        self._progress(("run_command", repr((argv, cwd))))
        proc, tool, tag = st.start_command(argv, cwd)
        assert proc.stdout is not None and proc.stderr is not None
        out, err = bytearray(), bytearray()
        started = time.monotonic()
        try:
            _wait_exit(proc, {proc.stdout.fileno(): out, proc.stderr.fileno(): err}, timeout)
        finally:
            # From here a preempt finds no command to kill: it is an accepted no-op.
            with st.spawn_lock:
                with st.lock:
                    preempt = st.tools.pop(proc, None)
                    last = not st.tools and st.starting == 0
                    st.progress.in_tool = not last
                _kill_leftovers(None if last else tag)
            _drain(proc.stdout.fileno(), out)  # nothing writes any more: read what is left
            _drain(proc.stderr.fileno(), err)
            proc.stdout.close()
            proc.stderr.close()
            self._progress()
        # A preempt that raced the command's own exit killed nothing: the command
        # completed, and no ToolKilled (no "preempted" marker) may say otherwise.
        preempted = preempt is not None and proc.returncode == -signal.SIGKILL
        st.tool_closed(tool, "preempted" if preempted else "returned")
        if preempt is not None and preempted:
            raise self._preempted(preempt, "run_command", started, out, err)
        return CommandResult(
            returncode=proc.returncode,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
        )

    def call_tool(self, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
        """Validate a model's tool call and run it; errors come back as ``{"error": ...}``."""
        from tether.runtime import tools

        return tools.call_tool(self, name, arguments)


def _wait_exit(
    proc: subprocess.Popen[bytes], bufs: dict[int, bytearray], timeout: float | None
) -> None:
    """Collect the command's output until the command itself exits (or times out).

    Not until its pipes close: a background child (``sleep 30 &``) keeps them open long
    after the command is done, and a turn waiting for that has no boundary, so neither
    cancel nor preempt could end it. What the command wrote last is read by ``_drain``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    exit_fd = _pidfd(proc.pid)
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ)  # readable once the command exits
        try:
            while proc.poll() is None:
                wait = _EXIT_POLL if exit_fd is None else None
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        _kill_command(proc)
                        proc.wait()
                        return
                    wait = left if wait is None else min(wait, left)
                for key, _ in sel.select(wait):
                    if key.fd != exit_fd and not _read_some(key.fd, bufs[key.fd]):
                        sel.unregister(key.fd)  # end of that pipe
        finally:
            if exit_fd is not None:
                os.close(exit_fd)


_EXIT_POLL = 0.05  # without pidfd_open, how often to look for the command's exit


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # an old kernel, or the command already exited and was reaped


def _read_some(fd: int, buf: bytearray) -> bool:
    """Read what is there; False at the end of the pipe."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return True
    buf += chunk
    return bool(chunk)


def _drain(fd: int, buf: bytearray) -> None:
    with contextlib.suppress(OSError):
        os.set_blocking(fd, False)
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            buf += chunk


# Set in each command's environment to a tag of its own (see ``run_command``).
COMMAND_ENV = "TETHER_COMMAND"
_command_ids = itertools.count(1)


def check_command(permissions: dict[str, str], argv: list[str]) -> None:
    """``run_command``'s input and permission, checked before anything runs."""
    if permissions.get("run_command", "allow") == "deny":
        raise error_from_code(
            "subagent-unauthorized", "run_command is denied by this session's permissions"
        )
    if not argv or not all(isinstance(a, str) for a in argv):
        raise error_from_code("invalid-params", "argv must be a non-empty list of strings")


def _kill_command(proc: subprocess.Popen[bytes]) -> None:
    """Freeze, then kill, a running command and its descendants (see ``_procs``).
    Never reaps: the command's own wait reads its status."""
    if proc.returncode is not None:
        return  # it exited and was reaped: its pid may be another's now
    with contextlib.suppress(OSError):  # out of descriptors: its clean-up retries
        kill_tree([proc.pid])


def _kill_leftovers(tag: str | None) -> None:
    """Kill and reap what a finished command left behind (re-parented to us, the
    subreaper), and nothing of another command's.

    With ``tag`` (other commands are still running): the orphans carrying this
    command's tag, and their trees. Without (it was the last one, and the caller holds
    the spawn lock, so none is starting): every descendant, as nothing else of ours is
    running; this also takes an orphan that cleared its environment.
    """
    me = os.getpid()
    with contextlib.suppress(OSError):
        if tag is None:
            roots = [me]
        else:
            roots = [pid for pid in child_pids(me) if carries(pid, COMMAND_ENV, tag)]
            if not roots:
                return
        for p in kill_tree(roots):  # ours to reap: the orphans, and their trees
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p.pid, 0)


_leaf: str | None = None  # this worker's cgroup leaf, under cgroup containment


def _sweep_and_exit() -> NoReturn:
    """The host is gone: kill every descendant (escapees too), then our own group.

    In a cgroup leaf, one write kills the whole leaf, this worker included, whatever its
    processes did to their ancestry or environment. Otherwise we are a subreaper, so
    whatever our tools left behind has re-parented to us and is still below us; the walk
    runs until a pass finds nothing alive. Either thread may find the host gone (the
    reader at EOF, the driver's thread on a broken pipe): the first sweeps, the other
    waits for the end, so neither prints anything on its way.
    """
    if _leaving.acquire(blocking=False):
        if _leaf is not None:
            with contextlib.suppress(OSError), open(os.path.join(_leaf, "cgroup.kill"), "w") as f:
                f.write("1")
        with contextlib.suppress(OSError):
            sweep([os.getpid()], passes=_SWEEP_PASSES)
        os.killpg(0, signal.SIGKILL)
    while True:  # the sweeping thread kills us all
        time.sleep(60.0)


_SWEEP_PASSES = 50
_leaving = threading.Lock()


def _apply(st: _TurnState, frame: SteerFrame | CancelFrame) -> None:
    """A steer joins the pending ones; a cancel stands, and discards them (SPEC §5)."""
    with st.lock:
        if st.cancel is not None:
            return
        if isinstance(frame, SteerFrame):
            st.steers.append(frame.steer)
            return
        st.cancel = frame.cancel
        st.steers.clear()
        hook = st.on_cancel
    st.cancel_event.set()
    if hook is not None:  # an async turn: cancel its task now, at whatever it awaits
        hook()


class _Worker:
    def __init__(self, channel: Channel[HostFrame]) -> None:
        self.channel = channel
        self.loop: asyncio.AbstractEventLoop | None = None  # made by the first async turn
        self.current: _TurnState | None = None
        self.lock = threading.Lock()
        self.runs: list[RunTurn | Probe | None] = []
        self.runs_ready = threading.Condition(self.lock)

    def send(self, frame: msgspec.Struct) -> None:
        try:
            self.channel.send(frame)
        except OSError:
            # The host is gone (a broken pipe while the driver was talking to it): the
            # same quiet exit as when the reader sees the channel close, never a
            # traceback from whichever thread was writing.
            _sweep_and_exit()

    def _state_for(self, turn: str) -> _TurnState | None:
        st = self.current
        return st if st is not None and st.turn == turn else None

    def read_loop(self) -> None:
        """The reader thread: route frames; never runs driver code."""
        while True:
            try:
                frame = self.channel.recv()
            except Exception:
                # The host is gone (killed, or crashed) or talks nonsense: nobody will
                # read this turn's result, so take our whole tree down with us.
                _sweep_and_exit()
                break
            match frame:
                case RunTurn() | Probe():
                    with self.lock:
                        if isinstance(frame, RunTurn):
                            self.current = _TurnState(frame, self.send)
                            for held in frame.held:  # before the driver's first boundary
                                _apply(self.current, held)
                        self.runs.append(frame)
                        self.runs_ready.notify()
                case SteerFrame(turn=turn) | CancelFrame(turn=turn):
                    st = self._state_for(turn)
                    if st is not None:
                        _apply(st, frame)
                case Preempt(turn=turn):
                    st = self._state_for(turn)
                    if st is not None:
                        with st.lock:
                            victims = [p for p, by in st.tools.items() if by is None]
                            for p in victims:
                                st.tools[p] = frame
                            if st.starting and st.early is None:
                                st.early = frame  # still starting: killed once it has a pid
                            busy = bool(victims) or bool(st.starting)
                            hook = None if busy else st.on_preempt
                        for p in victims:
                            # run_command tells a kill from the command's own exit by
                            # its status: SIGKILL means this kill landed
                            _kill_command(p)
                        if hook is not None:  # an async turn's innermost tool call
                            hook(frame)
                case Escalate(turn=turn):
                    st = self._state_for(turn)
                    if st is not None:
                        with st.lock:
                            answer = not st.cancel_delivered
                            st.escalating = answer
                        if answer:  # else the Delivered frame is on its way already
                            self.send(Escalating(turn=turn))
                case ToolReply(turn=turn, call=call):
                    st = self._state_for(turn)
                    if st is not None:
                        with st.lock:
                            if st.on_reply is None or not st.on_reply(frame):
                                st.replies[call] = frame
                                st.reply_ready.notify_all()
                case Shutdown():
                    break
        with self.lock:
            self.runs.append(None)
            self.runs_ready.notify()

    def main_loop(self) -> None:
        while True:
            with self.lock:
                while not self.runs:
                    self.runs_ready.wait()
                item = self.runs.pop(0)
            match item:
                case None:
                    return
                case Probe(driver=driver):
                    try:
                        load_driver(driver)
                        self.send(ProbeReply(driver=driver))
                    except DriverNotFound as exc:
                        self.send(ProbeReply(driver=driver, error=exc.message))
                case RunTurn():
                    with self.lock:
                        state = self.current
                    assert state is not None and state.turn == item.turn
                    self.send(self._run(item, state))

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """This worker's one event loop, for its whole life: whatever an async driver keeps
        open on it (a tool server's session, a connection pool) outlives the turn."""
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
        return self.loop

    def _run(self, run: RunTurn, state: _TurnState) -> TurnEnd:
        if run.progress_every is not None:
            # The host's stall watchdog counts from here, when the turn really starts,
            # not from when it was claimed and waited for a worker.
            self.send(Progress(turn=run.turn, in_tool=False))
        try:
            cls = load_driver(run.driver)
            if inspect.iscoroutinefunction(cls.run):
                from tether.runtime.async_context import run_async_turn

                return run_async_turn(self, run, state, cls)
            ctx = TurnContext(self, run, state)
            final = cls().run(ctx)
        except Exception as exc:  # a driver's failure ends its turn, never the worker
            return end_of(run, state, error=exc)
        return end_of(run, state, final=final)


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


def worker_main(sock: socket.socket, token: str, leaf: str | None = None) -> None:
    """Entry point of a worker process (started by the pool through the forkserver)."""
    global _leaf
    if leaf is not None:
        # First, while we have no thread and no child: everything we start from now on
        # is born inside the leaf (SPEC §15.5). A failure here is a failed start.
        with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        _leaf = leaf
    os.setsid()  # own session and process group: abort is one killpg
    set_subreaper()  # orphaned tool grandchildren come back to us, not to PID 1
    # Our parent is the forkserver. A paused (stopped) worker runs nothing, so it could
    # never see its host channel close and sweep its tree: the kernel continues it when
    # the forkserver goes, and the sweep runs. The forkserver exits once its "alive" pipe
    # has no writer left; every forkserver child inherits that writer, so we drop ours
    # (we never start processes through the forkserver), and the host's is the last.
    set_parent_death_signal(signal.SIGCONT)
    server: Any = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None
    # Inherited by every tool and escapee: if we die by SIGKILL and cannot sweep, the
    # pool finds what our tree left behind by this tag.
    os.environ[TREE_ENV] = token
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when we stop
    # Drivers log through structlog too (an agent's retries): the host's settings
    # (TETHER_LOG, TETHER_LOG_FORMAT), to stderr, quiet by default.
    configure_logging()
    channel: Channel[HostFrame] = Channel(sock, HostFrame)
    worker = _Worker(channel)
    reader = threading.Thread(target=worker.read_loop, name="tether-worker-reader", daemon=True)
    reader.start()
    channel.send(Ready(pid=os.getpid()))
    worker.main_loop()
