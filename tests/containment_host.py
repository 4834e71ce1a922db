"""A Tether host in its own process whose turn starts an escapee (tests/engine/test_containment.py).

Usage: ``python containment_host.py DB_PATH CONTAINMENT TOKEN [pause]``. It opens a root
session on a file store, runs a turn whose tool starts the env-cleared ``setsid``
escapee named ``TOKEN`` (see ``ESCAPEE`` in test_containment.py, passed as argv[5]),
waits until the escapee runs (and, with ``pause``, pauses the turn), prints one JSON
line ``{"root", "turn", "host", "leaf", "containment"}`` and waits to be killed
(SIGKILL). It never closes the runtime: the point is a host that dies mid-turn.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import psutil

import tether
from tether import User


def _running(token: str) -> bool:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0] == token:
            return True
    return False


def main() -> None:
    path, containment, token, script = sys.argv[1:5]
    pause = sys.argv[5:] == ["pause"]
    rt = tether.Runtime(path, workers=1, grace=1.0, containment=containment)
    root = rt.open_session("tether:Scripted", slug="contained")
    child = rt.spawn(root, "tether:Scripted", slug="tool")
    me = User(parent=root)
    rt.send(
        child, "go", authority=me, data={"steps": [{"op": "tool", "argv": ["sh", "-c", script]}]}
    )
    info = rt.wait(child, until="running", timeout=10.0)
    deadline = time.monotonic() + 10.0
    while not _running(token):
        assert time.monotonic() < deadline, "the escapee did not start"
        time.sleep(0.02)
    if pause:
        assert rt.pause(child, authority=me) == [info.turn]
    cgroups = getattr(rt, "_cgroups", None)
    print(
        json.dumps(
            {
                "root": root,
                "child": child,
                "turn": info.turn,
                "host": os.getpid(),
                "group": None if cgroups is None else cgroups.base,
                "leaves": []
                if cgroups is None
                else sorted(os.path.basename(leaf.path) for leaf in cgroups.leaves()),
                "containment": rt.containment,
            }
        ),
        flush=True,
    )
    threading.Event().wait(60.0)  # killed long before this
    sys.exit(1)


if __name__ == "__main__":
    main()
