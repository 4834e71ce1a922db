"""The public ``Runtime`` facade (SPEC §12): one embedded host.

It owns the store, the worker pool and the supervisor actor. Every call validates its
input first (bad input raises a typed error and changes nothing). Decisions that change
sessions go through the supervisor's mailbox; the hot paths (send and interrupt to a
live session) authorize against its directory in the caller's thread, then tell the
agent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import pykka
import structlog

from tether.actors._ids import new_id
from tether.actors.agent import Enqueue, Interrupt
from tether.actors.authority import Ancestor, Authority, Host, User, sender_of
from tether.actors.ports import TurnJob
from tether.actors.supervisor import (
    Create,
    Directory,
    DisposeReq,
    Kick,
    ListReq,
    Recover,
    RefReq,
    ReleaseReq,
    Resolve,
    Running,
    Send,
    StatusReq,
    SupervisorActor,
)
from tether.runtime._log import configure_logging
from tether.runtime.pool import Pool, PoolHost
from tether.runtime.store import Store
from tether.runtime.worker import set_subreaper
from tether.wire.errors import InvalidParams, NotFound, TetherError, TurnFailed, Unauthorized
from tether.wire.frames import (
    Cancel,
    CancelFrame,
    Preempt,
    Say,
    Steer,
    SteerFrame,
    ToolCall,
    ToolReply,
)
from tether.wire.records import (
    STATES,
    AgentInfo,
    AgentRef,
    Entry,
    Event,
    SessionHeader,
    TurnRecord,
)
from tether.wire.text import cap

__all__ = ["KINDS", "MAX_CONTENT", "OneShot", "Runtime"]

log = structlog.get_logger("tether.runtime")
_stdlib_log = logging.getLogger("tether.runtime")

KINDS = ("steer", "cancel", "abort", "preempt")
MAX_CONTENT = 1_000_000  # characters in one message
_ABORT_WAIT = 5.0  # seconds close() waits for aborted turns' trees to be reaped
_MODES = ("continuable", "one-shot")
_SCOPES = ("children", "descendants")
_data_encoder = msgspec.msgpack.Encoder()


@dataclasses.dataclass(frozen=True, slots=True)
class InterruptReq:
    target: str
    authority: Authority | Host
    kind: str
    reason: str
    grace: float
    deadline: float | None


class OneShot:
    """The holder's handle on a one-shot subagent: one task, one result."""

    def __init__(self, runtime: Runtime, session: str) -> None:
        self._rt = runtime
        self.id = session

    def result(self, timeout: float | None = None) -> str | None:
        """The task's final text; TurnFailed if it did not complete."""
        self._rt.wait(self.id, until="settled", timeout=timeout if timeout is not None else 1e9)
        turns = self._rt.turns(self.id)
        if not turns:
            raise TurnFailed(f"one-shot {self.id} was disposed before it ran")
        last = turns[-1]
        if last.outcome != "completed":
            raise TurnFailed(
                f"one-shot {self.id} ended {last.outcome}: {last.error or last.reason or ''}"
            )
        return self._rt._store.last_assistant_text(self.id, last.id)

    def kill(self) -> None:
        """Hard stop, holder-owned: the turn's whole process tree is killed now."""
        self._rt._interrupt(
            InterruptReq(
                self.id, Host("user", "holder"), "abort", "killed by its holder", 0.0, None
            )
        )

    def dispose(self) -> None:
        self._rt._dispose(self.id, Host("user", "holder"))

    def __repr__(self) -> str:
        return f"OneShot({self.id!r})"


class _EventBus:
    """Events for subscribers, and state changes for ``wait()`` (the agents' EventSink)."""

    def __init__(self) -> None:
        self.subscribers: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()
        self.changed = threading.Condition()
        self.version = 0  # bumped by every state event while someone waits
        self.waiters = 0

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        with self._lock:
            self.subscribers = [*self.subscribers, callback]

        def unsubscribe() -> None:
            with self._lock:
                self.subscribers = [s for s in self.subscribers if s is not callback]

        return unsubscribe

    def wants(self, name: str) -> bool:
        return bool(self.subscribers) or (name == "state" and self.waiters > 0)

    def emit(self, name: str, session: str, lineage: tuple[str, ...], data: dict[str, Any]) -> None:
        subscribers = self.subscribers
        if subscribers:
            event = Event(name=name, session=session, lineage=lineage, data=data, ts=time.time())
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:  # an observer's bug must not break the agent that emitted
                    log.exception("events.subscriber_failed", event=name)
        if name == "state" and self.waiters:
            with self.changed:
                self.version += 1
                self.changed.notify_all()


