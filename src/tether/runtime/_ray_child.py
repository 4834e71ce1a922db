"""Entry point of a turn's worker process under a Ray slot: worker.py's own turn loop.

``python -m tether.runtime._ray_child FD TOKEN``: FD is this end of the slot's
socketpair. ``worker_main`` puts the process in its own session and process group (a
Ray worker is a group leader itself, so the slot never signals its own group) and makes
it a subreaper for its tools. Ray is not imported here.
"""

from __future__ import annotations

import inspect
import socket
import sys
from typing import Any

from tether.runtime.worker import worker_main


def main() -> None:
    fd, token = int(sys.argv[1]), sys.argv[2]
    sock = socket.socket(fileno=fd)
    entry: Any = worker_main
    if "token" in inspect.signature(worker_main).parameters:  # the tree tag, where taken
        entry(sock, token)
    else:
        entry(sock)


if __name__ == "__main__":
    main()
