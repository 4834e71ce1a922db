"""The local backend: worker processes behind the turn table (start, dispatch, kill a tree,
respawn, one warm spare), driven by long-lived threads: the I/O loop, the reaper, the
spawner and the tool threads. The threads, the locks, and how a turn and each stop pass
through here: docs/design.md, sections 2-7.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import psutil
import structlog

from tether.actors.ports import TurnSpec
from tether.contain import hooks
from tether.contain.cgroup import Cgroups, Leaf
from tether.contain.limits import LimitWatch
from tether.contain.procs import alive, exiting, freeze_tree, reap, reap_pass, thaw_tree
from tether.runtime._launcher import Launcher
from tether.runtime.backends import _slots
from tether.runtime.backends._held import HELD_BYTES, held_over
from tether.runtime.backends._io import Conn, IOLoop
from tether.runtime.backends._turns import (
    DriverChecks,
    TableBackend,
    TurnTable,
    WorkerGone,
    WorkerHost,
)
from tether.wire.codec import decode_frame, encode_frame
from tether.wire.errors import FrameError, TetherError
from tether.wire.frames import (
    Disposed,
    HostFrame,
    Probe,
    ProbeReply,
    Ready,
    RunTurn,
    Shutdown,
    ToolCall,
    WorkerFrame,
)

__all__ = ["HELD_BYTES", "Pool", "PoolHost"]

log = structlog.get_logger("tether.pool")

_PAUSE_WAIT = 2.0  # seconds a cgroup pause waits for the kernel's "frozen 1"
_START_TIMEOUT = 30.0
# A driver check imports the driver's module and, for an adapter, the user's factory
# module (a framework such as the Agents SDK takes seconds to import on a busy machine).
_PROBE_TIMEOUT = 30.0
_DEATH_TIMEOUT = 5.0
_CLOSE_TIMEOUT = 30.0
_MAX_START_FAILURES = 3  # at construction only: later, a failed start is retried forever
_BACKOFF_FIRST = 0.01  # seconds before the first retry (of a start, or of a kill) ...
_BACKOFF_MAX = 1.0  # ... doubling up to this
_KILL_STUCK_TRIES = 20  # a kill retried this often is logged as an error (escalation)
_DISPOSED_HELD = 10_000  # disposed sessions' ids held for a paused worker, at most


# What the pool asks of the runtime for a worker's frames (the turn table's host).
PoolHost = WorkerHost

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WorkerFrame)


class _StreamEnd:
    """A worker's end of stream, waiting in its strand behind a tool call."""

    def __init__(self, error: str | None) -> None:
        self.error = error


