"""The worker process: a turn loop that runs one driver turn at a time.

The reader thread never runs driver code; the main thread never reads the socket. The
frames each way and what the worker does when its host goes: docs/design.md, section 10.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Any, NoReturn

import msgspec
import structlog

from tether.actors.outcomes import TurnFacts, decide_outcome
from tether.contain.prctl import set_parent_death_signal, set_subreaper
from tether.contain.procs import TREE_ENV, carries, child_pids, kill_tree, sweep
from tether.driver._command import COMMAND_ENV
from tether.driver._turn import _TurnState, end_of
from tether.driver.context import TurnContext
from tether.driver.disposal import disposal_hooks
from tether.driver.toolenv import enter_turn, set_tool_user
from tether.runtime._log import configure_logging
from tether.telemetry import spans
from tether.wire.codec import Channel
from tether.wire.errors import DriverNotFound, TetherError
from tether.wire.frames import (
    CancelFrame,
    Disposed,
    Escalate,
    Escalating,
    HostFrame,
    Preempt,
    Probe,
    ProbeReply,
    Ready,
    RunTurn,
    Shutdown,
    SpanEvent,
    SteerFrame,
    ToolReply,
    TurnEnd,
)

__all__ = ["load_driver", "worker_main"]


_drivers: dict[str, type[Any]] = {}

# Tether's own driver modules that need an extra: a failed import of one names it.
_EXTRAS = {
    "tether.agents": "agents",
    "tether.adapters.pydantic_ai": "pydantic-ai",
    "tether.adapters.openai_agents": "openai-agents",
    "tether.adapters.claude_code": "claude",
}


def _needs_extra(module_name: str) -> str | None:
    for module, extra in _EXTRAS.items():
        if module_name == module or module_name.startswith(module + "."):
            return extra
    return None


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
        # a package of the extra missing, not a fault of Tether's own modules
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        extra = _needs_extra(module_name)
        if extra is not None and missing and not missing.startswith("tether"):
            wanted = f"tether-runtime[{extra}]"
            raise DriverNotFound(
                f"driver {spec!r} needs the extra {wanted} (pip install '{wanted}'): {exc}"
            ) from None
        raise DriverNotFound(f"driver {spec!r}: cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "run", None)):
        raise DriverNotFound(f"driver {spec!r}: {attr!r} is not a class with a run(ctx) method")
    _drivers[spec] = cls
    return cls


def probe_driver(driver: str, config: dict[str, Any] | None) -> ProbeReply:
    """Whether ``driver`` loads and, where its class has ``check_config(config)``, takes
    ``config``: what the host asks a worker at open and spawn (it runs no driver code but
    the check). Also whether its class continues a crashed turn (``recoverable``)."""
    try:
        cls = load_driver(driver)
    except DriverNotFound as exc:
        return ProbeReply(driver=driver, error=exc.message)
    recoverable = getattr(cls, "recoverable", False) is True
    hook = getattr(cls, "check_config", None)
    if not callable(hook):
        return ProbeReply(driver=driver, recoverable=recoverable)
    try:
        hook(config or {})
    except TetherError as exc:
        return ProbeReply(driver=driver, error=exc.message, code=exc.code, checks_config=True)
    except Exception as exc:  # the hook's own bug: the open is refused, with its words
        error = f"driver {driver!r}: its config check failed: {type(exc).__name__}: {exc}"
        return ProbeReply(driver=driver, error=error, checks_config=True)
    return ProbeReply(driver=driver, checks_config=True, recoverable=recoverable)


def _kill_command(proc: subprocess.Popen[bytes]) -> None:
    """Freeze, then kill, a running command and its descendants (see ``tether.contain.procs``).
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
_DISPOSAL_WAIT = 10.0  # seconds the disposal hooks may take, all told, between turns

log = structlog.get_logger("tether.worker")


def _apply(st: _TurnState, frame: SteerFrame | CancelFrame) -> None:
    """A steer joins the pending ones; a cancel stands, and discards them (semantics §5)."""
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


