"""The worker pool: start, dispatch, kill a tree, respawn.

::

    Runtime / agent actors            Pool (host threads)                 workers
    ──────────────────────            ──────────────────────────────      ──────────────
    submit(job) ───────────────────►  FIFO queue ── dispatch ─────────►  RunTurn
    signal(turn, frame) ───────────►  held until dispatched, then ────►  Steer/Cancel/Preempt
    kill(turn) ────────────────────►  snapshot tree, killpg(SIGKILL),
                                        kill escapees deepest first
                                      one reader thread per worker ◄───  Say/ToolCall/Delivered/
      sink.delivered/ended ◄────────    (tool calls answered here)        TurnEnd, or EOF
                                      on EOF: wait until the whole tree
                                        is dead, reap, report, promote
                                        the warm spare, spawn a new one

``workers=N`` processes take turns and one warm spare waits, so a turn never waits for a
process to start after an abort. Workers start through the forkserver with the runtime's
modules preloaded (never plain fork from this threaded host), each in its own session and
process group, each a subreaper for its tools.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import socket
import threading
import time
from collections import deque
from typing import Any

import psutil
import structlog

from tether.actors.ports import TurnJob
from tether.runtime._procs import descendants, freeze_tree, thaw_tree
from tether.runtime.worker import worker_main
from tether.wire.codec import Channel, FrameTooLarge
from tether.wire.errors import DriverNotFound, FrameError, TetherError
from tether.wire.frames import (
    Delivered,
    Escalating,
    HostFrame,
    Probe,
    ProbeReply,
    Progress,
    Ready,
    RunTurn,
    Say,
    Shutdown,
    ToolCall,
    ToolKilled,
    ToolReply,
    TurnEnd,
    WorkerFrame,
)

__all__ = ["Pool", "kill_tree", "wait_dead"]

log = structlog.get_logger("tether.pool")

_PRELOAD = ["tether.runtime.worker", "tether.runtime.scripted", "tether"]
_START_TIMEOUT = 30.0
_DEATH_TIMEOUT = 5.0
_MAX_START_FAILURES = 3

_fs_lock = threading.Lock()
_fs_users = 0


def _forkserver_acquire() -> multiprocessing.context.BaseContext:
    global _fs_users
    ctx = multiprocessing.get_context("forkserver")
    with _fs_lock:
        if _fs_users == 0:
            ctx.set_forkserver_preload(_PRELOAD)
        _fs_users += 1
    return ctx


def _forkserver_release() -> None:
    """The last pool out stops the forkserver and resource tracker: no process is left."""
    global _fs_users
    with _fs_lock:
        _fs_users -= 1
        if _fs_users == 0:
            multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
            tracker: Any = multiprocessing.resource_tracker._resource_tracker
            if tracker._pid is not None:
                tracker._stop()


class _WorkerPopen(multiprocessing.popen_forkserver.Popen):
    """Launch through the forkserver without re-importing the host's ``__main__``.

    Workers load drivers by import string, so they never need the host's main module;
    running it again in each worker is the classic multiprocessing trap (an unguarded
    script would start a second runtime inside every worker). This is CPython's
    ``_launch`` with the main-module keys left out of the preparation data.
    """

    def _launch(self, process_obj: Any) -> None:
        prep = multiprocessing.spawn.get_preparation_data(process_obj._name)
        prep.pop("init_main_from_path", None)
        prep.pop("init_main_from_name", None)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            multiprocessing.context.reduction.dump(prep, buf)  # type: ignore[attr-defined]
            multiprocessing.context.reduction.dump(process_obj, buf)  # type: ignore[attr-defined]
        finally:
            multiprocessing.context.set_spawning_popen(None)
        this: Any = self
        util: Any = multiprocessing.util
        self.sentinel, w = multiprocessing.forkserver.connect_to_new_process(this._fds)
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = multiprocessing.forkserver.read_signed(self.sentinel)


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _WorkerPopen(process_obj)


def wait_dead(procs: list[psutil.Process], timeout: float = _DEATH_TIMEOUT) -> bool:
    """Wait until every process is gone or a zombie (a zombie counts as dead)."""
    deadline = time.monotonic() + timeout
    pause = 0.0001
    alive = list(procs)
    while alive:
        still = []
        for p in alive:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
            except psutil.NoSuchProcess:
                pass
        alive = still
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)  # polling OS state: there is no event for another's child dying
        pause = min(pause * 2, 0.005)
    return True


def kill_tree(pgid: int, snapshot: list[psutil.Process]) -> None:
    """``killpg(SIGKILL)``, then the escapees (``setsid``) deepest first."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for p in reversed(snapshot):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


