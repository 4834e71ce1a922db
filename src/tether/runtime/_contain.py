"""The pool's containment hooks (SPEC §15.5): how a worker's tree is killed and frozen,
and what each kill did, for the stop report (SPEC §15.6).

Two paths, chosen once per runtime (``Runtime.containment``):

- ``cgroup``: each worker lives in its own leaf (see ``_cgroup``); a kill is the kernel's
  ``cgroup.kill``, a pause ``cgroup.freeze``. Ancestry, sessions and environments do not
  matter.
- ``walk``: the v2 walk (``_procs``): the frozen worker's tree, its process group, what
  carries its tag, and what its death left with the forkserver. The forkserver is a child
  subreaper (``_forkserver_init``), so a dead worker's orphans, an env-cleared ``setsid``
  escapee included, re-parent to it; every child of the forkserver that is not a worker
  of this host is such an orphan, and dies with the next unrooted kill pass.

The forkserver is shared by every pool in the process, so the workers it started are
registered here, process-wide, and a pid being started is never taken for an orphan
(``launching``).
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import os
import signal
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import psutil

from tether.runtime._cgroup import Leaf
from tether.runtime._procs import _children, alive
from tether.wire.records import ProcessFate

__all__ = [
    "FORKSERVER_PRELOAD",
    "cgroup_pass",
    "describe",
    "fates",
    "forget_worker",
    "forkserver_orphans",
    "launching",
]

# Imported by the forkserver when it starts (never by the host): makes it a subreaper.
FORKSERVER_PRELOAD = "tether.runtime._forkserver_init"

_lock = threading.Lock()
_workers: set[int] = set()  # pids of live workers the forkserver started for any pool
_launching = 0  # starts in flight: their pid is not known yet


@contextlib.contextmanager
def launching() -> Iterator[list[int]]:
    """Around a worker start: append its pid to the yielded list once known. Until the
    block ends, no forkserver child is taken for an orphan."""
    global _launching
    started: list[int] = []
    with _lock:
        _launching += 1
    try:
        yield started
    finally:
        with _lock:
            _workers.update(started)
            _launching -= 1


def forget_worker(pid: int) -> None:
    with _lock:
        _workers.discard(pid)


def _forkserver_pid() -> int | None:
    server: Any = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def forkserver_orphans() -> list[int] | None:
    """The forkserver's children that are no worker of ours: what dead workers left
    behind. None while a worker is being started (ask again later).

    A child still in the forkserver's own session is spared: a process started through
    the same multiprocessing forkserver by the embedding program, not by a worker (a
    worker's tools are in its session or a session of their own).
    """
    fs = _forkserver_pid()
    if fs is None:
        return []
    kids = _children(fs)  # first: a pid started after this is not in it
    with _lock:
        if _launching:
            return None
        known = set(_workers)
    try:
        fs_sid = os.getsid(fs)
    except ProcessLookupError:
        return []
    out = []
    for pid in kids:
        if pid in known:
            continue
        with contextlib.suppress(ProcessLookupError):
            if os.getsid(pid) != fs_sid:
                out.append(pid)
    return out


def describe(
    procs: Iterable[psutil.Process | int], into: dict[int, tuple[psutil.Process, ProcessFate]]
) -> None:
    """Note who each process is (start time, argv) before it is killed: a dead one has
    no argv left to read. A walk passes the Process objects it holds (their start time
    is already read); a leaf's list is pids."""
    for item in procs:
        pid = item if isinstance(item, int) else item.pid
        if pid in into:
            continue
        try:
            p = psutil.Process(item) if isinstance(item, int) else item
            started = p.create_time()
            try:
                argv = p.cmdline()
            except (psutil.AccessDenied, psutil.ZombieProcess):
                argv = []
        except psutil.NoSuchProcess:
            continue
        into[pid] = (p, ProcessFate(pid=pid, started=started, argv=argv, signal="SIGKILL"))


def fates(found: dict[int, tuple[psutil.Process, ProcessFate]]) -> list[ProcessFate]:
    """Every process signalled, with whether it is dead now (a zombie is)."""
    out = []
    for p, fate in found.values():
        if alive(p):
            fate = ProcessFate(
                pid=fate.pid,
                started=fate.started,
                argv=fate.argv,
                signal=fate.signal,
                fate="survived",
            )
        out.append(fate)
    return out


def cgroup_pass(leaf: Leaf, found: dict[int, tuple[psutil.Process, ProcessFate]]) -> bool:
    """One kill of a worker's leaf: freeze it, note what is in it, ``cgroup.kill``; True
    once the kernel says it is empty (False: try again)."""
    leaf.freeze(wait=_freeze_wait(found))
    pids = leaf.pids()
    describe(pids, found)
    return leaf.kill(pids=pids)


def cgroup_kill_ahead(
    items: list[tuple[Leaf, dict[int, tuple[psutil.Process, ProcessFate]]]],
) -> None:
    """Start the first kill of several leaves at once (a subtree abort dooms many workers
    together): freeze them all, then list and ``cgroup.kill`` each without waiting, so
    their processes die side by side; each leaf's own ``cgroup_pass`` then finds little
    left to wait for. Errors are left to that pass (it retries)."""
    first = [(leaf, found) for leaf, found in items if not found]
    for leaf, _ in first:
        with contextlib.suppress(OSError):
            leaf.freeze()
    for leaf, found in first:
        with contextlib.suppress(OSError):
            leaf.freeze(wait=_freeze_wait(found))
            describe(leaf.pids(), found)
            leaf.kill(wait=0.0)


def _freeze_wait(found: dict[int, Any]) -> float:
    # Only the first pass waits for the freeze (so the list is exact); a retry kills
    # at once.
    return 0.2 if not found else 0.0


def kill_pids(pids: list[int]) -> None:
    """SIGKILL by pid, tolerating the gone (for a leaf whose kill file is missing)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