class _Runner:
    """The worker process's side: its reader thread (``read_loop``) and the main
    thread's turn loop (``main_loop``), over its one channel to the host."""

    def __init__(self, channel: Channel[HostFrame]) -> None:
        self.channel = channel
        self.loop: asyncio.AbstractEventLoop | None = None  # made by the first async turn
        self.current: _TurnState | None = None
        self.lock = threading.Lock()
        self.runs: list[RunTurn | Probe | Disposed | None] = []
        self.runs_ready = threading.Condition(self.lock)

    def send(self, frame: msgspec.Struct) -> None:
        try:
            self.channel.send(frame)
        except OSError:
            # The host is gone (a broken pipe while the driver was talking to it): the
            # same quiet exit as when the reader sees the channel close, never a
            # traceback from whichever thread was writing.
            _sweep_and_exit()

    # The driver room's WorkerPort: a context kills a command's tree through its worker
    # (the kill walk stays here, with the rest of this process tree's).
    def kill_command(self, proc: subprocess.Popen[bytes]) -> None:
        _kill_command(proc)

    def kill_leftovers(self, tag: str | None) -> None:
        _kill_leftovers(tag)

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
                case RunTurn() | Probe() | Disposed():
                    self._queue(frame)
                case SteerFrame(turn=turn) | CancelFrame(turn=turn):
                    st = self._state_for(turn)
                    if st is not None:
                        _apply(st, frame)
                case Preempt():
                    self._preempt(frame)
                case Escalate():
                    self._escalate(frame)
                case ToolReply():
                    self._tool_reply(frame)
                case SpanEvent():
                    spans.event(frame)
                case Shutdown():
                    break
        with self.lock:
            self.runs.append(None)
            self.runs_ready.notify()

    def _queue(self, frame: RunTurn | Probe | Disposed) -> None:
        """Hand work to the main thread; a turn's state exists before it is queued."""
        with self.lock:
            if isinstance(frame, RunTurn):
                self.current = _TurnState(frame, self)
                for held in frame.held:  # before the driver's first boundary
                    _apply(self.current, held)
            self.runs.append(frame)
            self.runs_ready.notify()

    def _preempt(self, frame: Preempt) -> None:
        st = self._state_for(frame.turn)
        if st is None:
            return
        victims, busy = st.preempt_commands(frame)
        for p in victims:
            # run_command tells a kill from the command's own exit by
            # its status: SIGKILL means this kill landed
            _kill_command(p)
        hook = None if busy else st.on_preempt
        if hook is not None:  # an async turn's innermost tool call
            hook(frame)

    def _escalate(self, frame: Escalate) -> None:
        st = self._state_for(frame.turn)
        if st is None:
            return
        with st.lock:
            answer = not st.cancel_delivered
            st.escalating = answer
        if answer:  # else the Delivered frame is on its way already
            self.send(Escalating(turn=frame.turn))

    def _tool_reply(self, frame: ToolReply) -> None:
        st = self._state_for(frame.turn)
        if st is None:
            return
        with st.lock:
            if st.on_reply is None or not st.on_reply(frame):
                st.replies[frame.call] = frame
                st.reply_ready.notify_all()

    def main_loop(self) -> None:
        while True:
            with self.lock:
                while not self.runs:
                    self.runs_ready.wait()
                item = self.runs.pop(0)
            match item:
                case None:
                    return
                case Probe(driver=driver, config=config):
                    self.send(probe_driver(driver, config))
                case Disposed(sessions=sessions):
                    self._disposed(sessions)
                case RunTurn():
                    with self.lock:
                        state = self.current
                    assert state is not None and state.turn == item.turn
                    # before the driver runs: it and its tools never see a hidden secret
                    enter_turn(item.keys, item.hide)
                    end = self._run(item, state)
                    self.send(end)
                    if item.trace is not None:
                        # after the end is reported: the span's work and the export
                        # never delay a turn's end, and an abort before it loses only
                        # this turn's spans (the host then makes the turn's own)
                        _end_turn_span(end, state)
                        spans.flush()

    def _disposed(self, sessions: list[str]) -> None:
        """The disposal hooks, here on the main thread between turns: no turn runs while
        they do, so what they close is never in use. A hook's failure is logged, never
        the worker's end; together they get ``_DISPOSAL_WAIT``, then the next turn."""
        deadline = time.monotonic() + _DISPOSAL_WAIT
        for hook in disposal_hooks():
            try:
                pending = hook(sessions)
                if pending is not None:
                    left = max(0.0, deadline - time.monotonic())
                    self.event_loop().run_until_complete(asyncio.wait_for(pending, left))
            except Exception as exc:
                log.warning("worker.disposal_hook_failed", hook=repr(hook), error=repr(exc))

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """This worker's one event loop, for its whole life: whatever an async driver keeps
        open on it (a tool server's session, a connection pool) outlives the turn."""
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
        return self.loop

    def _run(self, run: RunTurn, state: _TurnState) -> TurnEnd:
        with spans.turn(run, lambda: state.cancel):
            return self._run_driver(run, state)

    def _run_driver(self, run: RunTurn, state: _TurnState) -> TurnEnd:
        try:
            cls = load_driver(run.driver)
            if inspect.iscoroutinefunction(cls.run):
                from tether.driver.async_context import run_async_turn

                return run_async_turn(self, run, state, cls)
            ctx = TurnContext(self, run, state)
            final = cls().run(ctx)
        except Exception as exc:  # a driver's failure ends its turn, never the worker
            return end_of(run, state, error=exc)
        return end_of(run, state, final=final)


