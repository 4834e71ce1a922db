"""Process trees: find a process's descendants quickly."""

from __future__ import annotations

import contextlib
import os
import signal

import psutil

__all__ = ["descendants", "freeze_tree", "thaw_tree"]


def descendants(pid: int) -> list[psutil.Process]:
    """``pid``'s descendants, parents before children.

    On Linux this reads only the subtree (``/proc/<pid>/task/<tid>/children``) instead of
    every process on the machine, which is what ``psutil.children`` does: an abort must
    not get slower because the machine is busy.
    """
    pids: list[int] = []
    todo = [pid]
    try:
        while todo:
            parent = todo.pop(0)
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                pids.extend(kids)
                todo.extend(kids)
    except FileNotFoundError:
        pass  # a process of the tree exited meanwhile: what we have is what is left
    except OSError:
        return _psutil_descendants(pid)  # no /proc children files: ask psutil
    procs = []
    for p in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(p))
    return procs


def _psutil_descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def freeze_tree(leader: int) -> list[int]:
    """SIGSTOP ``leader``'s process group, then every descendant outside it (an escapee
    that called ``setsid``), walking again until a walk finds nothing new: a process
    forked while we walked is caught by the next walk. Returns the escapees stopped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGSTOP)
    stopped: set[int] = set()
    while True:
        found = []
        for p in descendants(leader):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                if p.pid not in stopped and os.getpgid(p.pid) != leader:
                    found.append(p.pid)
        if not found:
            return sorted(stopped)
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
                stopped.add(pid)


def thaw_tree(leader: int, escapees: list[int]) -> None:
    """SIGCONT exactly what ``freeze_tree`` stopped: the group and those escapees."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGCONT)
    for pid in escapees:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
