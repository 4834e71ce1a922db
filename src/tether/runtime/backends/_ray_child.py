"""Entry point of a turn's worker process under a Ray slot: worker.py's own turn loop.

``python -m tether.runtime.backends._ray_child FD TOKEN``: FD is this end of the slot's
socketpair. ``worker_main`` puts the process in its own session and process group (a
Ray worker is a group leader itself, so the slot never signals its own group) and makes
it a subreaper for its tools. Ray is not imported here.

Before that, it starts the tree's *keeper*. When a Ray worker exits (its job's driver,
our host, died, say), Ray SIGKILLs that worker's children: the turn's worker dies with
no chance to sweep its tree, and a tool that left its session would outlive it. The
keeper waits on a pipe that only the worker holds open; when the pipe closes (the
worker is gone, however it died) it kills every process tagged with the tree's TOKEN,
then exits. It is started by a double fork, before the worker becomes a subreaper, so
that it is in no one's tree of ours: Ray's kill of the slot's children misses it, and
so do the worker's own sweeps of what a command left behind. Its parent is the nearest
subreaper above the slot (the host, when the host started Ray) or init. It then execs
itself (``--keep TOKEN FD``) without the tree's tag in its environment, so that no sweep
by that tag ever takes it: a sweeper killed between its freeze and its kill (a slot or
a reaper that Ray kills meanwhile) would leave a tagged keeper stopped for good.

Under cgroup containment (``python -m tether.runtime.backends._ray_child FD TOKEN LEAF``) the
worker joins the leaf LEAF first thing in ``worker_main`` (the keeper, started just
before, stays outside), and the keeper's sweep starts with ``cgroup.kill`` of the leaf,
which takes what left the session and cleared its environment too (and is then all
the sweep there is).

``python -m tether.runtime.backends._ray_child --check DRIVER``: import the driver and exit 0, or
print why it cannot be loaded and exit 1 (a slot busy with a turn checks drivers so).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

from tether.runtime._cgroup import kill_leaf
from tether.runtime._procs import TREE_ENV, sweep
from tether.runtime.worker import load_driver, worker_main
from tether.wire.errors import DriverNotFound

_KEEPER_PASSES = 50


def _start_keeper(token: str, channel: int, leaf: str | None) -> None:
    """Start the keeper of this worker's tree (see the module's docstring); return once
    it has exec'd (its command line names it for the slot to find)."""
    done, held = os.pipe()  # not inheritable: the worker's tools never hold ``held``
    execd, execing = os.pipe()  # close-on-exec: EOF once the keeper has exec'd
    middle = os.fork()
    if middle == 0:
        try:
            os.close(held)
            os.close(execd)
            os.close(channel)  # the slot must see EOF when the worker dies, not wait on us
            os.setsid()
            if os.fork() == 0:
                os.set_inheritable(done, True)
                env = {k: v for k, v in os.environ.items() if k != TREE_ENV}
                argv = [sys.executable, "-m", "tether.runtime.backends._ray_child", "--keep", token]
                argv += [str(done)] if leaf is None else [str(done), leaf]
                os.execve(sys.executable, argv, env)
        finally:
            os._exit(0)
    os.close(done)
    os.close(execing)
    os.waitpid(middle, 0)  # the keeper has its new parent once the middle one is reaped
    os.read(execd, 1)
    os.close(execd)


def _keep(token: str, done: int, leaf: str | None) -> None:
    """The keeper, once exec'd: wait for the worker to be gone, then sweep its tree."""
    os.read(done, 1)  # returns (empty) once the worker's end of the pipe is closed
    if leaf is not None and kill_leaf(leaf):
        # everything of the tree was in the leaf (nothing leaves a cgroup on its own):
        # no sweep by tag, which costs seconds of process scans on a busy node
        with contextlib.suppress(OSError):  # the slot may be removing it too
            os.rmdir(leaf)
        return
    sweep([], passes=_KEEPER_PASSES, token=token)


def main() -> None:
    if sys.argv[1] == "--keep":
        _keep(sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
        return
    if sys.argv[1] == "--check":
        try:
            load_driver(sys.argv[2])
        except DriverNotFound as exc:
            print(exc.message)
            sys.exit(1)
        return
    fd, token = int(sys.argv[1]), sys.argv[2]
    leaf = sys.argv[3] if len(sys.argv) > 3 else None
    _start_keeper(token, fd, leaf)
    worker_main(socket.socket(fileno=fd), token, leaf)


if __name__ == "__main__":
    main()