def _end_turn_span(end: TurnEnd, state: _TurnState) -> None:
    """The turn's span ends with the outcome as the host decides it from what this worker
    saw: its end, and the cancel that reached it. (A stop that reached the host only as
    the turn ended on its own, which the worker never saw, is not on it.)"""
    cancel = state.cancel
    stop = None if cancel is None else cancel.stop
    o = decide_outcome(TurnFacts(stop=stop, end=end.outcome, error=end.error))
    spans.turn_ended(
        outcome=o.outcome,
        cause=o.cause,
        by=o.by,
        origin=None if cancel is None else cancel.origin,
        reason=o.reason,
        error=o.error,
        final=end.final,
        usage=end.usage,
    )


def worker_main(
    sock: socket.socket, token: str, leaf: str | None = None, *, tool_user: str | None = None
) -> None:
    """Entry point of a worker process (forked by the pool's launcher, ``_launcher``).
    ``tool_user``: the user its tools run as (semantics §17.4)."""
    global _leaf
    if leaf is not None:
        # First, while we have no thread and no child: everything we start from now on
        # is born inside the leaf (semantics §15.5). A failure here is a failed start.
        with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        _leaf = leaf
    os.setsid()  # own session and process group: abort is one killpg
    set_subreaper()  # orphaned tool grandchildren come back to us, not to PID 1
    # Our parent is the launcher (``_launcher``). A paused (stopped) worker runs nothing,
    # so it could never see its host channel close and sweep its tree: the kernel
    # continues it when the launcher goes (it exits once its host does), and the sweep
    # runs.
    set_parent_death_signal(signal.SIGCONT)
    # Inherited by every tool and escapee: if we die by SIGKILL and cannot sweep, the
    # pool finds what our tree left behind by this tag.
    os.environ[TREE_ENV] = token
    set_tool_user(tool_user)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when we stop
    # Drivers log through structlog too (an agent's retries): the host's settings
    # (TETHER_LOG, TETHER_LOG_FORMAT), to stderr, quiet by default.
    configure_logging()
    channel: Channel[HostFrame] = Channel(sock, HostFrame)
    worker = _Runner(channel)
    reader = threading.Thread(target=worker.read_loop, name="tether-worker-reader", daemon=True)
    reader.start()
    channel.send(Ready(pid=os.getpid()))
    worker.main_loop()
    spans.shutdown()  # what is left of the last turn's spans, before the worker exits
