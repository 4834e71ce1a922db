"""The Ray backend: the same turns and the same interrupt contract, on Ray (the runtime's
side: the slots behind the shared turn table, a thread per turn's stream, aborts through
the node's reaper actor). How it works: docs/design.md, section 11.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import psutil
import structlog

from tether.actors.ports import TurnSpec
from tether.runtime.backends._turns import (
    DriverChecks,
    TableBackend,
    TurnTable,
    WorkerGone,
    WorkerHost,
)
from tether.wire.codec import MAX_FRAME
from tether.wire.errors import FrameError, InvalidParams, TetherError
from tether.wire.frames import HostFrame, ProbeReply, RunTurn, WorkerFrame

__all__ = ["RayBackend", "ensure_ray", "ray_stdout_to_stderr", "shutdown_ray"]

log = structlog.get_logger("tether.ray")

_START_TIMEOUT = 60.0  # a slot actor (a Ray worker process) to start and report
_CALL_TIMEOUT = 10.0  # a control call on a live slot or reaper
_ABORT_TIMEOUT = 2.0
_KEEPER_WAIT = 2.0  # at close, for the keepers of ours to exit (they sweep, then exit)
_GUARD_WAIT = 10.0  # for the guard of a Ray we started to exit, once Ray is shut down
_init_lock = threading.Lock()
_guard: subprocess.Popen[bytes] | None = None  # see _ray_guard


def _ray() -> Any:
    import ray  # the optional extra tether-runtime[ray]: imported only when this backend is used

    return ray


@contextlib.contextmanager
def ray_stdout_to_stderr() -> Iterator[None]:
    """Ray prints to stdout (and so do the processes it starts), even with
    ``log_to_driver=False``: point file descriptor 1 at stderr meanwhile, so that
    ``tether serve``'s and the CLI's stdout stay clean. Processes started here (Ray's
    own daemons) keep stderr as their stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def ensure_ray(
    address: str | None = None,
    *,
    runtime_env: dict[str, Any] | None = None,
    init_options: dict[str, Any] | None = None,
) -> bool:
    """Connect to (or start) Ray unless this process already is a driver; True when
    this call did it (and the caller should ``ray.shutdown()`` at the end)."""
    ray = _ray()
    with _init_lock:
        if ray.is_initialized():
            return False
        # Ray logs the refs it never saw fetched (our fire-and-forget sends) on stderr.
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
        options: dict[str, Any] = {
            "address": address,
            "log_to_driver": False,
            "include_dashboard": False,
            "logging_level": logging.WARNING,
            "runtime_env": runtime_env,
        }
        options.update(init_options or {})
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        with ray_stdout_to_stderr():
            ray.init(**options)
        _errors_to_stderr()
        _guard_started_ray(before)
        return True


def shutdown_ray() -> None:
    """``ray.shutdown()``, then let the guard of a Ray this host started go."""
    global _guard
    with _init_lock:
        with ray_stdout_to_stderr():
            _ray().shutdown()
        guard, _guard = _guard, None
    if guard is not None:
        assert guard.stdin is not None
        guard.stdin.close()  # EOF: it kills whatever of that Ray outlived the shutdown
        with contextlib.suppress(subprocess.TimeoutExpired):
            guard.wait(_GUARD_WAIT)


def _guard_started_ray(before: set[int]) -> None:
    """If ``ray.init`` started a local Ray, its daemons are our new descendants: start
    the guard that kills them when this process dies (see ``_ray_guard``)."""
    global _guard
    daemons = []
    for p in psutil.Process().children(recursive=True):
        if p.pid not in before:
            with contextlib.suppress(psutil.Error):
                daemons.append(f"{p.pid}:{p.create_time()!r}")
    if daemons:
        _guard = subprocess.Popen(
            [sys.executable, "-m", "tether.runtime.backends._ray_guard", *daemons],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # out of the group that Ray's own reaper kills
        )


def _driver_node() -> str | None:
    """The Ray node this process (the driver) is on; None where Ray cannot say (a
    Ray Client driver is on no node)."""
    try:
        return str(_ray().get_runtime_context().get_node_id())
    except Exception:
        return None