class _Host(PoolHost):
    """The pool's view of the runtime: transcript writes and tool calls from workers."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime

    def on_say(self, job: TurnJob, frame: Say) -> None:
        rt = self._rt
        entry = rt._store.append_entry(
            job.session, frame.kind, frame.text, turn=job.turn, data=frame.data
        )
        if rt._events.subscribers:
            act = rt._dir.registry.get(job.session)
            lineage = act.lineage if act is not None else ()
            rt._events.emit("entry", job.session, lineage, {"entry": msgspec.to_builtins(entry)})

    def on_tool_call(self, job: TurnJob, frame: ToolCall) -> ToolReply:
        try:
            result = self._rt._tool(job, frame.name, frame.args)
            return ToolReply(turn=frame.turn, call=frame.call, result=result)
        except TetherError as exc:
            return ToolReply(turn=frame.turn, call=frame.call, code=exc.code, message=exc.message)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("tool.internal_error", error_id=error_id, tool=frame.name)
            return ToolReply(
                turn=frame.turn,
                call=frame.call,
                code="internal",
                message=f"internal error {error_id}",
            )


class Runtime:
    """One embedded Tether host. Use it as a context manager, or call ``close()``."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        workers: int = 2,
        grace: float = 5.0,
        subreaper: bool = False,
    ) -> None:
        configure_logging()
        if subreaper:
            set_subreaper()
        if workers < 1:
            raise InvalidParams("workers must be at least 1")
        self.grace = float(grace)
        self._closed = False
        self._events = _EventBus()
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._store = Store(None if path is None else os.fspath(path))
        crashed = self._store.recover()
        if crashed:
            log.warning("recovery.crashed_turns", sessions=len(crashed))
        self._pool = Pool(workers, _Host(self))
        try:
            self._dir = Directory()
            self._sup = SupervisorActor.start(
                store=self._store, executor=self._pool, events=self._events, directory=self._dir
            )
            self._ask(Recover(self._store.sessions()))
        except BaseException:
            self._pool.close()
            raise

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sessions ---------------------------------------------------------------------

    def open_session(
        self,
        driver: str,
        *,
        config: dict[str, Any] | None = None,
        slug: str | None = None,
        permissions: dict[str, str] | None = None,
    ) -> str:
        """Open a root session; its owner prompts it with ``prompt``."""
        header = self._header(None, driver, "continuable", slug, config, permissions)
        return str(self._ask(Create(header)))

    def prompt(self, session_id: str, content: str, *, data: dict[str, Any] | None = None) -> None:
        """The owner's message to a root session (waking)."""
        self._check_message(content, data)
        self._send(session_id, content, None, data, True)

    def spawn(
        self,
        parent: str,
        driver: str,
        *,
        mode: str = "continuable",
        prompt: str | None = None,
        data: dict[str, Any] | None = None,
        slug: str | None = None,
        config: dict[str, Any] | None = None,
        permissions: dict[str, str] | None = None,
    ) -> str | OneShot:
        """Spawn a subagent of ``parent``; ``prompt`` becomes its first message."""
        if mode not in _MODES:
            raise InvalidParams(f"mode must be one of {_MODES}, not {mode!r}")
        if mode == "one-shot" and prompt is None:
            raise InvalidParams("a one-shot subagent needs a prompt: it is its one task")
        if prompt is not None:
            self._check_message(prompt, data)
        if not isinstance(parent, str):
            raise InvalidParams("parent must be a session id")
        header = self._header(parent, driver, mode, slug, config, permissions)
        sid = str(self._ask(Create(header, prompt, data)))
        return OneShot(self, sid) if mode == "one-shot" else sid

    def send(
        self,
        target: str,
        content: str,
        *,
        authority: Authority,
        data: dict[str, Any] | None = None,
        wake: bool = True,
    ) -> None:
        """Append to a subagent's inbox (durable before this returns); ``wake`` starts it."""
        self._check_authority(authority)
        self._check_message(content, data)
        self._send(target, content, authority, data, bool(wake))

    def interrupt(
        self,
        target: str,
        *,
        authority: Authority,
        kind: str = "cancel",
        reason: str = "",
        grace: float | None = None,
        deadline: float | None = None,
    ) -> None:
        """Authorize, issue, return at once: accepted means "signal issued" (SPEC §5)."""
        self._check_authority(authority)
        if kind not in KINDS:
            raise InvalidParams(f"kind must be one of {KINDS}, not {kind!r}")
        if not isinstance(reason, str):
            raise InvalidParams("reason must be a string")
        if kind == "steer" and not reason.strip():
            raise InvalidParams("a steer needs a non-empty text")
        for name, value in (("grace", grace), ("deadline", deadline)):
            if value is not None and (not isinstance(value, int | float) or value < 0):
                raise InvalidParams(f"{name} must be a non-negative number of seconds")
        g = self.grace if grace is None else float(grace)
        self._interrupt(InterruptReq(target, authority, kind, cap(reason), g, deadline))

    def list_agents(self, root: str, *, scope: str = "children") -> list[AgentInfo]:
        """One consistent pre-order walk below ``root`` (SPEC §7)."""
        if scope not in _SCOPES:
            raise InvalidParams(f"scope must be one of {_SCOPES}, not {scope!r}")
        result: list[AgentInfo] = self._ask(ListReq(root, scope))
        return result

    def status(self, session_id: str) -> AgentInfo:
        result: AgentInfo = self._ask(StatusReq(session_id))
        return result

    def wait(
        self,
        session_id: str,
        *,
        until: str | tuple[str, ...] = ("idle", "parked"),
        timeout: float = 10.0,
    ) -> AgentInfo:
        """Block until the session is in one of ``until``; TimeoutError after ``timeout``."""
        states = (until,) if isinstance(until, str) else tuple(until)
        bad = [s for s in states if s not in STATES]
        if bad:
            raise InvalidParams(f"unknown state(s) {bad}")
        deadline = time.monotonic() + timeout
        bus = self._events
        with bus.changed:
            bus.waiters += 1  # before the first look, so no state event can slip past
        try:
            while True:
                with bus.changed:
                    seen = bus.version
                info = self.status(session_id)
                if info.state in states:
                    return info
                with bus.changed:
                    while bus.version == seen:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(
                                f"{session_id} is {info.state}, not {'/'.join(states)}, "
                                f"after {timeout:g}s"
                            )
                        bus.changed.wait(left)
        finally:
            with bus.changed:
                bus.waiters -= 1

    def transcript(self, session_id: str, *, after: int = 0) -> list[Entry]:
        self.status(session_id)
        return self._store.entries(session_id, after=after)

    def turns(self, session_id: str) -> list[TurnRecord]:
        self.status(session_id)
        return self._store.turns(session_id)

    def agent_ref(self, session_id: str) -> AgentRef:
        """The session's current activation, to act as ``Ancestor(ref)``."""
        result: AgentRef = self._ask(RefReq(session_id))
        return result

    def release(self, session_id: str) -> None:
        """Take a session offline (dormant); its children stay live; old refs go stale."""
        self._ask(ReleaseReq(session_id))

    def dispose(self, session_id: str, *, authority: Authority) -> None:
        """End the session and its whole subtree, deepest first; returns when all settled."""
        self._check_authority(authority)
        self._dispose(session_id, authority)

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event; it must not block. Returns unsubscribe."""
        return self._events.subscribe(callback)

    def close(self) -> None:
        """Drain: cancel running turns with grace, abort the rest, stop every process."""
        if self._closed:
            return
        self._closed = True
        self._pool.drain()
        try:
            running: list[str] = self._ask(Running())
            self._stop_all(running, "cancel", self.grace + 1.0)
            left: list[str] = self._ask(Running())
            self._stop_all(left, "abort", _ABORT_WAIT)  # a cancel issued earlier, stuck
            for sid in self._ask(Running()):
                log.error("close.turn_survived", session=sid)
        finally:
            self._pool.close()
            self._sup.stop()
            self._store.close()

    def _stop_all(self, sessions: list[str], kind: str, timeout: float) -> None:
        """Stop every turn in ``sessions`` (a cancel escalates after ``grace`` with no
        boundary) and wait up to ``timeout`` for them to end."""
        for sid in sessions:
            self._interrupt(
                InterruptReq(sid, Host(), kind, "the runtime is closing", self.grace, self.grace)
            )
        deadline = time.monotonic() + timeout
        for sid in sessions:
            with contextlib.suppress(TimeoutError):
                self.wait(
                    sid,
                    until=("idle", "parked", "settled", "dormant"),
                    timeout=max(deadline - time.monotonic(), 0.01),
                )

    @property
    def worker_pids(self) -> list[int]:
        """The pids of the pool's worker processes (for tests and benchmarks)."""
        return self._pool.worker_pids()

    # ---- internals --------------------------------------------------------------------

    def _ask(self, message: Any) -> Any:
        if self._closed and not isinstance(message, Running | StatusReq):
            raise TetherError("the runtime is closed")
        return self._sup.ask(message)

    def _send(
        self,
        target: str,
        content: str,
        authority: Authority | None,
        data: dict[str, Any] | None,
        wake: bool,
    ) -> None:
        """The hot path: a live target is authorized here, without the supervisor's mailbox.

        A dormant target goes through the supervisor, which materializes it.
        """
        if self._closed:
            raise TetherError("the runtime is closed")
        act = self._dir.registry.get(target)
        if act is None:
            self._ask(Send(target, content, authority, data, wake))
            return
        self._dir.authorize_send(target, authority)
        msg = self._store.append_message(target, content, data=data, sender=sender_of(authority))
        if not act.cell.add_quiet(wake=wake):  # counted without waking the actor if it can be
            try:
                act.ref.tell(Enqueue("yes"))
            except pykka.ActorDeadError:  # released meanwhile: the message is durable already
                self._ask(Kick(target, wake))
        if self._events.subscribers:
            accepted = {"message": msg.id, "kind": msg.kind}
            self._events.emit("message.accepted", target, act.lineage, accepted)
        if _stdlib_log.isEnabledFor(logging.DEBUG):  # a log call costs as much as the send
            log.debug("message.accepted", session=target, message=msg.id, wake=wake)

    def _interrupt(self, req: InterruptReq) -> None:
        """Authorize here (SPEC §6 reads only the directory), then signal the agent."""
        auth = req.authority
        act = self._dir.authorize_interrupt(req.target, auth)
        if act is None:
            return
        if req.kind in ("steer", "preempt"):
            turn = act.cell.busy_turn()
            if turn is not None:  # straight to the worker: see StatusCell
                frame: SteerFrame | Preempt = (
                    SteerFrame(turn, Steer(req.reason, auth.origin, auth.by))
                    if req.kind == "steer"
                    else Preempt(turn, req.reason, auth.origin, auth.by)
                )
                self._pool.signal(turn, frame)
                if _stdlib_log.isEnabledFor(logging.DEBUG):  # a log call costs more than this
                    log.debug("interrupt.accepted", session=req.target, turn=turn, kind=req.kind)
                return
        signal = Interrupt(req.kind, auth.origin, auth.by, req.reason, req.grace, req.deadline)
        if req.kind == "cancel":
            turn = act.cell.claim_stop()
            if turn is not None:
                # The agent hears of the stop first, then the worker: whatever the worker
                # answers (the cancel delivered, the turn's end) reaches the agent after it.
                direct = dataclasses.replace(signal, turn=turn, signalled=True)
                try:
                    act.ref.tell(direct)
                except pykka.ActorDeadError:
                    return
                cancel = Cancel(req.reason, auth.origin, auth.by)
                self._pool.signal(turn, CancelFrame(turn, cancel))
                return
        elif req.kind == "abort":
            act.cell.stop_issued()  # from now on a waking send reaches the actor: the latch
        with contextlib.suppress(pykka.ActorDeadError):  # gone meanwhile: absent, a no-op
            act.ref.tell(signal)

    def _dispose(self, session_id: str, authority: Authority | Host) -> None:
        order: list[str] = self._ask(DisposeReq(session_id, authority, self.grace))
        deadline = time.monotonic() + 2 * self.grace + 10.0
        for sid in order:
            self.wait(sid, until="settled", timeout=max(deadline - time.monotonic(), 0.01))

    def _header(
        self,
        parent: str | None,
        driver: str,
        mode: str,
        slug: str | None,
        config: dict[str, Any] | None,
        permissions: dict[str, str] | None,
    ) -> SessionHeader:
        if not isinstance(driver, str) or not driver:
            raise InvalidParams("driver must be an import string 'package.module:Class'")
        if slug is not None and (not isinstance(slug, str) or not slug or len(slug) > 128):
            raise InvalidParams("slug must be a non-empty string of at most 128 characters")
        for name, value in (("config", config), ("permissions", permissions)):
            if value is not None and not isinstance(value, dict):
                raise InvalidParams(f"{name} must be a dict")
        if permissions is not None and any(
            v not in ("allow", "deny") for v in permissions.values()
        ):
            raise InvalidParams("permissions values must be 'allow' or 'deny'")
        self._check_data(config)
        self._pool.probe(driver)
        return SessionHeader(
            id=new_id("s_"),
            parent=parent,
            mode=mode,
            slug=slug,
            driver=driver,
            config=config,
            permissions=permissions,
            created_at=time.time(),
        )

    def _check_message(self, content: str, data: dict[str, Any] | None) -> None:
        if not isinstance(content, str):
            raise InvalidParams("content must be a string")
        if len(content) > MAX_CONTENT:
            raise InvalidParams(f"content of {len(content)} characters is over {MAX_CONTENT}")
        self._check_data(data)

    @staticmethod
    def _check_data(data: dict[str, Any] | None) -> None:
        if data is None:
            return
        if not isinstance(data, dict):
            raise InvalidParams("data must be a dict")
        try:
            size = len(_data_encoder.encode(data))
        except (TypeError, ValueError) as exc:
            raise InvalidParams(f"data is not serializable: {exc}") from None
        if size > MAX_CONTENT:
            raise InvalidParams(f"data of {size} bytes is over {MAX_CONTENT}")

    @staticmethod
    def _check_authority(authority: object) -> None:
        if not isinstance(authority, User | Ancestor):
            raise InvalidParams("authority must be tether.User(parent) or tether.Ancestor(ref)")

    # ---- tools called from a worker ---------------------------------------------------

    def _tool(self, job: TurnJob, name: str, args: dict[str, Any]) -> Any:
        caller = job.session
        permissions = job.permissions or {}

        def gate(key: str) -> Ancestor:
            if permissions.get(key, "allow") == "deny":
                raise Unauthorized(f"{key} is denied by this session's permissions")
            return Ancestor(self.agent_ref(caller))

        match name:
            case "history":
                return msgspec.to_builtins(self._store.entries(caller))
            case "spawn_agent":
                gate("spawn")
                result = self.spawn(
                    caller,
                    args.get("driver") or job.driver,
                    mode=args.get("mode") or "continuable",
                    prompt=args.get("prompt"),
                    data=args.get("data"),
                    slug=args.get("slug"),
                    config=args.get("config"),
                    permissions=args.get("permissions"),
                )
                return result.id if isinstance(result, OneShot) else result
            case "send_message":
                auth = gate("send")
                target = str(self._ask(Resolve(caller, str(args.get("to", "")))))
                self.send(
                    target,
                    args.get("text", ""),
                    authority=auth,
                    data=args.get("data"),
                    wake=bool(args.get("wake", True)),
                )
                return None
            case "list_agents":
                gate("list")
                return msgspec.to_builtins(
                    self.list_agents(caller, scope=args.get("scope") or "children")
                )
            case "interrupt_agent":
                auth = gate("interrupt")
                target = str(self._ask(Resolve(caller, str(args.get("agent_id", "")))))
                self.interrupt(
                    target,
                    authority=auth,
                    kind=args.get("kind") or "cancel",
                    reason=args.get("reason") or "",
                )
                return None
        raise NotFound(f"no tool named {name!r}")
