"""What a ``Runtime`` owns, and the order it opens and gives it back in: ``Engine``.

The store (recovered first), the containment, the directory, the timers, the dispatcher,
the backend with its workers, the budget governor, the session hosts and the supervisor,
each opened by a named step (docs/design.md, section 9); a start that fails gives back
all it holds. ``Runtime`` (``runtime.py``) is this plus the public methods, their checks
and ``close``; the walks of a subtree are ``_walks``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import pykka
import structlog

from tether.actors._timers import TimerQueue
from tether.actors.budget import Governor, StateStep, Step, TurnStep
from tether.actors.directory import Directory
from tether.actors.host import Dispatcher, RunningOp, SessionHost, SyncOp
from tether.actors.ports import Executor, Keep, KeptTurn
from tether.actors.supervisor import Recover, RecoverKept, SupervisorActor, crash_notice
from tether.contain.cgroup import Cgroups, CgroupUnavailable
from tether.runtime._events import EventBus
from tether.runtime._secrets import Secrets
from tether.runtime.backend import Backend, BackendFactory, WorkerHost, make_backend
from tether.runtime.store import Store
from tether.telemetry import WORKER_MODULES, Telemetry
from tether.wire.errors import InvalidParams, TetherError
from tether.wire.records import SessionHeader

__all__ = ["Engine"]

log = structlog.get_logger("tether.runtime")

_HOSTS = 4  # session-hosting actors: enough that one busy host does not hold up others


class Engine:
    """The parts of one runtime, and the steps that open and close them."""

    # Set by ``Runtime.__init__`` before the first step.
    grace: float
    cancel_deadline: float
    _closed: bool
    _events: EventBus
    _secrets: Secrets
    _tel: Telemetry
    # Set by the steps, in this order.
    _store: Store
    _cgroups: Cgroups | None
    _cgroup_reason: str
    containment: str
    _dir: Directory
    _timers: TimerQueue
    _dispatcher: Dispatcher
    _pool: Backend
    _gov: Governor
    _sup: pykka.ActorRef[SupervisorActor]

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

        def keep(session: str, recoveries: int) -> Keep:
            h = headers.get(session)
            if h is None or not h.recoverable or h.on_crash != "recover" or h.settled:
                return "end"
            return "recover" if recoveries < h.max_recoveries else "exhausted"

        self._kept: list[KeptTurn]
        crashed, self._kept = self._store.recover(functools.partial(crash_notice, headers), keep)
        if crashed:
            log.warning("recovery.crashed_turns", turns=len(crashed))
        if self._kept:
            log.warning("recovery.turns_kept", turns=len(self._kept))
        return catalog

    def _open_containment(
        self, containment: str, backend: str | BackendFactory, path: str | None
    ) -> None:
        """The cgroup group for ``containment`` (none for the walk, with the reason when
        none is available); ``self.containment`` says which is in force."""
        self._cgroups = None
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
        tools: WorkerHost,
    ) -> None:
        """The timers, the dispatcher, and the backend with its workers (``tools``
        answers their tool calls)."""
        self._timers = TimerQueue()
        self._dispatcher = Dispatcher(_HOSTS)
        try:
            self._pool = make_backend(
                backend,
                workers,
                tools,
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
        running = frozenset(k.session for k in self._kept)
        self._sup.ask(Recover(catalog, running))
        # The budgets, over the catalog just loaded (a tree's spent is its sessions'):
        # in force before this returns, so before any waking send can start a turn
        # (every root is parked), and before a turn the dead host left open recovers.
        self._gov.restore((h.id, h.budget) for h in catalog if h.budget and not h.settled)
        if self._kept:  # each kept turn claimed (its recovery counted) before this returns
            self._sup.ask(RecoverKept(self._kept))
            for ref in self._dispatcher.refs:
                ref.ask(SyncOp())
            self._store.flush()

    def _release_start(self) -> None:
        """A start that failed: give back the store (and its lock) and the cgroups."""
        cgroups: Cgroups | None = getattr(self, "_cgroups", None)
        if cgroups is not None:
            cgroups.close()
        self._store.close()
        self._tel.close()

    # ---- the governor's callbacks -------------------------------------------------------

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

    # ---- running, and the end -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TetherError("the runtime is closed")

    def _ask(self, message: Any) -> Any:
        self._check_open()
        return self._sup.ask(message)

    def _running(self) -> list[tuple[str, bool]]:
        """(session, paused) for every session with a turn claimed."""
        out: list[tuple[str, bool]] = []
        for ref in self._dispatcher.refs:
            running: Any = ref.ask(RunningOp())
            out.extend(running)
        return out

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
