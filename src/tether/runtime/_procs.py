"""Process trees: find a process's descendants quickly."""

from __future__ import annotations

import contextlib
import os

import psutil

__all__ = ["descendants"]


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
