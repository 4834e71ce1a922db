"""A host's cgroups die with the host (run as a script by ``cgroup.Cgroups``).

``python -I -S guard.py GROUP PREFIX``: the host starts this guard, in a session
of its own, with a pipe on its stdin that only the host holds. Once the pipe reads EOF
(the host closed, or died: a SIGKILL included), the guard writes ``cgroup.kill`` in every
leaf of the host's (named ``PREFIX…``), waits until each is empty, and removes it. Only
those: the next host on the same store makes its leaves in the same group, maybe
already, and the group itself is left to the hosts (one may be about to make a leaf).

Why a process of its own: a worker whose turn is paused is frozen by ``cgroup.freeze``,
and a frozen process runs nothing, not even the sweep a worker does when its host
channel closes (SIGCONT does not thaw a cgroup). Only a process outside every leaf can
end it, and ``cgroup.kill`` works on a frozen cgroup. Run by path with only the standard
library, so it starts in milliseconds and holds none of the host's descriptors.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

_WAIT = 5.0  # seconds a leaf may take to empty after cgroup.kill


def _leaves(group: str, prefix: str) -> list[str]:
    try:
        names = [n for n in os.listdir(group) if n.startswith(prefix)]
    except OSError:
        return []
    return [p for n in names if os.path.isdir(p := os.path.join(group, n))]


def _populated(leaf: str) -> bool:
    try:
        with open(os.path.join(leaf, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except OSError:
        return False  # gone


def clear(group: str, prefix: str) -> None:
    """Kill every leaf of ``group`` named ``prefix…``, wait for it to empty, remove it."""
    leaves = _leaves(group, prefix)
    for leaf in leaves:
        with contextlib.suppress(OSError), open(os.path.join(leaf, "cgroup.kill"), "w") as f:
            f.write("1")
    deadline = time.monotonic() + _WAIT
    for leaf in leaves:
        while _populated(leaf) and time.monotonic() < deadline:
            time.sleep(0.005)
        with contextlib.suppress(OSError):
            os.rmdir(leaf)


def main() -> None:
    group, prefix = sys.argv[1], sys.argv[2]
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    clear(group, prefix)


if __name__ == "__main__":
    main()
