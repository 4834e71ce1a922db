"""Process-tree helpers for the stop measurements and for leak checks.

Every stop benchmark wedges the same tree, `sh -c "sleep T & sleep T; wait"`, where T is
a per-sample tag (a sleep length unique to this process and sample) so the tree of one
sample is never confused with the zombies of the previous one. Death is observed through
pidfds: one blocking `poll` that wakes when the last process has exited (a zombie counts
as dead, as in semantics §2), so the measuring thread holds no GIL while it waits and adds no
polling granularity.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import select
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

import psutil

_seq = itertools.count(1)
_PR_SET_CHILD_SUBREAPER = 36


def wedge_tag() -> str:
    """A sleep length unique to this process and call (~77 s, so a leak still ends)."""
    return f"77.{os.getpid():07d}{next(_seq):05d}"


def wedge_argv(tag: str) -> list[str]:
    return ["sh", "-c", f"sleep {tag} & sleep {tag}; wait"]


@dataclass(frozen=True)
class Tree:
    """A wedged tree: the shell, its two sleeps, and the process that started the shell."""

    starter: int
    sh: int
    sleeps: tuple[int, int]

    def pids(self, *, with_starter: bool) -> list[int]:
        head = [self.starter] if with_starter else []
        return [*head, self.sh, *self.sleeps]


def _scan_tree(tag: str, root: psutil.Process) -> Tree | None:
    sleeps: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if p.cmdline() == ["sleep", tag] and p.status() != psutil.STATUS_ZOMBIE:
                    sleeps.append(p)
    if len(sleeps) != 2:
        return None
    try:
        sh = sleeps[0].parent()
        starter = sh.parent() if sh is not None else None
    except psutil.Error:
        return None
    if sh is None or starter is None or sleeps[1].ppid() != sh.pid:
        return None
    return Tree(starter.pid, sh.pid, (sleeps[0].pid, sleeps[1].pid))


def find_tree(tag: str, timeout: float, root_pid: int | None = None) -> Tree:
    """Wait until the wedge tagged `tag` is fully up under `root_pid` (default: this process)."""
    root = psutil.Process(root_pid or os.getpid())
    deadline = time.monotonic() + timeout
    while True:
        tree = _scan_tree(tag, root)
        if tree is not None:
            return tree
        if time.monotonic() > deadline:
            raise TimeoutError(f"the wedged tree {tag} did not come up within {timeout:g}s")
        time.sleep(0.002)


class DeathWatch:
    """pidfds on a set of processes, opened before the stop is issued (no pid reuse race)."""

    def __init__(self, pids: Iterable[int]) -> None:
        self._fds: list[int] = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                self._fds.append(os.pidfd_open(pid))

    def __enter__(self) -> DeathWatch:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def wait(self, timeout: float) -> int:
        """Block until every watched process has exited; return perf_counter_ns() then."""
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        pending = set(self._fds)
        deadline = time.monotonic() + timeout
        while pending:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise TimeoutError(f"{len(pending)} process(es) still alive after {timeout:g}s")
            for fd, _ in poller.poll(left_ms):
                pending.discard(fd)
                poller.unregister(fd)
        return time.perf_counter_ns()


def alive(pids: Iterable[int]) -> list[int]:
    """The pids that still run (zombies count as dead)."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.name()}[{p.pid}] {' '.join(p.cmdline())[:90]}"
    except psutil.Error:
        return f"[{p.pid}]"


def become_subreaper() -> bool:
    """Adopt orphans of our subtree (Linux), so that the harness can reap and report them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


# Interpreter-level helpers that multiprocessing starts on first use and stops at exit;
# they are not the case's doing, so the leak checks leave them be.
_INTERPRETER_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def stray_descendants(grace: float) -> list[psutil.Process]:
    """Descendants of this process still running `grace` seconds from now (helpers excepted)."""
    deadline = time.monotonic() + grace
    while True:
        stray = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if any(h in " ".join(p.cmdline()) for h in _INTERPRETER_HELPERS):
                    continue
            except psutil.NoSuchProcess:
                continue
            stray.append(p)
        if not stray or time.monotonic() > deadline:
            return stray
        time.sleep(0.05)


def reap_zombies(exclude: int) -> None:
    """Reap our zombie children except `exclude` (a Popen, which reaps its own child)."""
    for p in psutil.Process().children():
        if p.pid == exclude:
            continue
        with contextlib.suppress(psutil.NoSuchProcess, ChildProcessError):
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, 0)


def reap_adopted() -> list[str]:
    """Kill and reap every child of ours: between cases, any is an orphan we adopted.

    Returns a description of each one that was still running: a leak of the case that ran.
    A killed orphan's own children are orphaned in turn and adopted by us, hence the loop.
    """
    leaks: list[str] = []
    # Grace first: an interpreter helper (a forkserver) exits by itself once it sees its
    # parent's pipe close, a moment after the case process is gone.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and alive(p.pid for p in psutil.Process().children()):
        time.sleep(0.05)
    for _ in range(10):
        children = psutil.Process().children()
        if not children:
            break
        for p in children:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    leaks.append(describe(p))
                    p.kill()
                p.wait(timeout=5)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired, ChildProcessError):
                continue
    return leaks