class _Worker:
    """One worker process and its socket on the pool's I/O loop.

    Lifecycle: starting → ready (active or spare) → doomed (killed, crashed, faulty or
    shut down) → finished (tree dead, reader done, turn reported). Flags change under the
    pool's lock.
    """

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.token = secrets.token_hex(8)
        # cgroup containment: the worker's own leaf, which it joins as it starts
        self.leaf: Leaf | None = None
        if pool.cgroups is not None:
            self.leaf = pool.cgroups.leaf(f"w-{self.token}")
            self.leaf.create()
        host_sock, child_sock = socket.socketpair()
        try:
            leaf_path = None if self.leaf is None else self.leaf.path
            self.process = pool.launcher.launch(child_sock, self.token, leaf_path)
        except BaseException:
            host_sock.close()
            if self.leaf is not None:
                self.leaf.remove()
            raise
        finally:
            child_sock.close()
        self.pid: int = self.process.pid
        self.conn = Conn(
            pool._io,
            host_sock,
            lambda payload: pool._on_payload(self, payload),
            lambda error: pool._on_stream_end(self, error),
            self.pid,
        )
        # Frames waiting behind a tool call on a tool thread, in order (None: the loop
        # handles this worker's frames itself). Under ``strand_lock``.
        self.strand: deque[WorkerFrame | _StreamEnd] | None = None
        self.strand_lock = threading.Lock()
        try:
            # held from the start: its start time tells the worker from a recycled pid
            self.ps: psutil.Process | None = psutil.Process(self.pid)
        except (psutil.NoSuchProcess, OSError):
            # died at birth, or no descriptor to look: the reaper then finds its tree by
            # its tag, as for a worker that died on its own
            self.ps = None
        self.ready = threading.Event()
        self.doomed = False
        self.killed = False  # doomed by kill(): its turn ends "killed"
        self.error: str | None = None  # why it was doomed, when the turn must say so
        self.tree_dead = False
        self.tree_pids: set[int] = set()  # its tools found by kill passes, to reap
        self.kill_tries = 0
        self.frozen: list[int] = []  # escapees stopped by freeze (the group is stopped whole)
        # The turn whose pause stopped this worker; set and cleared under the pool's
        # lock, with the group's SIGSTOP/SIGCONT, so a stop only ever lands on that turn
        # and a stopped worker is never handed another (see ``freeze``).
        self.frozen_for: str | None = None
        # every process a kill pass signalled: who it was, for the stop report
        self.found: dict[int, tuple[psutil.Process, Any]] = {}
        self.reader_done = False  # the loop is done with its stream (and its strand)
        self.finished = False
        # Sessions disposed while a pause stopped this worker (it reads nothing then, so
        # its outbox would grow): posted when it is thawed. Under the pool's lock.
        self.disposed: list[str] = []

    def post(self, frame: HostFrame, *, bounded: bool = False) -> None:
        """Send ``frame`` to the worker; never blocks. FrameError if it is over the cap;
        ``bounded`` (a steer, a preempt): InvalidParams if HELD_BYTES of such frames
        wait unread in its outbox already."""
        payload = encode_frame(_encoder, frame)
        counted = len(payload) if bounded else 0
        held = self.conn.post((payload,), counted, HELD_BYTES if bounded else None)
        if held is not None:
            raise held_over(frame, held)

    def alive(self) -> bool:
        """The worker process itself is running (not gone, not a zombie)."""
        return self.ps is not None and alive(self.ps)

    # ---- the turn table's Worker (start, post, kill under the pool's lock) ----------

    def start(self, spec: TurnSpec, run: RunTurn, rest: list[HostFrame]) -> None:
        payloads = [encode_frame(_encoder, frame) for frame in (run, *rest)]  # may refuse
        if self.leaf is not None or spec.limits:
            error = hooks.start_turn(self.leaf, spec.limits)
            if error is not None:
                self.error = error
                self.pool._doom_locked(self)  # the turn ends crashed, with the reason
                return
            if self.leaf is not None and spec.limits and "pids" in spec.limits:
                self.pool.limit_watch.watch(self.leaf, spec.turn)
        self.conn.post(payloads)  # in one send: the worker reads them all at its start

    def kill(self) -> None:
        self.killed = True
        self.pool._doom_locked(self)
        log.debug("worker.killing", pid=self.pid)

    def breached(self) -> bool:
        # The limit watch sees a refused fork only once the kernel's notice comes (at
        # most every ~10 ms): a tool that hit the limit and then finished, and a driver
        # that returned, can end the turn first. Its leaf still counts the refusal.
        if self.leaf is None or self.doomed or not self.leaf.pids_limit_hit():
            return False
        log.info("limits.pids_hit_at_end", pid=self.pid)
        self.error = "pids limit"
        self.pool._doom_locked(self)
        return True

    def turn_over(self, spec: TurnSpec) -> dict[str, float] | None:
        resources = None
        if self.leaf is not None:  # before the next turn resets its baselines
            self.pool.limit_watch.unwatch(self.leaf)
            resources = self.leaf.usage()
        if self.frozen_for is not None:
            # A pause stopped it after its driver had ended: its turn is over, and no
            # turn may go to a stopped worker. The spare takes its place; the reaper
            # ends it.
            log.info("worker.stopped_at_end", pid=self.pid, turn=spec.turn)
            self.pool._doom_locked(self)
        _slots.fit_locked(self.pool)  # one waited on approvals: the surplus may go
        return resources

    def freeze(self, turn: str) -> None:
        """Stop the group under the lock, while it still runs ``turn``: a ``TurnEnd``
        handled after it finds the worker stopped and replaces it (its turn is over; no
        other turn may wait on a stopped process). The walk for escapees runs after,
        outside the lock; freeze and thaw of one turn come from its one session host,
        in order."""
        pool = self.pool
        with pool._lock:
            if self.doomed or self.frozen_for == turn or not pool.turns.runs_locked(self, turn):
                return
            self.frozen_for = turn
            if self.leaf is not None:
                # the whole leaf, escapees included: one write, under the lock like the
                # walk's SIGSTOP of the group
                self.leaf.freeze()
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGSTOP)
        if self.leaf is not None:
            if not self.leaf.freeze(wait=_PAUSE_WAIT):  # reported once the kernel says so
                log.warning("worker.freeze_slow", pid=self.pid, turn=turn)
            return
        escapees = freeze_tree(self.pid)
        with pool._lock:
            if self.frozen_for == turn and not self.doomed:
                self.frozen = escapees
            # else: the turn ended before the walk; its worker was doomed, and the
            # reaper kills what the walk stopped
        log.debug("worker.frozen", pid=self.pid, turn=turn, escapees=len(escapees))

    def thaw(self, turn: str) -> None:
        with self.pool._lock:
            if self.doomed or self.frozen_for != turn:
                return  # being killed: it stays frozen until it is dead
            escapees, self.frozen = self.frozen, []
            self.frozen_for = None
            if self.leaf is not None:
                self.leaf.thaw()
            else:
                thaw_tree(self.pid, escapees)  # signals only: no walk under the lock
            if self.disposed:  # after the thaw: it reads them between turns
                sessions, self.disposed = self.disposed, []
                self.post(Disposed(sessions=sessions))


