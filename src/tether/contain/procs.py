"""Process trees: find them, freeze them, kill them (shared by the pool and the worker).

A kill is passes of FREEZE then KILL until a pass finds nothing alive; it never concludes
"dead" on a timeout. Why that order, and what is retried: docs/design.md, section 7.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import psutil

__all__ = [
    "TREE_ENV",
    "alive",
    "all_dead",
    "carries",
    "child_pids",
    "descendant_pids",
    "descendants",
    "exiting",
    "freeze",
    "freeze_tree",
    "kill_found",
    "kill_tree",
    "reap",
    "reap_pass",
    "reap_tree",
    "sweep",
    "tagged",
    "thaw_tree",
]

# Set in each worker's environment to a token of the pool's choosing, so that tools and
# their escapees inherit it: when a worker dies with no chance to sweep (SIGKILL), the
# pool finds what its tree left behind by this tag (see ``tagged``).
TREE_ENV = "TETHER_TREE"

_GONE = (FileNotFoundError, ProcessLookupError)
_HAS_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _children(pid: int) -> list[int]:
    """``pid``'s children (every thread's), or [] when it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except _GONE:
        return []
    kids: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids.extend(int(k) for k in f.read().split())
        except _GONE:
            continue  # that thread (or the process) ended meanwhile: the rest still count
    return kids


def child_pids(pid: int) -> list[int]:
    """``pid``'s children, or [] when it is gone."""
    return _children(pid) if _HAS_CHILDREN_FILES else _psutil_children(pid)


def carries(pid: int, name: str, value: str) -> bool:
    """True when ``pid``'s environment has ``name=value`` (False once it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except (*_GONE, PermissionError):
        return False
    return f"\0{name}={value}\0".encode() in b"\0" + env


def descendant_pids(roots: Iterable[int]) -> list[int]:
    """The descendants of ``roots``, parents before children; a vanished one is skipped.

    On Linux this reads only the subtree (``/proc/<pid>/task/<tid>/children``) instead of
    every process on the machine, which is what ``psutil.children`` does: an abort must
    not get slower because the machine is busy.
    """
    todo = deque(roots)
    seen = set(todo)
    order: list[int] = []
    while todo:
        parent = todo.popleft()
        kids = _children(parent) if _HAS_CHILDREN_FILES else _psutil_children(parent)
        for kid in kids:
            if kid not in seen:
                seen.add(kid)
                order.append(kid)
                todo.append(kid)
    return order


def _psutil_children(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def descendants(pid: int) -> list[psutil.Process]:
    """``pid``'s descendants, parents before children."""
    procs = []
    for p in descendant_pids([pid]):
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(p))
    return procs


def tagged(token: str) -> list[int]:
    """Every process whose environment carries ``TREE_ENV=token`` (one scan of /proc).

    Only for a tree whose root is gone: it reads every process's environment. A tool
    that both leaves the session and clears its environment is beyond this scan; the
    abort and host-death paths never rely on it (they walk a frozen, living root), and
    a dead worker's orphans are also found with the pool's launcher, a subreaper
    (``_launcher.Launcher.orphans``).
    """
    needle = f"\0{TREE_ENV}={token}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except (*_GONE, PermissionError):
            continue
        if needle in b"\0" + env:
            found.append(int(name))
    return found


def _signal(p: psutil.Process, sig: int) -> None:
    # psutil checks the process's start time first: a recycled pid is never signalled
    with contextlib.suppress(psutil.NoSuchProcess):
        p.send_signal(sig)


def freeze(
    roots: Sequence[int], *, group: int | None = None, token: str | None = None
) -> list[psutil.Process]:
    """The first half of a pass: SIGSTOP the process group ``group``, then ``roots``,
    their descendants and the processes tagged ``token``, walking again until a walk
    finds nothing new. Returns every process found, parents before children. This
    process itself is walked from but never signalled."""
    me = os.getpid()
    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGSTOP)
    found: dict[int, psutil.Process] = {}
    while True:
        start = [*roots, *(tagged(token) if token is not None else ())]
        fresh = []
        for pid in [*start, *descendant_pids(start)]:
            if pid in found or pid == me:
                continue
            try:
                p = psutil.Process(pid)
            except psutil.NoSuchProcess:
                continue
            found[pid] = p
            fresh.append(p)
            _signal(p, signal.SIGSTOP)
        if not fresh:
            return list(found.values())


def kill_tree(
    roots: Sequence[int], *, group: int | None = None, token: str | None = None
) -> list[psutil.Process]:
    """One pass: ``freeze``, then SIGKILL everything found, deepest first. Returns every
    process it found, for the caller to check."""
    procs = freeze(roots, group=group, token=token)
    kill_found(procs, group=group)
    return procs


