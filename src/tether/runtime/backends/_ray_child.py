"""Entry point of a turn's worker process under a Ray slot: worker.py's own turn loop, and
its tree's keeper.

``python -m tether.runtime.backends._ray_child FD TOKEN [LEAF]`` runs a turn child;
``--check DRIVER [CONFIG_JSON]`` imports a driver, checks the config as a pool's worker
would, and prints its ProbeReply as JSON. Why the
keeper exists and how it is started: docs/design.md, section 11.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import msgspec

from tether.contain.cgroup import kill_leaf
from tether.contain.procs import TREE_ENV, sweep
from tether.runtime.worker import probe_driver, worker_main

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
        config = msgspec.json.decode(sys.argv[3]) if len(sys.argv) > 3 else None
        print(msgspec.json.encode(probe_driver(sys.argv[2], config)).decode())
        return
    fd, token = int(sys.argv[1]), sys.argv[2]
    leaf = sys.argv[3] if len(sys.argv) > 3 else None
    _start_keeper(token, fd, leaf)
    worker_main(socket.socket(fileno=fd), token, leaf)


if __name__ == "__main__":
    main()