class Pool(TableBackend["_Worker"]):
    """``size`` workers plus one warm spare; FIFO dispatch across sessions.

    Long-lived threads do the work that may fail or wait, so that no caller does and
    no fault needs a new thread to be handled: the reaper kills doomed trees (retrying
    until they are dead) and finishes workers, the spawner starts replacements (retrying
    with backoff), the I/O loop reads every worker.
    """

    def __init__(
        self,
        size: int,
        host: PoolHost,
        *,
        cgroups: Cgroups | None = None,
        preload: tuple[str, ...] = (),
    ) -> None:
        if size < 1:
            raise ValueError("a pool needs at least one worker")
        self.size = size
        self.cgroups = cgroups  # None: the walk (semantics §15.5)
        # started by the first worker's start, without the host's secrets (semantics §17.4)
        self.launcher = Launcher(preload, environ=host.worker_environ, tool_user=host.tool_user)
        # the turns, and the lock under which they and the workers change together
        self.turns: TurnTable[_Worker] = TurnTable(host, self._idle_locked)
        self._lock = self.turns.lock
        self._changed = self.turns.changed
        self._active: list[_Worker] = []
        self._spare: _Worker | None = None
        self._starting = 0  # spawned, not yet Ready
        self.waiting_turns: set[str] = set()  # turns that wait on approvals alone (_slots)
        self._all: set[_Worker] = set()  # every worker not yet finished
        self._doomed: dict[_Worker, float] = {}  # worker -> when the reaper tries next
        self._stopping = False  # close() is done with the workers: the threads may end
        self._failures = 0  # consecutive failed starts; reset by a Ready
        self._next_spawn = 0.0
        self._checks = DriverChecks()
        self._probe_done = threading.Condition(self._lock)
        self._probe_replies: dict[str, ProbeReply] = {}
        self.limit_watch = LimitWatch(self._pids_limit_hit)  # its thread starts when needed
        self._finishing: list[_Worker] = []  # stream done after the tree died: the reaper's
        self._io = IOLoop()
        # A thread per tool call in flight (one strand per worker at a time), made on
        # demand and kept: a doomed worker's strand may still be in a slow call, which
        # must not hold up a live worker's, so the cap is well above the pool's size.
        self._tool_threads = ThreadPoolExecutor(
            max(32, 4 * size), thread_name_prefix="tether-pool-tool"
        )
        self._reaper = threading.Thread(
            target=self._reap_loop, name="tether-pool-reaper", daemon=True
        )
        self._spawner = threading.Thread(
            target=self._spawn_loop, name="tether-pool-spawner", daemon=True
        )
        try:
            self._io.start()
            self._reaper.start()
            self._spawner.start()
            deadline = time.monotonic() + _START_TIMEOUT
            with self._lock:
                while len(self._active) < size or self._spare is None:
                    left = deadline - time.monotonic()
                    if self._failures >= _MAX_START_FAILURES:
                        raise TetherError("worker processes fail to start (see their stderr)")
                    if left <= 0:
                        raise TetherError("worker processes did not start in time")
                    self._changed.wait(left)
        except BaseException:
            self.close()
            raise

    # ---- public (the Executor's methods are the turn table's: see TableBackend) -----

    def respawn_failing(self) -> bool:
        """True while replacement workers fail to start (they are being retried)."""
        with self._lock:
            return self._failures > 0

    def probe(self, driver: str, config: dict[str, Any] | None = None) -> bool:
        """Check that a worker can load ``driver`` and that its class takes ``config``
        (``check_config``); DriverNotFound (or the check's error) otherwise.

        The warm spare does the import, so the host never runs driver code.
        """
        return self._checks.check(driver, config, self._probe_spare)

    def _probe_spare(self, driver: str, config: dict[str, Any] | None) -> ProbeReply:
        with self._lock:
            deadline = time.monotonic() + _PROBE_TIMEOUT
            # only the spare: an active worker may be deep in a long turn
            while self._spare is None:
                left = deadline - time.monotonic()
                if left <= 0 or self.turns.closed:
                    raise TetherError("no spare worker to check the driver")
                self._changed.wait(left)
            target = self._spare
            self._probe_replies.pop(driver, None)
            target.post(Probe(driver=driver, config=config))
            while driver not in self._probe_replies and not target.doomed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TetherError("a worker did not answer a driver check in time")
                self._probe_done.wait(left)
            if driver not in self._probe_replies:
                raise WorkerGone
            return self._probe_replies.pop(driver)

    def disposed(self, sessions: list[str]) -> None:
        """Tell every worker that may have run these sessions' turns (an active one: the
        spare has run none) that they are settled; it closes what it keeps for them
        between turns. Posted, never waited for: a busy worker acts on it after its
        turn, a dead one never, and a stopped one (paused) is sent it when thawed."""
        frame = Disposed(sessions=sessions)
        with self._lock:
            if self.turns.closed:
                return  # every worker is being stopped, with all it keeps
            for w in self._active:
                if w.doomed:
                    continue
                if w.frozen_for is not None:
                    if len(w.disposed) < _DISPOSED_HELD:  # past it, the LRU bound holds
                        w.disposed.extend(sessions)
                    continue
                try:
                    w.post(frame)
                except FrameError as exc:  # more ids than a frame holds: not worth a fault
                    log.warning("worker.disposed_dropped", pid=w.pid, error=exc.message)

    def waiting(self, turn: str, on: bool) -> None:
        """``turn`` waits on approvals alone (``on``), or no more (``_slots``)."""
        with self._lock:
            (self.waiting_turns.add if on else self.waiting_turns.discard)(turn)
            _slots.fit_locked(self)

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._all if not w.finished]  # finished: dead, reported

    def close(self) -> None:
        """Stop every worker; whatever is still queued is reported as ended."""
        with self._lock:
            if self.turns.closed:
                return
            orphans = self.turns.close_locked()
            self._changed.notify_all()
        if self._spawner.ident is not None:
            self._spawner.join()  # no replacement may start after this
        self.turns.unstarted(orphans)
        with self._lock:
            for w in self._all:
                if not w.doomed:
                    w.post(Shutdown())
            self._wait_all_finished_locked(time.monotonic() + 2.0)
            for w in list(self._all):
                self._doom_locked(w)  # did not stop when asked: kill its tree
            if not self._wait_all_finished_locked(time.monotonic() + _CLOSE_TIMEOUT):
                log.error("pool.close_timeout", left=[w.pid for w in self._all])
            self._stopping = True
            self._changed.notify_all()
        if self._reaper.ident is not None:
            self._reaper.join(_DEATH_TIMEOUT)
        self._io.close()
        self._tool_threads.shutdown(wait=False)
        self.limit_watch.close()
        self.launcher.close()  # with what dead workers left with it

    # ---- internals: state ------------------------------------------------------------

    def _wait_all_finished_locked(self, deadline: float) -> bool:
        while self._all:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.wait(left)
        return True

    def _idle_locked(self) -> _Worker | None:
        """An active worker with no turn, not stopped by a pause (the table's ``idle``)."""
        return next(
            (
                w
                for w in self._active
                if self.turns.spec_of_locked(w) is None and w.frozen_for is None
            ),
            None,
        )

    def _doom_locked(self, w: _Worker) -> None:
        """``w`` takes no more work; the reaper kills its tree and the spawner replaces it."""
        if w.doomed:
            return
        w.doomed = True
        if not w.ready.is_set():
            self._starting -= 1
            self._start_failed_locked()
        if self._spare is w:
            self._spare = None
        elif w in self._active:
            self._active.remove(w)
            if self._spare is not None:  # the warm spare takes its place at once
                self._active.append(self._spare)
                self._spare = None
        # Freeze it now, before anything else: a stopped tree cannot fork or react, and
        # killpg needs no descriptor, so this holds even when the walk must wait.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.pid, signal.SIGSTOP)
        if w.leaf is not None:
            with contextlib.suppress(OSError):
                w.leaf.freeze()  # the whole leaf, escapees included; the reaper waits
        self._doomed[w] = 0.0
        self.turns.lost_locked(w)  # its turn, if any, ends once the tree is dead
        self._probe_done.notify_all()
        self.turns.dispatch_locked()
        self._changed.notify_all()

    def _pids_limit_hit(self, leaf: Leaf, turn: str) -> None:
        """The limit watch saw ``leaf``'s pids limit refuse a fork in ``turn``: that turn
        ends crashed, ``pids limit``, if its worker still runs it (``contain.limits``)."""
        with self._lock:
            w = next((w for w in self._all if w.leaf is leaf), None)
            if w is None or w.doomed:
                return
            if not self.turns.runs_locked(w, turn):
                return  # that turn ended meanwhile; the next one has its own baseline
            w.error = "pids limit"
            self._doom_locked(w)

    def _start_failed_locked(self) -> None:
        self._failures += 1
        retry_in = min(_BACKOFF_FIRST * 2 ** (self._failures - 1), _BACKOFF_MAX)
        self._next_spawn = time.monotonic() + retry_in
        log.error("worker.respawn_failed", failures=self._failures, retry_in=retry_in)

    def _on_ready(self, w: _Worker) -> None:
        if w.leaf is not None:
            w.leaf.mark()
        with self._lock:
            if w.doomed:
                return
            w.ready.set()
            self._starting -= 1
            self._failures = 0
            if self.turns.closed:
                surplus = True
            elif len(self._active) < _slots.target_locked(self):
                self._active.append(w)
                surplus = False
            elif self._spare is None:
                self._spare = w
                surplus = False
            else:
                surplus = True
            if surplus:
                w.post(Shutdown())
            self.turns.dispatch_locked()
            self._changed.notify_all()

    # ---- internals: the spawner ------------------------------------------------------

    def _missing_locked(self) -> int:
        missing = _slots.target_locked(self) + 1 - len(self._active) - (self._spare is not None)
        return missing - self._starting

    def _spawn_loop(self) -> None:
        """Keep ``size`` workers and a spare; a failed start is retried with backoff."""
        while True:
            with self._lock:
                while not self.turns.closed:
                    if self._missing_locked() > 0:
                        wait = self._next_spawn - time.monotonic()
                        if wait <= 0:
                            break
                        self._changed.wait(wait)
                    else:
                        self._changed.wait()
                if self.turns.closed:
                    return
                self._starting += 1
            self._spawn_one()

    def _spawn_one(self) -> None:
        """Start one worker (counted in ``_starting``); any failure is a failed start."""
        try:
            w = _Worker(self)
        except Exception as exc:
            with self._lock:
                self._starting -= 1
                self._start_failed_locked()
            log.error("worker.spawn_error", error=repr(exc))
            return
        with self._lock:
            self._all.add(w)
        try:
            self._io.add(w.conn)
        except Exception as exc:  # nobody reads it, nobody sees it end: stop it here
            log.error("worker.spawn_error", pid=w.pid, error=repr(exc))
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, signal.SIGKILL)
            w.process.join(_DEATH_TIMEOUT)
            self.launcher.forget(w.pid)
            w.conn.close()
            with self._lock:
                self._all.discard(w)
                self._starting -= 1
                self._start_failed_locked()
                self._changed.notify_all()
            return
        log.debug("worker.spawned", pid=w.pid)

    # ---- internals: the reaper -------------------------------------------------------

    def _reap_loop(self) -> None:
        """Kill every doomed worker's tree; retry until it is dead, then finish it (or
        finish one whose stream ended after its tree died: the loop hands it here)."""
        while True:
            work = self._reap_work()
            if work is None:
                return
            due, finishing = work
            for w in finishing:
                self._maybe_finish(w)
            leaves = [(w.leaf, w.found) for w in due if w.leaf is not None]
            if len(leaves) > 1:
                hooks.cgroup_kill_ahead(leaves)
            for w in due:
                dead = self._kill_pass(w)
                with self._lock:
                    self._killed_locked(w, dead)
                if dead:
                    self._maybe_finish(w)

    def _reap_work(self) -> tuple[list[_Worker], list[_Worker]] | None:
        """Wait until a doomed worker's pass is due or one is to be finished: those due,
        and those to finish. None once the pool stops with nothing left to reap."""
        with self._lock:
            while True:
                if self._stopping and not self._doomed and not self._finishing:
                    return None
                now = time.monotonic()
                due = [w for w, at in self._doomed.items() if at <= now]
                if due or self._finishing:
                    finishing, self._finishing = self._finishing, []
                    return due, finishing
                nxt = min(self._doomed.values(), default=None)
                self._changed.wait(None if nxt is None else nxt - now)

    def _killed_locked(self, w: _Worker, dead: bool) -> None:
        """After a kill pass: its tree is dead, or the next pass is due after a backoff."""
        if dead:
            del self._doomed[w]
            w.tree_dead = True
            return
        w.kill_tries += 1
        if w.kill_tries == _KILL_STUCK_TRIES:
            log.error("worker.kill_stuck", pid=w.pid, tries=w.kill_tries)
        retry_in = min(_BACKOFF_FIRST * 2**w.kill_tries, _BACKOFF_MAX)
        self._doomed[w] = time.monotonic() + retry_in

    def _kill_pass(self, w: _Worker) -> bool:
        """One attempt at ``w``'s whole tree; True when nothing of it is left alive. Its
        turn's entry learns how, what died, and what its leaf counted, before the end is
        reported."""
        if w.leaf is None:
            dead = self._walk_pass(w)
            if dead:
                with self._lock:
                    self.turns.kill_facts_locked(w, "walk", tuple(hooks.fates(w.found)))
            return dead
        if not self._leaf_pass(w, w.leaf):
            return False
        resources = w.leaf.usage()
        oom, pids = w.leaf.oom_killed(), w.leaf.pids_limit_hit()
        fates = tuple(hooks.fates(w.found))
        with self._lock:
            if self.turns.spec_of_locked(w) is not None:
                if oom and not w.killed:
                    w.error = "memory limit"
                elif pids and not w.killed and w.error is None:
                    w.error = "pids limit"  # the worker died of it before the watch saw it
                self.turns.kill_facts_locked(w, "cgroup", fates, resources)
        return True

    def _leaf_pass(self, w: _Worker, leaf: Leaf) -> bool:
        """One kill of ``w``'s leaf (``cgroup.kill``); True once it is empty."""
        try:
            dead = hooks.cgroup_pass(leaf, w.found)
        except OSError as exc:
            log.warning("worker.kill_retry", pid=w.pid, reason=repr(exc))
            return False
        w.tree_pids.update(pid for pid in w.found if pid != w.pid)
        if w.pid not in w.found and w.alive():
            # doomed before it joined its leaf (it joins first thing, but a start can be
            # cut short): the worker itself is then outside, and killed here
            with contextlib.suppress(psutil.NoSuchProcess):
                assert w.ps is not None
                w.ps.kill()
            dead = False
        if not dead:
            log.warning("worker.kill_retry", pid=w.pid, reason="the leaf is not empty")
        return dead

    def _walk_pass(self, w: _Worker) -> bool:
        def seen(procs: list[psutil.Process]) -> None:
            hooks.describe(procs, w.found)
            w.tree_pids.update(p.pid for p in procs if p.pid != w.pid)

        try:
            # A living (frozen) worker is the root of its whole tree: orphans re-parent to
            # it (a subreaper). Once it is gone its tree has dispersed: what its death
            # left with the launcher (a subreaper), env-cleared escapees included, and
            # what carries its tag.
            root = w.pid if w.alive() else None
            # A worker in its exit (killed by one of its own tools, say) is handing its
            # children to the launcher: neither walk sees them all until it is a zombie,
            # so this pass kills what it finds and proves nothing.
            leaving = root is not None and exiting(root)
            orphans = self.launcher.orphans
            dead = reap_pass(
                None if leaving else root, group=w.pid, token=w.token, orphans=orphans, seen=seen
            )
            if dead and not leaving:
                return True
            log.warning("worker.kill_retry", pid=w.pid, reason="processes still alive")
        except OSError as exc:  # out of descriptors, typically: try again later
            log.warning("worker.kill_retry", pid=w.pid, reason=repr(exc))
        return False

    # ---- internals: a worker's stream (the I/O loop's callbacks) ----------------------

    def _on_payload(self, w: _Worker, payload: bytes) -> str | None:
        """One frame of ``w`` (on the loop thread); an error ends its stream."""
        try:
            frame = decode_frame(_decoder, payload)
        except FrameError as exc:
            log.error("frame.rejected", pid=w.pid, error=exc.message)
            return f"protocol error: {exc.message}"
        with w.strand_lock:
            if w.strand is not None:  # a tool call runs: this frame waits behind it
                w.strand.append(frame)
                return None
            if isinstance(frame, ToolCall):
                w.strand = deque([frame])
                self._run_strand_elsewhere(w)
                return None
        self._handle(w, frame)
        return None

    def _on_stream_end(self, w: _Worker, error: str | None) -> None:
        """``w``'s stream ended (on the loop thread): after the frames before it."""
        with w.strand_lock:
            if w.strand is not None:
                w.strand.append(_StreamEnd(error))
                return
        self._stream_done(w, error)

    def _run_strand_elsewhere(self, w: _Worker) -> None:
        try:
            self._tool_threads.submit(self._run_strand, w)
        except RuntimeError as exc:  # no thread to be had (or closing): do it here
            log.error("tool.no_thread", pid=w.pid, error=repr(exc))
            self._run_strand(w)

    def _run_strand(self, w: _Worker) -> None:
        """``w``'s frames from a tool call on, in order, until none waits."""
        while True:
            with w.strand_lock:
                assert w.strand is not None
                if not w.strand:
                    w.strand = None
                    return
                item = w.strand.popleft()
            if isinstance(item, _StreamEnd):
                self._stream_done(w, item.error)
                continue
            try:
                self._handle(w, item)
            except Exception:  # a bug handling one frame must not strand the rest
                log.exception("frame.failed", pid=w.pid)

    def _stream_done(self, w: _Worker, error: str | None) -> None:
        """Nothing more comes from ``w``: it is doomed, and finished once its tree is
        dead (by the reaper, which this hands it to if the tree died first)."""
        with self._lock:
            w.reader_done = True
            if w.error is None:
                w.error = error
            self._doom_locked(w)  # a stream that ends, ends its worker
            if w.tree_dead:
                self._finishing.append(w)
                self._changed.notify_all()

    def _handle(self, w: _Worker, frame: WorkerFrame) -> None:
        match frame:
            case Ready() if w.ready.is_set():
                log.warning("frame.rejected", pid=w.pid, error="a second Ready")
            case Ready():
                self._on_ready(w)
            case ProbeReply():
                with self._lock:
                    self._probe_replies[frame.driver] = frame
                    self._probe_done.notify_all()
            case _:
                self.turns.on_frame(w, frame)

    # ---- internals: the end ----------------------------------------------------------

    def _maybe_finish(self, w: _Worker) -> None:
        """Once its tree is dead and its reader done: report its turn, forget the worker.

        The turn's end is reported before anything else may fail; replacing the worker
        is the spawner's job, and needs nothing from this thread.
        """
        with self._lock:
            if w.finished or not (w.tree_dead and w.reader_done):
                return
            w.finished = True
        w.conn.close()
        if w.killed:
            # The tree is dead (that is what reporting waits for): a killed turn's end
            # needs nothing from the launcher's exit report, so it goes first.
            self.turns.dead(w, w.error)
        w.process.join(_DEATH_TIMEOUT)  # dead already: this reads the launcher's report
        self.launcher.forget(w.pid)
        if w.leaf is not None:
            self.limit_watch.unwatch(w.leaf)
        if w.leaf is not None and not w.leaf.remove():
            log.warning("worker.leaf_left", pid=w.pid, leaf=w.leaf.path)
        reap(w.tree_pids)  # its tools, re-parented to us if we are a subreaper
        code = w.process.exitcode
        # Nothing of Tether's killed it (no kill, no limit, no fault found): a crash.
        crashed = not w.killed and w.error is None
        spec = self.turns.dead(w, w.error or f"the worker exited with code {code}", crashed=crashed)
        if spec is not None:
            log.warning("worker.crashed", pid=w.pid, turn=spec.turn, exitcode=code)
        elif w.killed:
            log.debug("worker.reaped", pid=w.pid, exitcode=code)
        with self._lock:
            self._all.discard(w)
            self._changed.notify_all()
