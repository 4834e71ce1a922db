"""The Ray that a host started dies with the host (run as a script by ``backends.ray``).

``python -m tether.runtime.backends._ray_guard PID:START ...``: when ``ray.init`` starts a local
Ray (no address), its daemons are this host's descendants. If the host is SIGKILLed,
Ray's own reaper kills their process group, but its agents (each in a group of its own)
linger: a minute here. The host starts this guard in a session of its own, with a pipe
on its stdin that only the host holds. Once the pipe reads EOF (the host is gone, or it
shut Ray down), the guard kills every listed daemon that is still the same process (its
pid and start time), with everything below it, and exits.
"""

from __future__ import annotations

import contextlib
import sys

import psutil

from tether.contain.procs import sweep

_PASSES = 20


def main() -> None:
    daemons: list[tuple[int, float]] = []
    for arg in sys.argv[1:]:
        pid_text, start_text = arg.split(":")
        daemons.append((int(pid_text), float(start_text)))
    while sys.stdin.buffer.read(4096):
        pass
    roots: list[int] = []
    for pid, start in daemons:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).create_time() == start:
                roots.append(pid)
    sweep(roots, passes=_PASSES)


if __name__ == "__main__":
    main()
