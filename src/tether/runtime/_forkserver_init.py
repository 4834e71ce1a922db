"""Imported by the pool's forkserver when it starts (a preload), never by the host.

It makes the forkserver a child subreaper: the forkserver is every worker's parent, so
when a worker dies without sweeping its tree (SIGKILL), the tools it left, an
env-cleared ``setsid`` escapee included, re-parent to the forkserver instead of to PID 1,
where the pool's reaper finds them (``_contain.forkserver_orphans``). The forkserver
already reaps any child that exits; its warning about a pid it did not start is
silenced, since those are exactly these orphans.

The subreaper flag is not inherited across fork, so the workers (subreapers of their own
tools) are unaffected.
"""

from __future__ import annotations

import sys
import warnings

__all__: list[str] = []


def _in_forkserver() -> bool:
    frame = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.endswith(
            ("multiprocessing/forkserver.py", "multiprocessing\\forkserver.py")
        ):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if _in_forkserver():
    from tether.runtime.worker import set_subreaper

    set_subreaper()
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
