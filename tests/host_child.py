"""A Tether host in its own process, for the host-crash test (run as a script).

Usage: ``python host_child.py DB_PATH``. It opens a root session on a file store, starts
a turn that hangs, queues two more messages behind it, prints one JSON line
``{"root": ..., "turn": ..., "host": pid}`` once all of that is durable, and then waits
to be killed (SIGKILL). It never closes the runtime: the point is a host that dies mid-turn.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import tether


def main() -> None:
    path = sys.argv[1]
    rt = tether.Runtime(path, workers=1, grace=1.0)
    root = rt.open_session("tether:Scripted", slug="crash-root")
    rt.prompt(root, "A", data={"steps": [{"op": "hang"}]})
    info = rt.wait(root, until="running", timeout=10.0)
    rt.prompt(root, "B")
    rt.prompt(root, "C")
    info = rt.status(root)
    assert info.state == "running" and info.pending == 2, info
    print(json.dumps({"root": root, "turn": info.turn, "host": os.getpid()}), flush=True)
    threading.Event().wait(60.0)  # killed long before this
    sys.exit(1)


if __name__ == "__main__":
    main()
