"""The public ``Runtime`` facade (semantics §12): one embedded host.

It owns the store, the worker pool, the timer queue, the supervisor actor and the
dispatcher's session hosts. Every call validates its input first (bad input raises a
typed error and changes nothing: ``_checks``), then asks the one actor that decides: the
supervisor for the tree (spawn, dispose, list), the session's host for everything about
one session (send, interrupt, status, release).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, overload

import pykka
import structlog

from tether.actors._ids import new_id
from tether.actors._timers import TimerQueue
from tether.actors.authority import Authority, Host, sender_of
from tether.actors.budget import Governor, StateStep, Step, TurnStep
from tether.actors.directory import Directory
from tether.actors.host import (
    Dispatcher,
    Enqueued,
    InterruptOp,
    PauseOp,
    RefOp,
    ReleaseOp,
    RunningOp,
    SessionHost,
    StatusOp,
)
from tether.actors.ports import Executor
from tether.actors.supervisor import (
    Create,
    DisposeReq,
    ListReq,
    Recover,
    RootsReq,
    SupervisorActor,
    Walk,
    crash_notice,
)
from tether.contain.cgroup import Cgroups, CgroupUnavailable
from tether.contain.prctl import set_subreaper
from tether.runtime import _at_exit
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
from tether.runtime._tools import HostTools
from tether.runtime.backend import (
    Backend,
    BackendFactory,
    check_backend,
    make_backend,
)
from tether.runtime.store import Store
from tether.telemetry import WORKER_MODULES, Telemetry
from tether.telemetry import make as make_telemetry
from tether.telemetry import resolve as resolve_telemetry
from tether.wire.budget import Budget, BudgetStatus, check_budget
from tether.wire.errors import InvalidParams, NotFound, TetherError
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
from tether.wire.vocab import (
    MAX_SECONDS,
    Grace,
    Kind,
    Seconds,
    StallPolicy,
)

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
_HOSTS = 4  # session-hosting actors: enough that one busy host does not hold up others


class Runtime:
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
        that user can read."""
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
        self._tel: Telemetry = make_telemetry(resolve_telemetry(telemetry))
        containment = check_containment(containment)
        self.grace = grace
        self.cancel_deadline: float = cancel_deadline
        self._closed = False
        self._events = EventBus()
        catalog = self._open_store(path, containment, backend)
        for header in catalog:  # before a worker starts: none inherits a key they name
            self._secrets.learn(header.config)
        self._open_backend(backend, workers, containment, ray_address, ray_options, tool_user)
        self._open_hosts(catalog)
        # Only a process's own runtimes close at its exit: a forked child's copy does not.
        self._pid = os.getpid()
        _at_exit.register(self)

    # ---- the start, step by step: a start that fails gives back all it holds ----

    def _open_store(
        self,
        path: str | os.PathLike[str] | None,
        containment: str,
        backend: str | BackendFactory,
    ) -> list[SessionHeader]:
        """The store, recovered, then the containment and the directory; the catalog as
        recovery left it."""
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            _private_file(os.fspath(path))
        # One host per store: a store another live host holds is refused here
        # (StoreLocked), before anything in it is read or changed.
        self._store = Store(None if path is None else os.fspath(path))
        try:
            catalog = self._recover_store()
            self._open_containment(containment, backend, None if path is None else os.fspath(path))
            self._dir = Directory(self._store.boot())
        except BaseException:
            self._release_start()
            raise
        return catalog

    def _recover_store(self) -> list[SessionHeader]:
        """What a dead host left in the store, settled; the catalog after it."""
        # a disposal the dead host had accepted and not finished: finished now, so
        # the catalog and the crashed turns' notices below see it settled
        disposed = self._store.finish_disposals()
        if disposed:
            log.warning("recovery.disposals_finished", sessions=len(disposed))
        # the catalog as the dead host left it; its open turns closed, and their
        # parents told, in one commit
        catalog = self._store.sessions()
        headers = {h.id: h for h in catalog}
        crashed = self._store.recover(functools.partial(crash_notice, headers))
        if crashed:
            log.warning("recovery.crashed_turns", turns=len(crashed))
        return catalog

    def _open_containment(
        self, containment: str, backend: str | BackendFactory, path: str | None
    ) -> None:
        """The cgroup group for ``containment`` (none for the walk, with the reason when
        none is available); ``self.containment`` says which is in force."""
        self._cgroups: Cgroups | None = None
        self._cgroup_reason = ""
        try:
            self._cgroups = _containment(containment, backend, path)
        except CgroupUnavailable as exc:
            self._cgroup_reason = str(exc)
            if containment == "cgroup":
                raise InvalidParams(f"cgroup containment is not available: {exc}") from None
        self.containment = "walk" if self._cgroups is None else "cgroup"

    def _open_backend(
        self,
        backend: str | BackendFactory,
        workers: int,
        containment: str,
        ray_address: str | None,
        ray_options: dict[str, Any] | None,
        tool_user: str | None,
    ) -> None:
        """The timers, the dispatcher, and the backend with its workers."""
        self._timers = TimerQueue()
        self._dispatcher = Dispatcher(_HOSTS)
        try:
            self._pool: Backend = make_backend(
                backend,
                workers,
                HostTools(self, self._secrets, tool_user),
                ray_address=ray_address,
                ray_options=ray_options,
                cgroups=self._cgroups,
                containment=containment,
                preload=WORKER_MODULES if self._tel.on else (),
            )
        except BaseException:  # workers that fail to start: release all we hold
            self._dispatcher.close()
            self._timers.close()
            self._release_start()
            raise
        if backend == "ray":  # what the slots' nodes gave
            self.containment = str(getattr(self._pool, "containment", "walk"))

    def _open_hosts(self, catalog: list[SessionHeader]) -> None:
        """The budget governor, the session hosts and the supervisor, then the tree
        recovered over ``catalog``."""
        # A turn reaches a worker only once its claim is durable: the turn table holds
        # it until then (docs/design.md, section 4).
        executor: Executor = self._pool
        self._gov = Governor(
            store=self._store,
            act=self._budget_step,
            subtree=self._below,
            arm=self._timers.after,
        )
        self._store.take_usage_from(self._gov.take_usage)
        try:
            for _ in range(_HOSTS):
                self._dispatcher.refs.append(
                    SessionHost.start(
                        directory=self._dir,
                        dispatcher=self._dispatcher,
                        store=self._store,
                        executor=executor,
                        events=self._events,
                        timers=self._timers,
                        grace=self.grace,
                        cancel_deadline=self.cancel_deadline,
                        telemetry=self._tel,
                        governor=self._gov,
                    )
                )
            self._sup = SupervisorActor.start(
                store=self._store,
                executor=executor,
                directory=self._dir,
                dispatcher=self._dispatcher,
            )
            self._recover_tree(catalog)
        except BaseException:
            self._shutdown()
            raise

    def _recover_tree(self, catalog: list[SessionHeader]) -> None:
        """The sessions of ``catalog`` back in the tree (every root parked), and their
        budgets in force."""
        self._sup.ask(Recover(catalog))
        # The budgets, over the catalog just loaded: in force before this returns,
        # so before any waking send can start a turn (every root is parked).
        self._gov.restore((h.id, h.budget) for h in catalog if h.budget and not h.settled)

    def _release_start(self) -> None:
        """A start that failed: give back the store (and its lock) and the cgroups."""
        cgroups: Cgroups | None = getattr(self, "_cgroups", None)
        if cgroups is not None:
            cgroups.close()
        self._store.close()
        self._tel.close()

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
    ) -> str:
        """Open a root session; its owner prompts it with ``prompt``.

        ``stall``: the stall watchdog's policy (see ``check_stall``). ``limits``: each
        turn's ``memory_mb``, ``pids`` and ``cpu`` (cores), enforced by the turn's cgroup
        (semantics §15.5); one the kernel cannot enforce here is InvalidParams. ``budget``:
        the tree's budget (semantics §16.2, ``tether.Budget`` or its dict), see ``set_budget``.
        """
        header = self._header(
            None, driver, "continuable", slug, config, permissions, stall, limits, budget
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
    ) -> str | OneShot:
        """Spawn a subagent of ``parent``; ``prompt`` becomes its first message.

        Its permissions are ``parent``'s narrowed by ``permissions`` (semantics §6); without
        its own ``stall`` policy it inherits its parent's (semantics §14.5), and likewise its
        ``limits`` (semantics §15.5). Its own ``budget`` (semantics §16.2) must fit in what every
        budgeted ancestor has left (InvalidParams); under a tree whose budget is spent
        the spawn is refused with ``BudgetExhausted``.
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
            parent, driver, mode, slug, config, permissions, stall, limits, budget
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
            return self._interrupt_subtree(
                target, authority, args.kind, cap(args.reason), g, args.deadline, args.turn
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

    def _interrupt_subtree(
        self,
        target: str,
        auth: Authority,
        kind: Kind,
        reason: str,
        grace: float,
        deadline: float | None,
        turn: str | None,
    ) -> list[str]:
        """Stop every running turn from ``target`` down, top first (so a stopped parent
        is parked before its children's turn-end notices reach it)."""
        self._check_open()
        check_id(target)
        self._dir.authorize_subtree(target, auth, what="stop")
        # Authorized at the top: below it, the same person or ancestor acts on each.
        delegate = Host(auth.origin, auth.by)
        nodes = self._dir.catalog.nodes
        turns: list[str] = []
        trace = self._tel.current()
        # The subtree as of the mark; a spawn below it is refused until the walk ends.
        ids: list[str] = self._ask(Walk(target, "stopped", on=True))
        try:
            for sid in ids:
                node = nodes.get(sid)
                if node is None or node.header.mode == "one-shot":
                    continue  # a one-shot belongs to its handle's holder, not to the subtree
                guard = turn if sid == target else None  # the guard names the target's turn
                op = InterruptOp(sid, delegate, kind, reason, grace, deadline, guard, trace)
                bound = self._dispatcher.ask(sid, op)
                if bound is not None:
                    turns.append(str(bound))
        finally:
            self._walk_end(target, "stopped")
        return turns

    def _walk_end(self, target: str, what: str) -> None:
        """Spawns below ``target`` land again; a runtime closed meanwhile has no tree."""
        with contextlib.suppress(pykka.ActorDeadError):
            self._sup.ask(Walk(target, what, on=False))

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

    def _budget_step(self, step: Step) -> None:
        """The governor's step, to the host of the session it is for; a state change is
        an event (``budget``, data ``{"state"}``) for observers (the console's bar)."""
        match step:
            case StateStep(session=session, state=state):
                if self._events.wants("budget") and session in self._dir.catalog.nodes:
                    lineage = self._dir.catalog.lineage(session)
                    self._events.emit("budget", session, lineage, {"state": state})
            case TurnStep(session=session):
                self._dispatcher.tell(session, step)

    def _below(self, session: str) -> list[str]:
        """Every session below ``session`` (none for one not in the catalog yet)."""
        if session not in self._dir.catalog.nodes:
            return []
        return self._dir.catalog.preorder(session)

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
        self._dir.authorize_subtree(target, auth)
        # Authorized at the top: below it, the same person or ancestor acts on each.
        # A one-shot belongs to its handle's holder and is absent to every continuable
        # path: a subtree pause passes it by (its holder's result() must not hang).
        delegate = Host(auth.origin, auth.by)
        nodes = self._dir.catalog.nodes
        turns: list[str] = []
        if resume:  # a child spawned meanwhile was never paused: nothing to hold off
            ids = [target, *self._dir.catalog.preorder(target)]
        else:  # as for a subtree stop: what the mark read; no spawn below until the end
            ids = self._ask(Walk(target, "paused", on=True))
        try:
            for sid in ids:
                if nodes[sid].header.mode == "one-shot":
                    continue
                guard = turn if sid == target else None  # the guard names the target's turn
                op = PauseOp(sid, delegate, reason, resume, guard, trace)
                bound = self._dispatcher.ask(sid, op)
                if bound is not None:
                    turns.append(str(bound))
        finally:
            if not resume:
                self._walk_end(target, "paused")
        return turns

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

    def close(self) -> None:
        """Drain: cancel running turns with grace, abort the rest, stop every process."""
        if self._closed:
            return
        self._closed = True
        _at_exit.unregister(self)
        self._pool.drain()
        try:
            # A frozen turn reaches no boundary: close aborts it (semantics §14.4).
            self._stop_all([sid for sid, paused in self._running() if paused], "abort", 0.0)
            self._stop_all(self._running(), "cancel", self.grace + 1.0)
            self._stop_all(self._running(), "abort", _ABORT_WAIT)  # a cancel stuck earlier
            for sid, _ in self._running():
                log.error("close.turn_survived", session=sid)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._pool.close()
        if self._cgroups is not None:
            self._cgroups.close()
        for ref in [*self._dispatcher.refs, *([self._sup] if hasattr(self, "_sup") else [])]:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop()
        self._dispatcher.close()
        self._timers.close()
        self._store.close()
        self._tel.close()  # after the actors: the last turns' spans have ended

    def _running(self) -> list[tuple[str, bool]]:
        """(session, paused) for every session with a turn claimed."""
        out: list[tuple[str, bool]] = []
        for ref in self._dispatcher.refs:
            running: Any = ref.ask(RunningOp())
            out.extend(running)
        return out

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

    def _check_open(self) -> None:
        if self._closed:
            raise TetherError("the runtime is closed")

    def _ask(self, message: Any) -> Any:
        self._check_open()
        return self._sup.ask(message)

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
        self._secrets.learn(config)  # from now on no worker's tool sees the keys it names
        self._pool.probe(driver, config)
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
        )


def _private_file(path: str) -> None:
    """A new store readable by its owner alone (SQLite gives its journal the same mode):
    it holds every tree's transcripts, which a tool run as another user must not read
    (semantics §17.4)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _containment(mode: str, backend: object, path: str | None) -> Cgroups | None:
    """The host's cgroup group for ``mode``, or None for the walk. CgroupUnavailable
    says why none is available."""
    if mode == "walk":
        if path is not None:  # a previous host on this store may have used cgroups
            Cgroups.recover_existing(path)
        return None
    if backend == "ray":
        return None  # each Ray slot makes its own group on its node (see _ray_actors)
    if backend != "local":
        raise CgroupUnavailable("cgroup containment runs on the local and Ray backends only")
    return Cgroups.open(path)
