"""The pool's launcher: a small forkserver of our own, on public APIs only. One
single-threaded, subreaping process per pool forks each worker and alone reaps them.
How it starts, what it preloads and what happens when it dies: docs/design.md, section 7.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

import structlog

from tether.contain.procs import all_dead, child_pids, kill_tree
from tether.runtime._log import configure_logging

__all__ = ["PRELOAD", "Launcher", "WorkerProcess", "main"]

log = structlog.get_logger("tether.launcher")

# Imported by the launcher before it forks any worker.
PRELOAD = ("tether", "tether.runtime.worker", "tether.driver.scripted")

# The launcher's first message is the host's import path, read before anything of ours
# is imported (the host may have found Tether on a path of its own). Not ``-m``: the
# package imports this module first, and runpy warns about running it as ``__main__``.
_BOOT = (
    "import json, os, sys; sys.path[:] = json.loads(os.read(int(sys.argv[1]), 1 << 20)); "
    "from tether.runtime._launcher import main; main()"
)
_REPLY_TIMEOUT = 30.0  # seconds a launch waits for its pid (a new launcher imports first)
_CLOSE_TIMEOUT = 5.0
_MAX_MESSAGE = 1 << 20
_STATUS = struct.Struct("!i")


class LauncherGone(OSError):
    """The launcher died or stopped answering: a new one is started for the next launch.
    ``delivered``: the request may have reached it (a worker may have been forked on the
    socket, which is then never given to another)."""

    def __init__(self, message: str, *, delivered: bool) -> None:
        super().__init__(message)
        self.delivered = delivered


class WorkerProcess:
    """A worker started by the launcher: its pid, and its exit code once it died."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self._status: int | None = status_fd
        # Where the launcher dies before it could report the death, the worker may have
        # re-parented to us (a subreaper host): the pidfd reaps exactly it, never a
        # recycled pid.
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(pid)

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the launcher's report of this worker's death."""
        if self._status is None:
            return
        if not _wait_readable(self._status, timeout):
            return
        data = b""
        with contextlib.suppress(OSError):
            data = os.read(self._status, _STATUS.size)
        if len(data) == _STATUS.size:
            (self.exitcode,) = _STATUS.unpack(data)
        else:  # the launcher died first: nobody reports it; reap it if it is ours now
            self._reap_orphaned(timeout)
        self.close()

    def _reap_orphaned(self, timeout: float | None) -> None:
        if self._pidfd is None:
            return
        if _wait_readable(self._pidfd, timeout):
            with contextlib.suppress(ChildProcessError, OSError):
                res = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
                if res is not None:
                    code = res.si_status
                    self.exitcode = -code if res.si_code != os.CLD_EXITED else code

    def close(self) -> None:
        for fd in (self._status, self._pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._status = self._pidfd = None


class Launcher:
    """The host's side: starts the launcher on first use (and again after it died),
    sends it launch requests one at a time, and knows which of its children are workers.
    """

    def __init__(
        self,
        preload: tuple[str, ...] = (),
        *,
        environ: Callable[[], dict[str, str]] | None = None,
        tool_user: str | None = None,
    ) -> None:
        # modules the launcher imports before it forks a worker (telemetry's, when on)
        self._preload = list(preload)
        # the launcher's (so its workers') environment, made when it starts; None: ours
        self._environ = environ
        self._tool_user = tool_user  # who the workers' tools run as (None: the worker)
        self._lock = threading.Lock()  # one request at a time; guards the process
        self._proc: subprocess.Popen[bytes] | None = None
        self._ctl: socket.socket | None = None
        self._closed = False
        self._known_lock = threading.Lock()
        self._workers: set[int] = set()  # pids of live workers it started
        self._launching = 0  # launches in flight: their pid is not known yet
        self.starts = 0  # launcher processes started (more than one: one died)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

    def launch(self, sock: socket.socket, token: str, leaf: str | None) -> WorkerProcess:
        """Start a worker on ``sock`` (the worker's end; the caller closes its own copy).
        Until it returns, no launcher child is taken for an orphan. OSError (LauncherGone
        included) if no worker could be started."""
        with self._known_lock:
            self._launching += 1
        started: WorkerProcess | None = None
        try:
            request = json.dumps(
                {
                    "token": token,
                    "leaf": leaf,
                    "path": sys.path,
                    "cwd": os.getcwd(),
                    "preload": self._preload,
                    "tool_user": self._tool_user,
                }
            ).encode()
            with self._lock:
                for retry in (False, True):
                    try:
                        started = self._request_locked(request, sock.fileno())
                        break
                    except LauncherGone as exc:
                        log.warning("launcher.lost", pid=self.pid, reason=str(exc))
                        self._discard_locked()
                        if retry or exc.delivered:
                            raise
            assert started is not None
            return started
        finally:
            with self._known_lock:
                if started is not None:
                    self._workers.add(started.pid)
                self._launching -= 1

    def forget(self, pid: int) -> None:
        """``pid`` (a worker) is dead and done with: a later child with its pid is not it."""
        with self._known_lock:
            self._workers.discard(pid)

    def orphans(self) -> list[int] | None:
        """The launcher's children that are no worker: what dead workers left behind.
        None while a worker is being started (ask again later)."""
        proc = self._proc
        if proc is None:
            return []
        # The children are read under the lock: no launch starts or ends meanwhile, and a
        # worker is forgotten only once the launcher has reaped it (its status came), so
        # each child read is a known worker or an orphan, never a worker just forgotten.
        with self._known_lock:
            if self._launching:
                return None
            kids = child_pids(proc.pid)
            known = set(self._workers)
        return [pid for pid in kids if pid not in known]

    def close(self) -> None:
        """Kill what dead workers left with the launcher (it would outlive it), then stop
        it and reap it. Its workers are the pool's to stop, before this."""
        with self._lock:
            self._closed = True
            orphans = self.orphans()
            if orphans:
                with contextlib.suppress(OSError):
                    kill_tree(orphans)
            self._discard_locked(grace=_CLOSE_TIMEOUT)

    # ---- internals ---------------------------------------------------------------------

    def _request_locked(self, request: bytes, fd: int) -> WorkerProcess:
        if self._closed:
            raise OSError("the pool is closed")
        if self._proc is not None and self._proc.poll() is not None:
            code = self._proc.returncode
            raise LauncherGone(f"the launcher exited with code {code}", delivered=False)
        if self._proc is None:
            self._start_locked()
        ctl = self._ctl
        assert ctl is not None
        try:
            socket.send_fds(ctl, [request], [fd])
        except OSError as exc:  # a message not sent was not received
            raise LauncherGone(f"the launcher is gone: {exc!r}", delivered=False) from None
        try:
            data, fds, _flags, _addr = socket.recv_fds(ctl, _MAX_MESSAGE, 1)
        except OSError as exc:  # a timeout included: a late answer would be misread
            raise LauncherGone(f"the launcher did not answer: {exc!r}", delivered=True) from None
        if not data:
            raise LauncherGone("the launcher exited", delivered=True)
        reply = json.loads(data)
        if "pid" not in reply or len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise OSError(f"the launcher could not start a worker: {reply.get('error')}")
        return WorkerProcess(int(reply["pid"]), fds[0])

    def _start_locked(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=None if self._environ is None else self._environ(),
                start_new_session=True,  # the host's terminal signals are the host's
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(_REPLY_TIMEOUT)
        self._ctl = ours
        with contextlib.suppress(OSError):  # a launcher dead already: the request says so
            ours.send(json.dumps(sys.path).encode())
        self.starts += 1
        log.debug("launcher.started", pid=self._proc.pid, starts=self.starts)

    def _discard_locked(self, grace: float = 0.0) -> None:
        """Close the channel (the launcher exits on its EOF), kill it if it does not
        within ``grace``, and reap it."""
        proc, self._proc = self._proc, None
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        if proc is None:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- the launcher process --------------------------------------------------------------


def _noop(_signum: int, _frame: FrameType | None) -> None:
    """SIGCHLD's handler: it only has the wakeup descriptor written (see ``_Server``)."""


class _Server:
    """The launcher's loop: launch requests on ``ctl``, SIGCHLD on a wakeup pipe."""

    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _noop)  # not SIG_IGN: that would discard the codes
        self.workers: dict[int, int] = {}  # worker pid -> its status pipe's write end

    def serve(self) -> NoReturn:
        while True:
            ready, _, _ = select.select([self.ctl.fileno(), self.wake_r], [], [])
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 4096):
                        pass
            self.reap()
            if self.ctl.fileno() in ready:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(self.ctl, _MAX_MESSAGE, 1)
                except OSError:
                    data, fds = b"", []
                if not data:  # the host closed the pool, or died
                    for fd in fds:
                        os.close(fd)
                    self.leave()
                self.handle(data, fds)

    def handle(self, data: bytes, fds: list[int]) -> None:
        try:
            request = json.loads(data)
            if len(fds) != 1:
                raise ValueError("a launch request carries exactly one socket")
            self.preload(request.get("preload", ()))
            r, w = os.pipe2(os.O_CLOEXEC)
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            self.reply({"error": repr(exc)})
            return
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in (*fds, r, w):
                os.close(fd)
            self.reply({"error": repr(exc)})
            return
        if pid == 0:
            os.close(r)
            self.run_worker(request, fds[0], w)
        os.close(fds[0])  # the worker's alone: its host sees EOF when it dies
        self.workers[pid] = w
        self.reply({"pid": pid}, r)
        os.close(r)

    def preload(self, modules: list[str]) -> None:
        """Import what the workers will need (once; a module that fails to import is the
        worker's to load, or to fail on, itself). The launcher starts no thread: a
        module imported here starts none either (telemetry's make their threads in the
        worker, on its first traced turn)."""
        for name in modules:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception as exc:
                    log.warning("launcher.preload_failed", module=name, error=repr(exc))

    def reply(self, message: dict[str, Any], fd: int | None = None) -> None:
        with contextlib.suppress(OSError):  # the host is gone: the next read says so
            socket.send_fds(self.ctl, [json.dumps(message).encode()], [] if fd is None else [fd])

    def reap(self) -> None:
        """Collect every child that ended: a worker's code goes to its status pipe; an
        orphan (a dead worker's tool, re-parented to us) just goes."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self.workers.pop(pid, None)
            if w is not None:
                with contextlib.suppress(OSError):
                    os.write(w, _STATUS.pack(os.waitstatus_to_exitcode(status)))
                os.close(w)

    def leave(self) -> NoReturn:
        """The host is gone (or closing): what dead workers left with us would outlive
        us, so it dies first. Live workers sweep their own trees when their channel
        ends; the SIGCONT of their parent-death signal wakes a paused one to do it."""
        with contextlib.suppress(OSError):
            orphans = [p for p in child_pids(os.getpid()) if p not in self.workers]
            if orphans:
                all_dead(kill_tree(orphans), 1.0)
        self.reap()
        os._exit(0)

    def run_worker(self, request: dict[str, Any], sock_fd: int, status_w: int) -> NoReturn:
        """In the forked child: shed the launcher's descriptors and signal handling, take
        the host's import path and directory, run the worker; never return."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.ctl.close()
            for fd in (self.wake_r, self.wake_w, status_w, *self.workers.values()):
                os.close(fd)
            sys.path[:] = request["path"]
            os.chdir(request["cwd"])
            from tether.runtime.worker import worker_main

            worker_main(
                socket.socket(fileno=sock_fd),
                request["token"],
                request["leaf"],
                tool_user=request.get("tool_user"),
            )
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)


def _wait_readable(fd: int, timeout: float | None) -> bool:
    """``fd`` is readable (or at EOF) within ``timeout`` seconds (None: no limit). poll,
    not select: a host may hold more than FD_SETSIZE descriptors."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


def main() -> None:
    """The launcher process (``_BOOT`` FD): serve launch requests on socket FD."""
    ctl = socket.socket(fileno=int(sys.argv[1]))
    configure_logging()  # the host's settings (TETHER_LOG), to stderr
    started = time.monotonic()
    from tether.contain.prctl import set_subreaper

    set_subreaper()
    for name in PRELOAD:
        importlib.import_module(name)
    log.debug("launcher.ready", pid=os.getpid(), seconds=round(time.monotonic() - started, 3))
    _Server(ctl).serve()