class PoolHost:
    """What the pool asks of the runtime for a worker's frames (overridden by Runtime)."""

    def on_say(self, job: TurnJob, frame: Say) -> None:
        raise NotImplementedError

    def on_tool_call(self, job: TurnJob, frame: ToolCall) -> ToolReply:
        raise NotImplementedError


class _Worker:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        host_sock, child_sock = socket.socketpair()
        self.process = _WorkerProcess(
            target=worker_main, args=(child_sock,), daemon=True, name="tether-worker"
        )
        self.process.start()
        child_sock.close()
        self.pid: int = self.process.pid or 0
        self.channel: Channel[WorkerFrame] = Channel(host_sock, WorkerFrame)
        self.ready = threading.Event()
        self.job: TurnJob | None = None
        self.killing = False
        self.sweep: list[psutil.Process] = []
        self.frozen: list[int] = []  # escapees stopped by freeze (the group is stopped whole)
        self.reader = threading.Thread(
            target=pool._read_loop, args=(self,), name=f"tether-pool-{self.pid}", daemon=True
        )
        self.reader.start()


class Pool:
    """``size`` workers plus one warm spare; FIFO dispatch across sessions."""

    def __init__(self, size: int, host: PoolHost) -> None:
        if size < 1:
            raise ValueError("a pool needs at least one worker")
        self.size = size
        self.host = host
        self.ctx = _forkserver_acquire()
        self._lock = threading.Lock()
        self._active: list[_Worker] = []
        self._spare: _Worker | None = None
        self._starting = 0
        self._queue: deque[TurnJob] = deque()
        self._jobs: dict[str, TurnJob] = {}
        self._where: dict[str, _Worker] = {}
        self._closed = False
        self._draining = False
        self._probe_lock = threading.Lock()
        self._probe_done = threading.Condition(self._lock)
        self._probe_replies: dict[str, str | None] = {}
        self._probed: set[str] = set()
        self._all: set[_Worker] = set()
        self._changed = threading.Condition(self._lock)
        self._start_failures = 0  # consecutive deaths before Ready: stop respawning at 3
        try:
            for _ in range(size + 1):
                with self._lock:
                    self._starting += 1
                self._spawn()
            deadline = time.monotonic() + _START_TIMEOUT
            with self._lock:
                while len(self._active) < size or self._spare is None:
                    left = deadline - time.monotonic()
                    if self._start_failures >= _MAX_START_FAILURES:
                        raise TetherError("worker processes fail to start (see their stderr)")
                    if left <= 0:
                        raise TetherError("worker processes did not start in time")
                    self._changed.wait(left)
        except BaseException:
            self.close()
            raise

    # ---- public ---------------------------------------------------------------------

    def submit(self, job: TurnJob) -> None:
        with self._lock:
            if self._closed:
                raise TetherError("the runtime is closed")
            self._jobs[job.turn] = job
            self._queue.append(job)
            self._dispatch_locked()

    def accepting(self) -> bool:
        return not self._draining

    def freeze(self, turn: str) -> None:
        with self._lock:
            job = self._jobs.get(turn)
            if job is None:
                return
            w = self._where.get(turn)
            if w is None:
                job.frozen = True  # dispatch passes it over until thawed
                return
            if w.killing:
                return
        w.frozen = freeze_tree(w.pid)
        log.debug("worker.frozen", pid=w.pid, turn=turn, escapees=len(w.frozen))

    def thaw(self, turn: str) -> None:
        with self._lock:
            job = self._jobs.get(turn)
            if job is None:
                return
            w = self._where.get(turn)
            if w is None:
                job.frozen = False
                self._dispatch_locked()
                return
            escapees, w.frozen = w.frozen, []
        thaw_tree(w.pid, escapees)

    def dispatched(self, turn: str) -> bool:
        return turn in self._where  # one dict read: no lock needed

    def drain(self) -> None:
        """Take no new turns (the runtime is closing); running ones go on."""
        self._draining = True

    def signal(self, turn: str, frame: HostFrame) -> None:
        with self._lock:
            job = self._jobs.get(turn)
            if job is None:
                return
            w = self._where.get(turn)
            if w is None:
                job.pending.append(frame)
                return
            if w.killing:
                return
            with contextlib.suppress(OSError):
                w.channel.send(frame)

    def kill(self, turn: str) -> None:
        with self._lock:
            job = self._jobs.get(turn)
            if job is None:
                return
            w = self._where.get(turn)
            if w is None:
                self._queue.remove(job)
                del self._jobs[turn]
            elif w.killing:
                return
            else:
                w.killing = True
        if w is None:
            job.sink.ended(turn, None, "killed before a worker took it")
            return
        w.sweep = descendants(w.pid)
        kill_tree(w.pid, w.sweep)
        log.debug("worker.killed", pid=w.pid, turn=turn, tree=len(w.sweep) + 1)

    def probe(self, driver: str) -> None:
        """Check that a worker can load ``driver``; DriverNotFound otherwise.

        The warm spare does the import, so the host never runs driver code.
        """
        if driver in self._probed:
            return
        with self._probe_lock:
            for _ in range(3):
                with self._lock:
                    deadline = time.monotonic() + 10.0
                    # only the spare: an active worker may be deep in a long turn
                    while self._spare is None:
                        left = deadline - time.monotonic()
                        if left <= 0 or self._closed:
                            raise TetherError("no spare worker to check the driver")
                        self._changed.wait(left)
                    target = self._spare
                    self._probe_replies.pop(driver, None)
                    with contextlib.suppress(OSError):
                        target.channel.send(Probe(driver=driver))
                    while driver not in self._probe_replies and target in self._all:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TetherError("a worker did not answer a driver check in time")
                        self._probe_done.wait(left)
                    if driver not in self._probe_replies:
                        continue  # the worker died mid-check: ask another
                    error = self._probe_replies.pop(driver)
                if error is not None:
                    raise DriverNotFound(error)
                self._probed.add(driver)
                return
        raise TetherError("workers kept dying while checking the driver")

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._all]

    def close(self) -> None:
        """Stop every worker; whatever is still queued is reported as ended."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # a replacement still starting must be in the list below, or it would outlive us
            deadline = time.monotonic() + _START_TIMEOUT
            while self._starting > 0 and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            workers = list(self._all)
            orphans = list(self._queue)
            self._queue.clear()
        for job in orphans:
            self._jobs.pop(job.turn, None)
            job.sink.ended(job.turn, None, "the runtime closed before a worker took it")
        for w in workers:
            with contextlib.suppress(OSError):
                w.channel.send(Shutdown())
        for w in workers:
            w.process.join(2.0)
            if w.process.is_alive():
                kill_tree(w.pid, descendants(w.pid))
                w.process.join(_DEATH_TIMEOUT)
            w.reader.join(_DEATH_TIMEOUT)
            w.channel.close()
        _forkserver_release()

    # ---- internals ------------------------------------------------------------------

    def _spawn(self) -> None:
        """Start one worker; the caller has counted it in ``_starting``."""
        with self._lock:
            closed = self._closed
        try:
            if closed:
                raise TetherError("the pool is closed")
            w = _Worker(self)
        except BaseException:
            with self._lock:
                self._starting -= 1
                self._changed.notify_all()
            if closed:
                return
            raise
        with self._lock:
            self._all.add(w)
        log.debug("worker.spawned", pid=w.pid)

    def _replenish_locked(self) -> None:
        """Start workers until ``size`` active plus a spare are running or starting."""
        if self._closed or self._start_failures >= _MAX_START_FAILURES:
            return
        missing = self.size + 1 - len(self._active) - (self._spare is not None) - self._starting
        for _ in range(missing):
            self._starting += 1
            threading.Thread(target=self._spawn, name="tether-pool-spawn", daemon=True).start()

    def _dispatch_locked(self) -> None:
        while self._queue:
            w = next((w for w in self._active if w.job is None and not w.killing), None)
            if w is None:
                return
            job = next((j for j in self._queue if not j.frozen), None)
            if job is None:
                return
            self._queue.remove(job)
            w.job = job
            self._where[job.turn] = w
            try:
                w.channel.send(
                    RunTurn(
                        turn=job.turn,
                        session=job.session,
                        driver=job.driver,
                        message=job.message,
                        config=job.config,
                        permissions=job.permissions,
                        progress_every=job.progress_every,
                        repeat=job.repeat,
                    )
                )
                for frame in job.pending:
                    w.channel.send(frame)
                job.pending.clear()
            except OSError:
                return  # the worker is dying; its reader reports the turn as crashed

    def _on_ready(self, w: _Worker) -> None:
        with self._lock:
            self._starting -= 1
            self._start_failures = 0
            if self._closed:
                surplus = True
            elif len(self._active) < self.size:
                self._active.append(w)
                surplus = False
            elif self._spare is None:
                self._spare = w
                surplus = False
            else:
                surplus = True
            self._dispatch_locked()
            self._changed.notify_all()
        if surplus:
            with contextlib.suppress(OSError):
                w.channel.send(Shutdown())

    def _read_loop(self, w: _Worker) -> None:
        error: str | None = None
        while True:
            try:
                frame = w.channel.recv()
            except (EOFError, OSError):
                break
            except FrameTooLarge as exc:
                log.error("frame.rejected", pid=w.pid, error=exc.message, fatal=True)
                error = f"protocol error: {exc.message}"
                self.kill_worker(w)
                break
            except FrameError as exc:
                log.error("frame.rejected", pid=w.pid, error=exc.message, fatal=False)
                continue
            try:
                self._handle(w, frame)
            except Exception:  # a bug handling one frame must not kill the reader
                log.exception("frame.failed", pid=w.pid)
        self._on_exit(w, error)

    def kill_worker(self, w: _Worker) -> None:
        with self._lock:
            w.killing = True
        kill_tree(w.pid, [])

    def _handle(self, w: _Worker, frame: WorkerFrame) -> None:
        match frame:
            case Ready():
                w.ready.set()
                self._on_ready(w)
            case Say():
                job = self._job_of(w, frame.turn)
                if job is not None:
                    self.host.on_say(job, frame)
            case ToolCall():
                job = self._job_of(w, frame.turn)
                if job is not None:
                    reply = self.host.on_tool_call(job, frame)
                    with contextlib.suppress(OSError):  # a dead worker needs no answer
                        self._reply(w, reply)
            case Delivered():
                job = self._job_of(w, frame.turn)
                if job is not None:
                    job.sink.delivered(frame)
            case Progress():
                job = self._job_of(w, frame.turn)
                if job is not None:
                    job.sink.progress(frame)
            case Escalating():
                job = self._job_of(w, frame.turn)
                if job is not None:
                    job.sink.escalating(frame)
            case ToolKilled():
                job = self._job_of(w, frame.turn)
                if job is not None:
                    job.sink.tool_killed(frame)
            case TurnEnd():
                with self._lock:
                    job = w.job
                    if job is None or job.turn != frame.turn or w.killing:
                        return  # a kill is under way: the exit path reports this turn
                    w.job = None
                    del self._jobs[job.turn]
                    del self._where[job.turn]
                    self._dispatch_locked()
                job.sink.ended(job.turn, frame, None)
            case ProbeReply():
                with self._lock:
                    self._probe_replies[frame.driver] = frame.error
                    self._probe_done.notify_all()

    def _reply(self, w: _Worker, reply: ToolReply) -> None:
        try:
            w.channel.send(reply)
        except FrameError as exc:  # the driver waits for an answer: give it one it can read
            w.channel.send(
                ToolReply(
                    turn=reply.turn,
                    call=reply.call,
                    code="invalid-params",
                    message=f"the result is too large to return: {exc.message}",
                )
            )

    def _job_of(self, w: _Worker, turn: str) -> TurnJob | None:
        job = w.job
        return job if job is not None and job.turn == turn else None

    def _on_exit(self, w: _Worker, error: str | None) -> None:
        """The worker is gone: make sure its whole tree is, then report and replace it."""
        kill_tree(w.pid, w.sweep)  # group members a crash left behind
        try:
            me = psutil.Process(w.pid)
            tree = [me, *w.sweep]
        except psutil.NoSuchProcess:
            tree = list(w.sweep)
        if not wait_dead(tree):
            log.error("worker.tree_survived", pid=w.pid)
        w.process.join(_DEATH_TIMEOUT)
        for p in w.sweep:  # escapees re-parented to us (a subreaper host) are ours to reap
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p.pid, os.WNOHANG)
        code = w.process.exitcode
        with self._lock:
            self._all.discard(w)
            if not w.ready.is_set():
                self._starting -= 1
                self._start_failures += 1
                if self._start_failures == _MAX_START_FAILURES:
                    log.error("worker.start_failed", failures=self._start_failures)
            was_spare = self._spare is w
            if was_spare:
                self._spare = None
            elif w in self._active:
                self._active.remove(w)
                if self._spare is not None:
                    self._active.append(self._spare)
                    self._spare = None
            job = w.job
            w.job = None
            if job is not None:
                self._jobs.pop(job.turn, None)
                self._where.pop(job.turn, None)
            self._probe_done.notify_all()
            self._replenish_locked()
            self._dispatch_locked()
            self._changed.notify_all()
        w.channel.close()
        if job is not None:
            if error is None:
                error = "killed" if w.killing else f"the worker exited with code {code}"
            if w.killing:
                log.debug("worker.reaped", pid=w.pid, turn=job.turn, exitcode=code)
            else:
                log.warning("worker.crashed", pid=w.pid, turn=job.turn, exitcode=code)
            job.sink.ended(job.turn, None, error)
