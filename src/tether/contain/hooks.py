"""The pool's containment hooks (semantics §15.5): how a worker's tree is killed and frozen,
and what each kill did, for the stop report (semantics §15.6).

Two paths, chosen once per runtime (``Runtime.containment``):

- ``cgroup``: each worker lives in its own leaf (see ``cgroup``); a kill is the kernel's
  ``cgroup.kill``, a pause ``cgroup.freeze``. Ancestry, sessions and environments do not
  matter.
- ``walk``: the v2 walk (``procs``): the frozen worker's tree, its process group, what
  carries its tag, and what its death left with the pool's launcher. The launcher is a
  child subreaper (``_launcher``), so a dead worker's orphans, an env-cleared ``setsid``
  escapee included, re-parent to it; every child of the launcher that is not a worker
  is such an orphan (``Launcher.orphans``), and dies with the next unrooted kill pass.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from typing import Any

import psutil

from tether.contain.cgroup import LIMIT_CONTROLLERS, Leaf
from tether.contain.procs import alive, exiting
from tether.wire.records import ProcessFate

__all__ = ["cgroup_pass", "describe", "fates", "start_turn"]


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
    """Every process signalled, with whether it is dead now (a zombie is, and so is one
    already in its exit: after a cgroup's ``populated 0`` a task may not be a zombie yet)."""
    out = []
    for p, fate in found.values():
        if alive(p) and not exiting(p.pid):
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


def start_turn(leaf: Leaf | None, limits: dict[str, float] | None) -> str | None:
    """A turn's limits on its worker's leaf, and its figures' baselines; the reason if
    they cannot be applied (the turn then ends crashed rather than run unlimited: a
    session's limits were checked when it was made, but a later host on the same store
    may not have the controllers)."""
    missing = (
        sorted(limits or ())
        if leaf is None
        else sorted(k for k in limits or () if LIMIT_CONTROLLERS[k] not in leaf.controllers)
    )
    if missing:
        return f"the session's limits {missing} cannot be enforced by this host"
    assert leaf is not None
    try:
        leaf.set_limits(limits)
        leaf.begin_turn()
    except OSError as exc:
        return f"cannot apply the turn's limits to its cgroup: {exc}"
    return None