def _node_alive(node: str) -> bool:
    """Whether Ray still counts ``node`` as alive (True when it cannot tell)."""
    try:
        return any(n.get("NodeID") == node and n.get("Alive") for n in _ray().nodes())
    except Exception:
        return True


def _errors_to_stderr() -> None:
    """Ray's driver prints the errors it hears of (a worker that died, say) to
    ``sys.stdout``; send them to stderr, where a host's diagnostics belong."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:  # pragma: no cover - a Ray without that module prints nothing
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_tether", False):
        return

    def to_stderr(data: dict[str, Any], ignore_prefix: bool) -> None:
        original({**data, "is_err": True}, ignore_prefix)

    to_stderr._tether = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = to_stderr


class _Slot:
    """The host's view of one slot actor, and the turn table's driver of it."""

    def __init__(self, backend: RayBackend, actor: Any) -> None:
        self.backend = backend
        self.actor = actor
        self.pid = 0  # the actor's process (on its node)
        self.node = ""
        self.child: int | None = None  # the turn child's pid (on that node)
        self.token = ""
        self.keeper: int | None = None  # the child's keeper (see _ray_child), on that node
        self.leaf: str | None = None  # the child's cgroup leaf (cgroup containment), on that node
        self.containment = "walk"
        self.cgroup_error: str | None = None
        self.turn: str | None = None  # the turn it runs (or ran last)
        self.seq = 0  # the next host→worker frame number of the current turn
        self.killing = False  # its tree is being killed: no turn until it restarted
        self.stream_done = threading.Event()
        self.lost = False
        self.frozen: list[int] = []  # the escapees its turn's pause stopped

    def update(self, info: dict[str, Any]) -> None:
        self.pid = int(info["pid"])
        self.node = str(info["node"])
        self.child = None if info["child"] is None else int(info["child"])
        self.token = str(info["token"] or "")
        self.keeper = None if info.get("keeper") is None else int(info["keeper"])
        self.leaf = info.get("leaf")
        self.containment = str(info.get("containment") or "walk")
        self.cgroup_error = info.get("cgroup_error")

    # ---- the turn table's Worker (start, post, kill under the backend's lock) ---------

    def start(self, spec: TurnSpec, run: RunTurn, rest: list[HostFrame]) -> None:
        encode = self.backend.encode
        start = encode(run)
        pending = [encode(f) for f in rest]
        self.turn = spec.turn
        self.seq = len(pending)
        self.frozen = []
        self.stream_done.clear()
        threading.Thread(
            target=self.backend._stream,
            args=(self, spec, start, pending),
            name=f"tether-ray-turn-{spec.turn}",
            daemon=True,
        ).start()

    def post(self, frame: HostFrame, *, bounded: bool) -> None:
        """Numbered, so the slot hands them on in issue order (Ray runs an actor's calls
        of different concurrency groups in no particular order)."""
        payload = self.backend.encode(frame)
        seq, self.seq = self.seq, self.seq + 1
        with contextlib.suppress(Exception):  # a lost slot: its stream reports the turn
            self.actor.send.remote(self.turn, seq, payload)

    def kill(self) -> None:
        self.killing = True
        threading.Thread(
            target=self.backend._abort, args=(self, self.turn), name="tether-ray-abort", daemon=True
        ).start()

    def turn_over(self, spec: TurnSpec) -> dict[str, float] | None:
        self.frozen = []
        return None

    def breached(self) -> bool:
        return False  # the Ray backend applies no limits (semantics §15.5 limits are the pool's)

    def freeze(self, turn: str) -> None:
        backend = self.backend
        with backend._lock:
            if self.killing or self.child is None or not backend.turns.runs_locked(self, turn):
                return
            child, leaf, reaper = self.child, self.leaf, backend._reaper_locked(self.node)
        try:
            escapees = _ray().get(reaper.freeze.remote(child, leaf), timeout=_CALL_TIMEOUT)
        except Exception as exc:
            raise TetherError(f"could not freeze the turn on its Ray node: {exc}") from None
        with backend._lock:
            self.frozen = list(escapees)

    def thaw(self, turn: str) -> None:
        backend = self.backend
        with backend._lock:
            if self.child is None or not backend.turns.runs_locked(self, turn):
                return
            escapees, self.frozen = self.frozen, []
            child, leaf, reaper = self.child, self.leaf, backend._reaper_locked(self.node)
        with contextlib.suppress(Exception):
            _ray().get(reaper.thaw.remote(child, escapees, leaf), timeout=_CALL_TIMEOUT)


class RayBackend(TableBackend[_Slot]):
    """``size`` Ray actor slots plus ``spare`` warm ones; FIFO dispatch across sessions.

    Settings: ``address`` (the cluster; None starts a local one, unless this process
    is already a Ray driver), ``slot_options`` (Ray actor options for each slot, e.g.
    ``{"num_cpus": 1}`` or ``{"resources": {...}}``; default ``num_cpus=0`` and
    ``scheduling_strategy="SPREAD"``), ``runtime_env`` and ``init_options`` (passed to
    ``ray.init`` when this backend starts or joins Ray), ``abort_timeout`` (seconds an
    abort waits for the reaper before ``ray.kill``, and for a slot to answer before it
    is replaced), ``spare`` (warm slots beyond ``size``, default 1: each holds its
    ``slot_options`` resources while it waits, so 0 suits a slot that claims a GPU; a
    lost slot is then replaced cold, in seconds), ``containment`` (``"walk"``, ``"auto"``
    or ``"cgroup"``: each slot's turn in a cgroup leaf of its node, killed with
    ``cgroup.kill``; ``"cgroup"`` refuses a node that has none, ``"auto"`` walks there).
    """

    def __init__(
        self,
        size: int,
        host: WorkerHost,
        *,
        address: str | None = None,
        slot_options: dict[str, Any] | None = None,
        runtime_env: dict[str, Any] | None = None,
        init_options: dict[str, Any] | None = None,
        abort_timeout: float = _ABORT_TIMEOUT,
        spare: int = 1,
        containment: str = "walk",
    ) -> None:
        if size < 1:
            raise ValueError("a backend needs at least one worker")
        if spare < 0:
            raise ValueError("spare must be 0 or more")
        ray = _ray()
        from tether.runtime.backends import _ray_actors

        self.size = size
        self.spare = spare
        self._containment = containment
        self._refused: str | None = None  # why a node cannot give cgroup containment
        self.abort_timeout = float(abort_timeout)
        self._owns_ray = ensure_ray(address, runtime_env=runtime_env, init_options=init_options)
        self._node = _driver_node()
        self._keepers: set[int] = set()  # our children: see _adopt_keeper
        self._actors = _ray_actors
        options: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
        options.update(slot_options or {})
        options.update(max_restarts=0, max_task_retries=0)  # never run claimed work twice
        self._slot_cls = ray.remote(concurrency_groups={"turn": 1, "ctl": 1, "check": 1})(
            _ray_actors.Slot
        ).options(**options)
        self._reaper_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)(
            _ray_actors.Reaper
        )
        self._decoder = msgspec.msgpack.Decoder(WorkerFrame)
        self._encoder = msgspec.msgpack.Encoder()
        # the turns, and the lock under which they and the slots change together
        self.turns: TurnTable[_Slot] = TurnTable(host, self._idle_locked)
        self._lock = self.turns.lock
        self._changed = self.turns.changed
        self._active: list[_Slot] = []
        self._spares: deque[_Slot] = deque()
        self._all: set[_Slot] = set()
        self._starting = 0
        self._failures = 0
        self._reapers: dict[str, Any] = {}
        self._checks = DriverChecks()
        try:
            with self._lock:
                for _ in range(size + spare):
                    self._start_slot_locked()
                deadline = time.monotonic() + _START_TIMEOUT
                while len(self._active) < size or len(self._spares) < spare:
                    left = deadline - time.monotonic()
                    if self._refused is not None:
                        raise InvalidParams(f"cgroup containment is not available: {self._refused}")
                    if self._failures >= 3:
                        raise TetherError("Ray slots fail to start (see the Ray logs)")
                    if left <= 0:
                        raise TetherError("Ray slots did not start in time")
                    self._changed.wait(left)
                reapers = list(self._reapers.values())
            # an abort must not wait for a reaper to start: they answer once before we do
            ray.get([r.node.remote() for r in reapers], timeout=_START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    # ---- what the Runtime needs besides ---------------------------------------------

    @property
    def containment(self) -> str:
        """``"cgroup"`` when every slot's turns run in cgroup leaves, else ``"walk"``."""
        with self._lock:
            slots = list(self._all)
        return "cgroup" if slots and all(s.containment == "cgroup" for s in slots) else "walk"

    def probe(self, driver: str, config: dict[str, Any] | None = None) -> bool:
        """A slot's idle child imports ``driver`` (the host never runs driver code): a
        spare's, else an idle slot's, else (every slot busy, ``spare=0``) a new process
        beside a busy slot's turn."""
        return self._checks.check(driver, config, self._probe_slot)

    def _probe_slot(self, driver: str, config: dict[str, Any] | None) -> ProbeReply:
        with self._lock:
            if self.turns.closed:
                raise TetherError("the runtime is closed")
            idle = [*self._spares, *(s for s in self._active if self._free_locked(s))]
            slots = idle or list(self._active)
            if not slots:
                raise TetherError("no Ray slot to check the driver on")
            # submitted under the lock: no turn can be dispatched to it before
            target = slots[0]
            call = (target.actor.probe if idle else target.actor.check).remote(driver, config)
        try:
            reply: bytes = _ray().get(call, timeout=_CALL_TIMEOUT)
        except Exception:
            raise WorkerGone from None  # that slot died meanwhile: ask another
        return msgspec.json.decode(reply, type=ProbeReply)

    def _free_locked(self, s: _Slot) -> bool:
        """No turn, no kill under way, a child to run the next turn in."""
        return self.turns.spec_of_locked(s) is None and not s.killing and s.child is not None

    def _idle_locked(self) -> _Slot | None:
        """An active slot free to take a turn (the table's ``idle``)."""
        return next((s for s in self._active if self._free_locked(s)), None)

    def encode(self, frame: HostFrame) -> bytes:
        """``frame``'s bytes for a slot; FrameError over the frame cap."""
        payload = self._encoder.encode(frame)
        if len(payload) > MAX_FRAME:
            raise FrameError(f"frame of {len(payload)} bytes is over the {MAX_FRAME}-byte cap")
        return payload

    def disposed(self, sessions: list[str]) -> None:
        """Nothing is told: a slot's ``send`` carries frames of a turn (held until it
        starts, dropped after), and a slot has no channel between turns. What a turn
        child keeps for a disposed session stays until the kit's own bound (the agent
        kit's four MCP configs) or the child's end lets it go."""

    def worker_pids(self) -> list[int]:
        """The turn children's pids (on their nodes), spare included."""
        with self._lock:
            slots = [*self._active, *self._spares]
            return [s.child for s in slots if s.child is not None]

    def slot_pids(self) -> list[int]:
        """The slot actors' own pids (on their nodes)."""
        with self._lock:
            return [s.pid for s in self._all if s.pid]

    def close(self) -> None:
        """Stop every slot and reaper: no actor and no process is left (a Ray started
        by this backend is shut down too); whatever is queued is reported as ended."""
        ray = _ray()
        with self._lock:
            if self.turns.closed:
                return
            orphans = self.turns.close_locked()
            deadline = time.monotonic() + _START_TIMEOUT
            while self._starting > 0 and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            slots = list(self._all)
        self.turns.unstarted(orphans)
        stops = [s.actor.shutdown.remote() for s in slots]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=5.0)
        for s in slots:
            with contextlib.suppress(Exception):
                ray.kill(s.actor, no_restart=True)
        with self._lock:
            reapers = dict(self._reapers)
        by_node: dict[str, list[_Slot]] = {}
        for s in slots:
            by_node.setdefault(s.node, []).append(s)
        for node, reaper in reapers.items():
            kids = by_node.get(node, [])
            with contextlib.suppress(Exception):  # their processes gone, not just "killed"
                ray.get(
                    reaper.kill_pids.remote([s.pid for s in kids if s.pid], 2.0),
                    timeout=_CALL_TIMEOUT,
                )
            for s in kids:
                if s.child is not None:
                    with contextlib.suppress(Exception):
                        ray.get(
                            reaper.kill_tree.remote(s.child, s.token, s.leaf),
                            timeout=_CALL_TIMEOUT,
                        )
        for reaper in reapers.values():
            with contextlib.suppress(Exception):
                ray.kill(reaper, no_restart=True)
        if self._owns_ray:
            shutdown_ray()
        self._reap_keepers(wait=_KEEPER_WAIT)

    # ---- slots ------------------------------------------------------------------------

    def _start_slot_locked(self) -> None:
        self._starting += 1
        threading.Thread(target=self._start_slot, name="tether-ray-slot", daemon=True).start()

    def _start_slot(self) -> None:
        ray = _ray()
        s: _Slot | None = None
        try:
            s = _Slot(self, self._slot_cls.remote(self._containment))
            info = ray.get(s.actor.info.remote(), timeout=_START_TIMEOUT)
            s.update(info)
            if self._containment == "cgroup" and s.containment != "cgroup":
                with self._lock:
                    self._refused = f"on Ray node {s.node}: {s.cgroup_error}"
                raise TetherError(self._refused)
            self._adopt_keeper(s)
        except Exception as exc:
            log.error("ray.slot_start_failed", error=repr(exc))
            if s is not None:
                with contextlib.suppress(Exception):
                    ray.kill(s.actor, no_restart=True)
            with self._lock:
                self._starting -= 1
                self._failures += 1
                self._changed.notify_all()
                if not self.turns.closed and self._failures < 3:
                    self._start_slot_locked()
            return
        with self._lock:
            self._starting -= 1
            self._failures = 0
            self._all.add(s)
            self._reaper_locked(s.node)
            self._place_locked(s)
        log.debug("ray.slot_started", pid=s.pid, node=s.node, child=s.child)

    def _place_locked(self, s: _Slot) -> None:
        """A ready slot joins the active set, or becomes the spare, or is surplus."""
        if self.turns.closed:
            pass  # close() stops it with the others
        elif s in self._active or s in self._spares:
            pass  # placed already (an abort and a crash of one turn both restart its slot)
        elif len(self._active) < self.size:
            self._active.append(s)
        elif len(self._spares) < self.spare:
            self._spares.append(s)
        else:
            self._retire_locked(s)
        self.turns.dispatch_locked()
        self._changed.notify_all()

    def _leave_locked(self, s: _Slot) -> None:
        """``s`` stops taking turns; the spare takes its place at once."""
        if s in self._spares:
            self._spares.remove(s)
        elif s in self._active:
            self._active.remove(s)
            if self._spares:
                self._active.append(self._spares.popleft())

    def _retire_locked(self, s: _Slot) -> None:
        """Kill ``s`` for good (in the background) and start a replacement if needed."""
        self._leave_locked(s)
        self._all.discard(s)
        s.lost = True
        threading.Thread(
            target=self._kill_slot, args=(s,), name="tether-ray-retire", daemon=True
        ).start()
        self._replenish_locked()

    def _replenish_locked(self) -> None:
        if self.turns.closed or self._failures >= 3:
            return
        restarting = sum(1 for s in self._all if s not in self._active and s not in self._spares)
        missing = self.size + self.spare - len(self._active) - len(self._spares)
        for _ in range(missing - self._starting - restarting):
            self._start_slot_locked()

    def _kill_slot(self, s: _Slot) -> None:
        """The last resort: the reaper SIGKILLs the actor's process (frozen or not),
        then ``ray.kill`` tells Ray."""
        ray = _ray()
        with self._lock:
            reaper = self._reapers.get(s.node)
        if reaper is not None and s.pid:
            with contextlib.suppress(Exception):
                ray.get(reaper.kill_pids.remote([s.pid]), timeout=_CALL_TIMEOUT)
        with contextlib.suppress(Exception):
            ray.kill(s.actor, no_restart=True)
        log.debug("ray.slot_retired", pid=s.pid, node=s.node)

    def _restart(self, s: _Slot) -> None:
        """A new child in a slot whose last one is dead; the slot rejoins, or is replaced."""
        ray = _ray()
        try:
            info = ray.get(s.actor.restart.remote(), timeout=_START_TIMEOUT)
        except Exception as exc:
            with self._lock:
                if self.turns.closed:
                    return  # close() stopped it meanwhile
            log.warning("ray.slot_restart_failed", pid=s.pid, error=repr(exc))
            with self._lock:
                if s in self._all:
                    self._retire_locked(s)
            return
        with self._lock:
            s.update(info)
        self._adopt_keeper(s)
        self._reap_keepers()
        with self._lock:
            s.killing = False
            if s not in self._all or s.lost:
                return
            if self.turns.closed:
                return
            self._place_locked(s)

    def _adopt_keeper(self, s: _Slot) -> None:
        """A keeper on this host's own node whose parent is this process (the host
        started Ray and is a subreaper) is ours to reap once it exits."""
        if s.keeper is None or s.node != self._node:
            return
        with contextlib.suppress(psutil.Error):
            if psutil.Process(s.keeper).ppid() == os.getpid():
                with self._lock:
                    self._keepers.add(s.keeper)

    def _reap_keepers(self, wait: float = 0.0) -> None:
        """Collect the keepers of ours that have exited (each a zombie until then);
        ``wait``: up to that long for the others to exit too."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                pids = list(self._keepers)
            for pid in pids:
                try:
                    done = os.waitpid(pid, os.WNOHANG)[0] != 0
                except ChildProcessError:
                    done = True
                if done:
                    with self._lock:
                        self._keepers.discard(pid)
            with self._lock:
                left = bool(self._keepers)
            if not left or time.monotonic() >= deadline:
                return
            time.sleep(0.01)  # no event tells us that another process's child exited

    def _reaper_locked(self, node: str) -> Any:
        reaper = self._reapers.get(node)
        if reaper is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            reaper = self._reaper_cls.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote()
            self._reapers[node] = reaper
        return reaper

    # ---- turns ------------------------------------------------------------------------

    def _stream(self, s: _Slot, spec: TurnSpec, start: bytes, pending: list[bytes]) -> None:
        """One turn's stream: the worker's frames, then its end (or the slot's loss)."""
        ray = _ray()
        exit_item: dict[str, Any] | None = None
        lost: str | None = None
        try:
            for ref in s.actor.run.remote(spec.turn, start, pending):
                item = ray.get(ref)
                if isinstance(item, dict):
                    exit_item = item
                    break
                if self._frame(s, spec, item):
                    break
        except Exception as exc:  # the actor died (SIGKILL, node lost): RayActorError & co
            cause = getattr(exc, "cause", None)  # a RayTaskError's: what the slot raised
            why = type(exc).__name__ if cause is None else f"{type(exc).__name__}: {cause}"
            lost = f"the Ray slot running this turn was lost: {why}"
        s.stream_done.set()
        if exit_item is None and lost is None:
            return  # the turn ended with its TurnEnd (reported), or a fault kills it
        with self._lock:
            if not self.turns.runs_locked(s, spec.turn):
                return  # a kill is under way: the abort reports this turn once it is dead
            self.turns.lost_locked(s)
        if lost is not None:
            self._crashed_slot(s, spec, lost)
        else:
            assert exit_item is not None
            self._crashed_child(s, spec, exit_item)

    def _frame(self, s: _Slot, spec: TurnSpec, payload: bytes) -> bool:
        """Handle one worker frame; True at the turn's end."""
        try:
            frame = self._decoder.decode(payload)
        except Exception as exc:  # semantics §14.3: the worker is faulty, its turn crashed
            log.error("frame.rejected", pid=s.child, error=str(exc), fatal=True)
            self.turns.fail(s, spec.turn, f"protocol error: {exc}")
            return True
        try:
            return self.turns.on_frame(s, frame)
        except Exception:  # a bug handling one frame must not end the stream
            log.exception("frame.failed", pid=s.child)
        return False

    def _crashed_child(self, s: _Slot, spec: TurnSpec, item: dict[str, Any]) -> None:
        """The turn's child died on its own; the slot killed what it left and answered."""
        error = item.get("error")
        if error is not None:
            log.error("frame.rejected", pid=s.child, error=error, fatal=True)
        else:
            error = f"the worker exited with code {item.get('exit')}"
        log.warning("worker.crashed", pid=s.child, turn=spec.turn, error=error)
        with self._lock:
            s.child = None
            self._leave_locked(s)
        self.turns.dead(s, error, turn=spec.turn)
        self._restart(s)

    def _crashed_slot(self, s: _Slot, spec: TurnSpec, error: str) -> None:
        """The slot actor is gone mid-turn: make sure the turn's tree is, then report."""
        with self._lock:
            child, token, leaf = s.child, s.token, s.leaf
        if child is not None and not self._reap(s.node, child, token, leaf, self.abort_timeout):
            self._last_resort(s, child, token, leaf, spec.turn)
        log.warning("ray.slot_lost", pid=s.pid, turn=spec.turn)
        with self._lock:
            s.child = None
            if s in self._all:
                self._retire_locked(s)
        self.turns.dead(s, error, turn=spec.turn)

    def _reap(self, node: str, child: int, token: str, leaf: str | None, timeout: float) -> bool:
        """One try: the node's reaper kills the tree of ``child``; True once it saw it
        dead, False if it said otherwise or did not answer within ``timeout``."""
        ray = _ray()
        with self._lock:
            reaper = self._reaper_locked(node)
        try:
            return bool(ray.get(reaper.kill_tree.remote(child, token, leaf), timeout=timeout))
        except Exception as exc:
            log.error("ray.reaper_failed", node=node, error=repr(exc))
            return False

    def _last_resort(self, s: _Slot, child: int, token: str, leaf: str | None, turn: str) -> None:
        """The node's reaper did not confirm the tree dead in time (frozen, overloaded,
        gone): ``ray.kill`` the slot (its child dies with it, and the child's keeper
        sweeps the rest), then return only once a new reaper saw the tree dead, or once
        the node has left the cluster (nothing on it can be asked any more)."""
        ray = _ray()
        log.error("ray.tree_unconfirmed", turn=turn, pid=child, node=s.node)
        with contextlib.suppress(Exception):
            ray.kill(s.actor, no_restart=True)
        pause = 0.05
        while not self.turns.closed:
            with self._lock:
                old = self._reapers.pop(s.node, None)
            if old is not None:
                with contextlib.suppress(Exception):
                    ray.kill(old, no_restart=True)
            if self._reap(s.node, child, token, leaf, _START_TIMEOUT):  # a new actor: seconds
                return
            if not _node_alive(s.node):
                log.error("ray.node_lost", node=s.node, turn=turn)
                return
            time.sleep(pause)  # a reaper that cannot start: try again, less often
            pause = min(pause * 2, 2.0)

    def _abort(self, s: _Slot, turn: str) -> None:
        """Kill the turn's tree on its node (the table's kill, or a faulty worker);
        report its end only once it is dead."""
        with self._lock:
            child, token, leaf = s.child, s.token, s.leaf
        dead = child is None or self._reap(s.node, child, token, leaf, self.abort_timeout)
        if child is not None and not dead:
            self._last_resort(s, child, token, leaf, turn)
        with self._lock:
            if child is not None:  # the stop report's "how" (its process list: not on Ray yet)
                self.turns.kill_facts_locked(s, "walk" if leaf is None else "cgroup")
            s.child = None
            self._leave_locked(s)  # the spare takes over now
        self.turns.dead(s, None, turn=turn)
        # The slot itself: a new child if it answers, else (frozen, lost) a replacement.
        if dead and s.stream_done.wait(self.abort_timeout):
            with self._lock:
                lost = s.lost or s not in self._all
            if not lost:
                self._restart(s)
                return
        with self._lock:
            if s in self._all:
                self._retire_locked(s)
