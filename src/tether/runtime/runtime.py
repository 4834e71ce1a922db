"""The public ``Runtime`` facade (semantics §12): one embedded host.

It owns the store, the worker pool, the timer queue, the supervisor actor and the
dispatcher's session hosts (``_engine.Engine``, its base: what it owns and the steps that
open it). Every call validates its input first (bad input raises a typed error and
changes nothing: ``_checks``), then asks the one actor that decides: the supervisor for
the tree (spawn, dispose, list), the session's host for everything about one session
(send, interrupt, status, release); a subtree's stop or pause walks it (``_walks``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, overload

import structlog

from tether.actors._ids import new_id
from tether.actors.authority import Authority, Host, sender_of
from tether.actors.host import (
    Enqueued,
    InterruptOp,
    PauseOp,
    RefOp,
    ReleaseOp,
    StatusOp,
    SuspendOp,
)
from tether.actors.supervisor import Create, DisposeReq, ListReq, RootsReq
from tether.contain.prctl import set_subreaper
from tether.runtime import _at_exit
from tether.runtime._approvals import Approvals
from tether.runtime._checks import (
    CONTAINMENTS,
    KINDS,
    MAX_CONTENT,
    Timeout,
    Workers,
    check_authority,
    check_containment,
    check_driver,
    check_enforceable,
    check_id,
    check_interrupt,
    check_limits,
    check_message,
    check_recovery,
    check_secret_env,
    check_settings,
    check_slug,
    check_stall,
    check_text,
    check_tool_user,
    check_turn,
    convert,
)
from tether.runtime._events import EventBus
from tether.runtime._log import configure_logging
from tether.runtime._oneshot import OneShot
from tether.runtime._secrets import Secrets
from tether.runtime._tools import HostTools, spawning
from tether.runtime._walks import pause_subtree, stop_subtree
from tether.runtime.backend import BackendFactory, check_backend
from tether.telemetry import Telemetry
from tether.telemetry import make as make_telemetry
from tether.telemetry import resolve as resolve_telemetry
from tether.wire.budget import Budget, BudgetStatus, check_budget
from tether.wire.errors import InvalidParams, NotFound
from tether.wire.records import (
    STATES,
    AgentInfo,
    AgentRef,
    Entry,
    Event,
    PendingMessage,
    SessionHeader,
    StopReport,
    TurnRecord,
)
from tether.wire.text import cap
from tether.wire.vocab import MAX_SECONDS, Grace, Kind, Seconds, StallPolicy

# The checks' constants and public checks are imported from here too.
__all__ = [
    "CONTAINMENTS",
    "KINDS",
    "MAX_CONTENT",
    "OneShot",
    "Runtime",
    "check_limits",
    "check_stall",
]

log = structlog.get_logger("tether.runtime")
_stdlib_log = logging.getLogger("tether.runtime")

# A cancel issued without a deadline gets this many graces (and at least this many
# seconds) for a boundary to take it before it escalates to an abort.
CANCEL_DEADLINE_GRACES = 3.0
CANCEL_DEADLINE_MIN = 1.0
_ABORT_WAIT = 5.0  # seconds close() waits for aborted turns' trees to be reaped
_MODES = ("continuable", "one-shot")
_SCOPES = ("children", "descendants")
_CLOSE_TURNS = ("cancel", "suspend")


class Runtime(Approvals):
    """One embedded Tether host. Use it as a context manager, or call ``close()``; one
    left open is closed, as ``close()`` would, when the program's main thread ends."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        workers: int = 2,
        grace: float = 5.0,
        subreaper: bool = False,
        backend: str | BackendFactory = "local",
        ray_address: str | None = None,
        ray_options: dict[str, Any] | None = None,
        containment: str | None = None,
        cancel_deadline: float | None = None,
        telemetry: bool | dict[str, Any] | None = None,
        secret_env: Iterable[str] = (),
        tool_user: str | None = None,
        on_crash: str = "recover",
        max_recoveries: int = 3,
    ) -> None:
        """``backend`` is where turns run (semantics §14.6): ``"local"`` (the process pool),
        ``"ray"`` (a Ray cluster, the extra ``tether-runtime[ray]``: ``ray_address`` names it,
        none starts a local one; ``ray_options`` are RayBackend's settings), or a
        factory ``(workers, host) -> Backend``.

        ``containment`` is how a turn's process tree is held (semantics §15.5): ``"cgroup"``
        (a cgroup v2 leaf per worker: InvalidParams where none is available, with the
        reason), ``"walk"`` (the process-tree walk) or ``"auto"`` (cgroup where
        available); default: the environment variable ``TETHER_CONTAINMENT``, else auto.
        ``rt.containment`` says which is in force.

        ``cancel_deadline`` is the deadline of every cancel issued without one
        (``interrupt(deadline=…)``, semantics §5): a cancel no boundary has taken that many
        seconds after it was issued escalates to an abort (``escalated``), so that a
        driver stuck in a blocking call cannot keep its turn for ever. Default:
        ``CANCEL_DEADLINE_GRACES`` times ``grace``, at least ``CANCEL_DEADLINE_MIN``
        seconds; ``rt.cancel_deadline`` says which is in force.

        ``telemetry`` exports OpenTelemetry traces over OTLP from the host and every
        worker (semantics §16.3, the extra ``tether-runtime[otel]``): ``True``, or settings
        ``{"endpoint": "http://127.0.0.1:4318", "content": False, "service": "tether"}``;
        None (the default): on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; ``False``:
        off. The other ``OTEL_*`` variables are read by the SDK.

        No secret of the host reaches a worker's tools (semantics §17.4): ``TETHER_TOKEN``,
        any variable a session's config names as a key (``api_key_env``: only that
        session's model client gets its value), and the variables named in
        ``secret_env``. ``tool_user`` runs the tools (commands, MCP servers, CLIs) as
        that user, so they can read neither the host's files nor its memory: the host
        must be able to switch users (root, or ``CAP_SETUID`` and ``CAP_SETGID``), on
        the local backend; without it, a tool runs as the host's user and can read what
        that user can read.

        ``on_crash`` and ``max_recoveries`` are the default of every root session
        (semantics §17.1): ``"recover"`` runs a recoverable turn a crash interrupted on
        from its last step, at most ``max_recoveries`` times; ``"park"`` ends it
        ``crashed``, as before."""
        configure_logging()
        if subreaper:
            set_subreaper()
        workers = convert(workers, Workers, "workers")
        grace = convert(grace, Grace, "grace")
        if cancel_deadline is None:
            cancel_deadline = min(
                max(CANCEL_DEADLINE_GRACES * grace, CANCEL_DEADLINE_MIN), MAX_SECONDS
            )
        cancel_deadline = convert(cancel_deadline, Seconds, "cancel_deadline")
        tool_user = check_tool_user(tool_user, backend)
        check_backend(backend, ray_address)
        self._secrets = Secrets(check_secret_env(secret_env))
        self._on_crash, self._max_recoveries = check_recovery(on_crash, max_recoveries, None)
        self._tel: Telemetry = make_telemetry(resolve_telemetry(telemetry))
        containment = check_containment(containment)
        self.grace = grace
        self.cancel_deadline: float = cancel_deadline
        self._closed = False
        self._events = EventBus()
        catalog = self._open_store(path, containment, backend)
        for header in catalog:  # before a worker starts: none inherits a key they name
            self._secrets.learn(header.config)
        tools = HostTools(self, self._secrets, tool_user)
        self._open_backend(backend, workers, containment, ray_address, ray_options, tools)
        self._open_hosts(catalog)
        # Only a process's own runtimes close at its exit: a forked child's copy does not.
        self._pid = os.getpid()
        _at_exit.register(self)

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
        permissions: Mapping[str, str] | None = None,
        stall: dict[str, Any] | StallPolicy | None = None,
        limits: dict[str, float] | None = None,
        budget: dict[str, Any] | Budget | None = None,
        on_crash: str | None = None,
        max_recoveries: int | None = None,
    ) -> str:
        """Open a root session; its owner prompts it with ``prompt``.

        ``stall``: the stall watchdog's policy (see ``check_stall``). ``limits``: each
        turn's ``memory_mb``, ``pids`` and ``cpu`` (cores), enforced by the turn's cgroup
        (semantics §15.5); one the kernel cannot enforce here is InvalidParams. ``budget``:
        the tree's budget (semantics §16.2, ``tether.Budget`` or its dict), see ``set_budget``.
        ``on_crash`` (``"recover"`` or ``"park"``) and ``max_recoveries``: what a crash does
        to its turns (semantics §17.1); default: the runtime's.
        """
        header = self._header(
            None,
            driver,
            "continuable",
            slug,
            config,
            permissions,
            stall,
            limits,
            budget,
            on_crash,
            max_recoveries,
        )
        return self._create(Create(header))

    def prompt(self, session_id: str, content: str, *, data: dict[str, Any] | None = None) -> str:
        """The owner's message to a root session (waking); returns the message id."""
        check_message(content, data)
        return self._send(session_id, content, None, data, True)

    # A continuable spawn returns the child's id, a one-shot its handle: typed by the mode
    # when it is a literal; a mode only known at run time (checked below) gets the union.
    @overload
    def spawn(
        self,
        parent: str,
        driver: str,
        *,
        mode: Literal["continuable"] = ...,
        prompt: str | None = ...,
        data: dict[str, Any] | None = ...,
        slug: str | None = ...,
        config: dict[str, Any] | None = ...,
        permissions: Mapping[str, str] | None = ...,
        stall: dict[str, Any] | StallPolicy | None = ...,
        limits: dict[str, float] | None = ...,
        budget: dict[str, Any] | Budget | None = ...,
        on_crash: str | None = ...,
        max_recoveries: int | None = ...,
    ) -> str: ...

    @overload
    def spawn(
        self,
        parent: str,
        driver: str,
        *,
        mode: Literal["one-shot"],
        prompt: str | None = ...,
        data: dict[str, Any] | None = ...,
        slug: str | None = ...,
        config: dict[str, Any] | None = ...,
        permissions: Mapping[str, str] | None = ...,
        stall: dict[str, Any] | StallPolicy | None = ...,
        limits: dict[str, float] | None = ...,
        budget: dict[str, Any] | Budget | None = ...,
        on_crash: str | None = ...,
        max_recoveries: int | None = ...,
    ) -> OneShot: ...

    @overload
    def spawn(
        self,
        parent: str,
        driver: str,
        *,
        mode: str = ...,
        prompt: str | None = ...,
        data: dict[str, Any] | None = ...,
        slug: str | None = ...,
        config: dict[str, Any] | None = ...,
        permissions: Mapping[str, str] | None = ...,
        stall: dict[str, Any] | StallPolicy | None = ...,
        limits: dict[str, float] | None = ...,
        budget: dict[str, Any] | Budget | None = ...,
        on_crash: str | None = ...,
        max_recoveries: int | None = ...,
    ) -> str | OneShot: ...

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
        permissions: Mapping[str, str] | None = None,
        stall: dict[str, Any] | StallPolicy | None = None,
        limits: dict[str, float] | None = None,
        budget: dict[str, Any] | Budget | None = None,
        on_crash: str | None = None,
        max_recoveries: int | None = None,
    ) -> str | OneShot:
        """Spawn a subagent of ``parent``; ``prompt`` becomes its first message.

        Its permissions are ``parent``'s narrowed by ``permissions`` (semantics §6); without
        its own ``stall`` policy it inherits its parent's (semantics §14.5), and likewise its
        ``limits`` (semantics §15.5). Its own ``budget`` (semantics §16.2) must fit in what every
        budgeted ancestor has left (InvalidParams); under a tree whose budget is spent
        the spawn is refused with ``BudgetExhausted``. Without its own ``on_crash`` and
        ``max_recoveries`` (semantics §17.1) it inherits its parent's.
        """
        if mode not in _MODES:
            raise InvalidParams(f"mode must be one of {_MODES}, not {mode!r}")
        if mode == "one-shot" and prompt is None:
            raise InvalidParams("a one-shot subagent needs a prompt: it is its one task")
        if prompt is not None:
            check_message(prompt, data)
        if not isinstance(parent, str):
            raise InvalidParams("parent must be a session id")
        header = self._header(
            parent,
            driver,
            mode,
            slug,
            config,
            permissions,
            stall,
            limits,
            budget,
            on_crash,
            max_recoveries,
        )
        sid = self._create(Create(header, prompt, data, self._tel.current()))
        return OneShot(self, sid) if mode == "one-shot" else sid

    def send(
        self,
        target: str,
        content: str,
        *,
        authority: Authority,
        data: dict[str, Any] | None = None,
        wake: bool = True,
    ) -> str:
        """Append to a subagent's inbox (durable before this returns); ``wake`` starts it.

        Returns the new message's id.
        """
        check_authority(authority)
        check_message(content, data)
        return self._send(target, content, authority, data, bool(wake))

    @overload
    def interrupt(
        self,
        target: str,
        *,
        authority: Authority,
        kind: str = ...,
        reason: str = ...,
        grace: float | None = ...,
        deadline: float | None = ...,
        turn: str | None = ...,
        scope: Literal["session"] = ...,
    ) -> str | None: ...

    @overload
    def interrupt(
        self,
        target: str,
        *,
        authority: Authority,
        kind: str = ...,
        reason: str = ...,
        grace: float | None = ...,
        deadline: float | None = ...,
        turn: str | None = ...,
        scope: Literal["subtree"],
    ) -> list[str]: ...

    def interrupt(
        self,
        target: str,
        *,
        authority: Authority,
        kind: str = "cancel",
        reason: str = "",
        grace: float | None = None,
        deadline: float | None = None,
        turn: str | None = None,
        scope: str = "session",
    ) -> str | list[str] | None:
        """Authorize, issue, return at once: accepted means "signal issued" (semantics §5).

        Returns the id of the turn the signal was bound to, or None for an accepted
        no-op (no running turn, or ``turn`` given and no longer the running one). The
        stop lands on that turn and on no other (semantics §14.2).

        ``scope="subtree"`` (a ``cancel`` or an ``abort`` only) stops the running turn of
        ``target`` and of every continuable session below it, each bound to its own
        turn, and returns the list of their ids (``[]``: nothing was running). The
        authority is checked once, at the top, as for a subtree pause; ``turn`` guards
        the target's own turn only.
        """
        check_authority(authority)
        args = check_interrupt(scope, kind, reason, grace, deadline, turn)
        g = self.grace if args.grace is None else args.grace
        if scope == "subtree":
            return stop_subtree(
                self, target, authority, args.kind, cap(args.reason), g, args.deadline, args.turn
            )
        op = InterruptOp(
            target,
            authority,
            args.kind,
            cap(args.reason),
            g,
            args.deadline,
            args.turn,
            self._tel.current(),
        )
        return self._interrupt(op)

    def stop_report(self, turn: str) -> StopReport | None:
        """What the stop that reached ``turn`` did (semantics §15.6), durable; None when no
        stop reached it. While the turn still runs, the report says what is known so
        far (``effective_at`` and ``outcome`` None)."""
        if not isinstance(turn, str):
            raise InvalidParams("turn must be a turn id")
        self._check_open()
        return self._store.stop_report(turn)

    def budget(self, target: str) -> BudgetStatus:
        """The budget of ``target``'s tree (semantics §16.2): what the target and every session
        below it spent (``spent``: ``tokens``, ``cost_usd``, ``turn_seconds`` with running
        turns, ``turns`` started), its own ``limits`` and ``remaining``, and ``state``
        (``ok``, ``soft``, ``exhausted``: the tightest of its own budget and its
        ancestors'), with ``decided_by`` the session whose budget sets that state."""
        self._check_open()
        self._known(target)
        return self._gov.status(target, self._dir.catalog.lineage(target))

    def set_budget(
        self, target: str, budget: dict[str, Any] | Budget | None, *, authority: Authority
    ) -> None:
        """Set, change or (``None``) remove ``target``'s own budget, with the authority of
        an interrupt (semantics §6); durable before this returns. It must fit in what each
        budgeted ancestor has left (InvalidParams). A limit lowered to what the tree has
        spent acts at once (``on_hard``); one raised lifts the exhaustion, and parked work
        runs again on the next waking send (semantics §4)."""
        check_authority(authority)
        checked = check_budget(budget)
        self._check_open()
        check_id(target)
        self._dir.authorize_subtree(target, authority, what="set the budget of")
        self._store.check_writable()
        lineage = self._dir.catalog.lineage(target)
        self._gov.set_budget(target, lineage, checked).wait()
        log.info("budget.set", session=target, budget=None if checked is None else checked.limits())

    def pause(
        self,
        target: str,
        *,
        authority: Authority,
        scope: str = "session",
        reason: str = "",
        turn: str | None = None,
    ) -> list[str]:
        """Freeze the running turn of ``target`` (and, with ``scope="subtree"``, of every
        running descendant) in place; returns the ids of the turns frozen (semantics §14.4).

        While paused, sends queue, steers and cancels are held and delivered after
        ``resume``, and grace, deadline and watchdog clocks stop; an abort still kills
        the frozen tree at once. ``turn``: act only if that is still the target's
        running turn (as for ``interrupt``).
        """
        check_authority(authority)
        if not isinstance(reason, str):
            raise InvalidParams("reason must be a string")
        check_text("reason", reason)
        check_turn(turn)
        return self._pause(target, authority, scope, cap(reason), resume=False, turn=turn)

    def resume(self, target: str, *, authority: Authority, scope: str = "session") -> list[str]:
        """Thaw what ``pause`` froze; returns the ids of the turns resumed."""
        check_authority(authority)
        return self._pause(target, authority, scope, "", resume=True)

    def _pause(
        self,
        target: str,
        auth: Authority,
        scope: str,
        reason: str,
        *,
        resume: bool,
        turn: str | None = None,
    ) -> list[str]:
        if scope not in ("session", "subtree"):
            raise InvalidParams(f"scope must be 'session' or 'subtree', not {scope!r}")
        self._check_open()
        check_id(target)
        trace = self._tel.current()
        if scope == "session":
            op = PauseOp(target, auth, reason, resume, turn, trace)
            bound = self._dispatcher.ask(target, op)
            return [] if bound is None else [str(bound)]
        return pause_subtree(self, target, auth, reason, resume=resume, turn=turn, trace=trace)

    def list_agents(self, root: str, *, scope: str = "children") -> list[AgentInfo]:
        """One consistent pre-order walk below ``root`` (semantics §7), taken after the
        sessions' hosts have handled everything sent to them before this call."""
        if scope not in _SCOPES:
            raise InvalidParams(f"scope must be one of {_SCOPES}, not {scope!r}")
        self._check_open()
        self._dispatcher.sync()
        result: list[AgentInfo] = self._ask(ListReq(root, scope))
        return result

    def list_roots(self, *, before: str | None = None, limit: int = 100) -> list[AgentInfo]:
        """The root sessions, newest first, at most ``limit`` of them; ``before`` (a root's
        id, the last of the previous page) pages on to those created before it. Settled
        roots are listed too (their state says so). Exact as ``list_agents`` is."""
        if before is not None:
            check_id(before)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidParams(f"limit must be a positive integer, not {limit!r}")
        self._check_open()
        self._dispatcher.sync()
        result: list[AgentInfo] = self._ask(RootsReq(before, limit))
        return result

    def status(self, session_id: str) -> AgentInfo:
        """Exact as of the call: the session's host answers after what was sent before."""
        check_id(session_id)
        result: AgentInfo = self._dispatcher.ask(session_id, StatusOp(session_id))
        return result

    def wait(
        self,
        session_id: str,
        *,
        until: str | tuple[str, ...] = ("idle", "parked"),
        timeout: float = 10.0,
    ) -> AgentInfo:
        """Block until the session is in one of ``until``; TimeoutError after ``timeout``
        (seconds, ``math.inf`` for no limit)."""
        timeout = convert(timeout, Timeout, "timeout")
        states = (until,) if isinstance(until, str) else tuple(until)
        bad = [s for s in states if s not in STATES]
        if bad:
            raise InvalidParams(f"unknown state(s) {bad}")
        deadline = time.monotonic() + timeout
        bus = self._events
        with bus.watching():
            while True:
                seen = bus.seen()
                info = self.status(session_id)
                if info.state in states:
                    return info
                if not bus.changed_since(seen, deadline):
                    raise TimeoutError(
                        f"{session_id} is {info.state}, not {'/'.join(states)}, after {timeout:g}s"
                    )

    def transcript(
        self, session_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[Entry]:
        """Entries past seq ``after``, oldest first; at most ``limit`` of them."""
        self._known(session_id)
        return self._store.entries(session_id, after=after, limit=limit)

    def turns(self, session_id: str) -> list[TurnRecord]:
        self._known(session_id)
        return self._store.turns(session_id)

    def inbox(self, session_id: str) -> list[PendingMessage]:
        """The session's pending messages, oldest first (what its next turns will claim)."""
        self._known(session_id)
        return self._store.inbox(session_id)

    def agent_ref(self, session_id: str) -> AgentRef:
        """The session's current activation, to act as ``Ancestor(ref)``."""
        check_id(session_id)
        result: AgentRef = self._dispatcher.ask(session_id, RefOp(session_id))
        return result

    def release(self, session_id: str) -> None:
        """Take a session offline (dormant); its children stay live; old refs go stale."""
        self._check_open()
        check_id(session_id)
        self._dispatcher.ask(session_id, ReleaseOp(session_id))

    def dispose(self, session_id: str, *, authority: Authority, wait: bool = True) -> None:
        """End the session and its whole subtree, deepest first; returns when all settled
        (``wait=False``: once the disposal is accepted and under way)."""
        check_authority(authority)
        self._dispose(session_id, authority, wait=wait)

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event; it must not block. Returns unsubscribe."""
        return self._events.subscribe(callback)

    def close(self, *, turns: str = "cancel") -> None:
        """Drain: cancel running turns with grace, abort the rest, stop every process.

        ``turns="suspend"`` (semantics §17.1): a recoverable turn with no stop or pause
        in force is left open instead, its worker stopped, to recover at the next start
        on the store, as after a crash; ``tether serve`` closes so on SIGTERM."""
        if turns not in _CLOSE_TURNS:
            raise InvalidParams(f"turns must be one of {_CLOSE_TURNS}, not {turns!r}")
        if self._closed:
            return
        self._closed = True
        _at_exit.unregister(self)
        self._pool.drain()
        if turns == "suspend":
            suspended = [sid for ref in self._dispatcher.refs for sid in ref.ask(SuspendOp())]
            if suspended:
                log.warning("close.turns_suspended", sessions=len(suspended))
        try:
            # A frozen turn reaches no boundary: close aborts it (semantics §14.4).
            self._stop_all([sid for sid, paused in self._running() if paused], "abort", 0.0)
            self._stop_all(self._running(), "cancel", self.grace + 1.0)
            self._stop_all(self._running(), "abort", _ABORT_WAIT)  # a cancel stuck earlier
            for sid, _ in self._running():
                log.error("close.turn_survived", session=sid)
        finally:
            self._shutdown()

    def _stop_all(self, running: list[Any], kind: Kind, timeout: float) -> None:
        """Stop every turn in ``sessions`` (a cancel escalates after ``grace`` with no
        boundary) and wait up to ``timeout`` for them to end."""
        sessions = [r[0] if isinstance(r, tuple) else r for r in running]
        for sid in sessions:
            self._interrupt(
                InterruptOp(sid, Host(), kind, "the runtime is closing", self.grace, self.grace)
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

    def _create(self, create: Create) -> str:
        self._store.check_writable()  # refused before anything changes while it is down
        h = create.header
        lineage: tuple[str, ...] = ()
        if h.parent is not None:
            self._known(h.parent)
            lineage = (*self._dir.catalog.lineage(h.parent), h.parent)
        # BudgetExhausted, or a budget that does not fit: refused before anything is
        # recorded; one that fits is in force before the child's first turn can start.
        self._gov.admit(h.id, lineage, h.budget)
        try:
            sid, ticket = self._ask(create)
        except BaseException:
            self._gov.forget(h.id)
            raise
        ticket.wait()
        return str(sid)

    def _send(
        self,
        target: str,
        content: str,
        authority: Authority | None,
        data: dict[str, Any] | None,
        wake: bool,
    ) -> str:
        """The fast path: authorize here, make the message durable here, then tell the
        target's host, which queues it (see ``Enqueued`` for the races it settles)."""
        self._check_open()
        check_id(target)
        self._dir.authorize_send(target, authority)
        msg, ticket = self._store.append_message(
            target,
            content,
            data=data,
            sender=sender_of(authority),
            refusable=True,
            trace=self._tel.current(),
        )
        ticket.wait()  # StoreUnavailable: withdrawn, never committed, never told
        # A send that wakes a dormant session makes it live for every later call, though
        # its host materializes it a moment later (semantics §15.8: a send to its child with
        # its address must not find it offline).
        waking = wake and target not in self._dir.registry
        if waking:
            self._dir.waking(target)
        self._dispatcher.tell(target, Enqueued(msg, wake, waking))
        if _stdlib_log.isEnabledFor(logging.DEBUG):  # a log call costs as much as the send
            log.debug("message.accepted", session=target, message=msg.id, wake=wake)
        return msg.id

    def _interrupt(self, op: InterruptOp) -> str | None:
        check_id(op.target)
        turn: str | None = self._dispatcher.ask(op.target, op)
        return turn

    def _dispose(self, session_id: str, authority: Authority | Host, *, wait: bool = True) -> None:
        check_id(session_id)
        order, ticket = self._ask(DisposeReq(session_id, authority, self.grace))
        if ticket is not None:
            ticket.wait()  # accepted once durable: a host kill from here on is finished
        if not wait:
            return
        deadline = time.monotonic() + 2 * self.grace + 10.0
        for sid in order:
            self.wait(sid, until="settled", timeout=max(deadline - time.monotonic(), 0.01))

    def _known(self, session_id: str) -> None:
        check_id(session_id)
        if session_id not in self._dir.catalog.nodes:
            raise NotFound(f"no session {session_id!r}")

    def _header(
        self,
        parent: str | None,
        driver: str,
        mode: str,
        slug: str | None,
        config: dict[str, Any] | None,
        permissions: Mapping[str, str] | None,
        stall: dict[str, Any] | StallPolicy | None = None,
        limits: dict[str, float] | None = None,
        budget: object = None,
        on_crash: str | None = None,
        max_recoveries: int | None = None,
    ) -> SessionHeader:
        checked_limits = None
        if limits is not None:
            checked_limits = check_enforceable(
                limits, self._cgroups, self.containment, self._cgroup_reason
            )
        checked_budget = check_budget(budget)
        check_driver(driver)
        check_slug(slug)
        perms = check_settings(config, permissions)
        policy = None if stall is None else check_stall(stall)
        if parent is not None and parent in self._dir.catalog.nodes:  # else NotFound later
            above = self._dir.catalog.nodes[parent].header
            crash_policy = (above.on_crash, above.max_recoveries)
        else:
            crash_policy = (self._on_crash, self._max_recoveries)
        crash, most = check_recovery(on_crash, max_recoveries, crash_policy)
        self._secrets.learn(config)  # from now on no worker's tool sees the keys it names
        recoverable = self._pool.probe(driver, config)
        return SessionHeader(
            id=new_id("s_"),
            parent=parent,
            mode="one-shot" if mode == "one-shot" else "continuable",  # checked by the caller
            slug=slug,
            driver=driver,
            config=config,
            permissions=perms,
            created_at=time.time(),
            stall=policy,
            limits=checked_limits,
            budget=checked_budget,
            on_crash=crash,
            max_recoveries=most,
            recoverable=recoverable,
            spawned_by=spawning.get(),  # set by a spawn_agent tool call (HostTools)
        )
