"""A Tether host whose disk fills up mid-run (run as a script by test_round3_store.py).

Usage: ``python store_fault_child.py DB_PATH RUNS_LOG``. It opens a root session on a
file store and queues ``N`` messages (wake=False): each turn appends its message's name
to ``RUNS_LOG`` (a command run by the worker: work with an effect outside the store)
and says a few KiB. Then it caps the host's file size (``RLIMIT_FSIZE``) a little above
the store's current size and wakes the queue, so the store's commits start to fail a
few turns in. It tries a send and a few reads while the store is down and again once it
has failed for good, and prints one JSON line: the messages accepted, what every call
during the fault raised, and the host's pid. Then it waits to be SIGKILLed.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import time
from typing import Any

import tether
from tether import User
from tether.runtime import group_commit

N = 24
MARGIN = 48 * 1024  # bytes the store's files may still grow by


def main() -> None:
    path, runs_log = sys.argv[1], sys.argv[2]
    group_commit._GIVE_UP = 2.0  # fail for good soon: the test has no minute to spare
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG)
    rt = tether.Runtime(path, workers=1, grace=1.0)
    root = rt.open_session("tether:Scripted", slug="disk-full")
    owner = User(parent=root)
    accepted: list[str] = []
    for i in range(N):
        steps: list[dict[str, Any]] = [
            {"op": "tool", "argv": ["sh", "-c", f"echo M{i} >> {runs_log}"]},
            {"op": "say", "text": f"M{i} " + "x" * 4000},
        ]
        accepted.append(rt.send(root, f"M{i}", authority=owner, data={"steps": steps}, wake=False))
    store = rt._store
    store.flush()
    # The disk stays full: a background checkpoint that resets the WAL would let later
    # commits reuse its space and the store recover (seen under load), which is not
    # the fault this test is about.
    store._commits._stop_checkpointer()
    size = max(os.path.getsize(path), os.path.getsize(path + "-wal"))
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + MARGIN, hard))
    accepted.append(rt.send(root, "go", authority=owner))  # wakes the queue: M0 first

    def calls() -> dict[str, str]:
        """Every public call a user might make now: what each raised."""
        out: dict[str, str] = {}
        probes: dict[str, Any] = {
            "send": lambda: rt.send(root, "late", authority=owner),
            "spawn": lambda: rt.spawn(root, "tether:Scripted"),
            "turns": lambda: rt.turns(root),
            "transcript": lambda: rt.transcript(root, limit=5),
            "inbox": lambda: rt.inbox(root),
            "status": lambda: rt.status(root),
        }
        for name, call in probes.items():
            try:
                result = call()
            except tether.TetherError as exc:
                out[name] = exc.code
            except Exception as exc:  # a raw error: the test fails on it
                out[name] = f"raw {type(exc).__module__}.{type(exc).__name__}: {exc}"
            else:
                if name == "send":
                    accepted.append(str(result))
                out[name] = "ok"
        return out

    deadline = time.monotonic() + 30.0
    engine = store._commits
    if not hasattr(engine, "down"):  # an engine from before this test (to show the bug)
        time.sleep(8.0)
        down = failed = calls()
    else:
        while not engine.down and time.monotonic() < deadline:
            time.sleep(0.01)
        down = calls() if engine.down else {}
        while not store.failed and time.monotonic() < deadline:
            time.sleep(0.01)
        failed = calls() if store.failed else {}
    report = {"root": root, "accepted": accepted, "down": down, "failed": failed}
    print(json.dumps({**report, "host": os.getpid()}), flush=True)
    threading.Event().wait(60.0)  # killed long before this
    sys.exit(1)


if __name__ == "__main__":
    main()