def kill_found(procs: Sequence[psutil.Process], *, group: int | None = None) -> None:
    """The second half of a pass: SIGKILL what ``freeze`` found, deepest first, then the
    group."""
    for p in reversed(procs):  # deepest first
        _signal(p, signal.SIGKILL)
    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def reap(pids: Iterable[int]) -> None:
    """Collect the zombies among ``pids`` that are this process's children: tools that
    outlived their worker and were re-parented to us (a subreaper host). Only pids
    found by a walk of a dead tree are passed here, so no other code path's child (a
    worker, which its launcher reaps) is ever taken from it."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


_NOT_RUNNING = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # "X": its parent is reaping it
_PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()


def alive(p: psutil.Process) -> bool:
    """Running (the same process, not a recycled pid), not a zombie, not being reaped."""
    try:
        return p.is_running() and p.status() not in _NOT_RUNNING
    except psutil.NoSuchProcess:
        return False


def _exit_state(pid: int) -> bool | None:
    """``PF_EXITING`` of ``pid``; None when it is gone (or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return bool(int(fields[6]) & _PF_EXITING)  # field 9 of stat(5): flags
    except (OSError, IndexError, ValueError):
        return None


def exiting(pid: int) -> bool:
    """In the kernel's exit already (``PF_EXITING``), though not a zombie yet: it runs no
    more user code. Not dead for a walk (it has not handed its children to a reaper
    yet), but not a survivor of a kill either: a cgroup reads ``populated 0`` once its
    tasks are this far into their exit."""
    return _exit_state(pid) is True


def running(pid: int) -> bool:
    """Still there and not in its exit: its children are still its own."""
    return _exit_state(pid) is False


def all_dead(procs: Iterable[psutil.Process], timeout: float) -> bool:
    """Wait up to ``timeout`` for every process to be gone or a zombie; False if one is not.

    Polls, because there is no event for another process's child dying. The caller must
    treat False as "not dead yet", never as "dead enough".
    """
    deadline = time.monotonic() + timeout
    pause = 0.0001
    left = list(procs)
    while True:
        left = [p for p in left if alive(p)]
        if not left:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def sweep(roots: Sequence[int], *, passes: int, token: str | None = None) -> bool:
    """Passes of ``kill_tree`` until one finds nothing alive (True), at most ``passes``."""
    for _ in range(passes):
        live = [p for p in kill_tree(roots, token=token) if alive(p)]
        if not live:
            return True
        all_dead(live, 0.2)  # then walk again: nothing may be left
    return False


def _no_orphans() -> list[int]:
    return []


def reap_pass(
    root: int | None,
    *,
    group: int,
    token: str,
    orphans: Callable[[], list[int] | None] = _no_orphans,
    seen: Callable[[list[psutil.Process]], None] | None = None,
    wait: float = 0.2,
) -> bool:
    """One pass over a worker's tree; True when nothing of it is left alive.

    ``root``: the worker, alive (a subreaper, so its whole tree is below it): frozen
    with its group ``group``, walked, killed deepest first; the tree was whole (unless
    the root was in its exit, or gone, by the walk's end), so a pass that sees it all
    dead within ``wait`` is the proof. None once the worker is gone: its tree has
    dispersed, so the pass starts from ``orphans()`` (what it left with a
    subreaper of ours; None: not known now, the pass fails) and what carries ``token``,
    then walks again: only a second walk that finds nothing alive is the proof.
    ``seen`` hears every process found, before it is killed (for the stop report).
    Raises OSError (out of descriptors): the caller tries again later.
    """

    def one(starts: list[int], tagged_too: bool) -> list[psutil.Process]:
        procs = freeze(starts, group=group, token=token if tagged_too else None)
        if seen is not None:
            seen(procs)
        kill_found(procs, group=group)
        return procs

    if root is not None:
        procs = freeze([root], group=group)
        # A root in its exit (or gone) by the walk's end was handing its children on,
        # thread to thread and then to a reaper, while the walk read them: no proof.
        whole = running(root)
        if seen is not None:
            seen(procs)
        kill_found(procs, group=group)
        return whole and all_dead(procs, wait)
    first = orphans()
    if not all_dead(one(first or [], True), wait) or first is None:
        return False
    again = orphans()
    rest = one(again or [], True)
    return again is not None and not any(alive(p) for p in rest)


def reap_tree(root: int, token: str, timeout: float) -> bool:
    """Passes of ``reap_pass`` over the tree of ``root`` (a worker started with
    ``TREE_ENV=token``, leader of its group) until one proves it dead (True), or until
    ``timeout`` has passed (False). The root counts as alive only while it is still the
    process carrying the tag (not a recycled pid, not a zombie)."""
    deadline = time.monotonic() + timeout
    while True:
        rooted = root if carries(root, TREE_ENV, token) else None
        # a pass waits for what it killed, up to the deadline: a process killed by a
        # rooted pass (an env-cleared escapee) may be beyond the next, unrooted, pass
        left = max(0.0, deadline - time.monotonic())
        if reap_pass(rooted, group=root, token=token, wait=left):
            return True
        if time.monotonic() >= deadline:
            return False


def freeze_tree(leader: int) -> list[int]:
    """Pause: freeze the worker ``leader``'s whole tree with the abort's own walk (its
    group and every escapee). Returns the escapees stopped, for ``thaw_tree``."""
    procs = freeze([leader], group=leader)
    escapees = []
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(p.pid) != leader:
                escapees.append(p.pid)
    return escapees


def thaw_tree(leader: int, escapees: list[int]) -> None:
    """SIGCONT exactly what ``freeze_tree`` stopped: the group and those escapees."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGCONT)
    for pid in escapees:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
