"""A Tether host in its own process whose workers are busy talking to it when it is
SIGKILLed (run as a script; for the worker-exit test in test_round3_inputs.py), and the
drivers of test_round3_inputs.py (imported by workers as ``round3_host_child:...``).

Usage: ``python round3_host_child.py DB_PATH``. It opens ``WORKERS`` root sessions whose
turns say something over and over, prints one JSON line ``{"workers": [...]}`` once they
are all running, and waits to be killed. It never closes the runtime.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import tether

WORKERS = 3


class Chatter:
    """Says something over and over, with a boundary between, until stopped."""

    def run(self, ctx: Any) -> str:
        while True:
            ctx.say("x" * 2048)
            ctx.checkpoint()
            time.sleep(0.001)


def main() -> None:
    rt = tether.Runtime(sys.argv[1], workers=WORKERS, grace=1.0)
    roots = [rt.open_session("round3_host_child:Chatter") for _ in range(WORKERS)]
    for root in roots:
        rt.prompt(root, "talk")
    for root in roots:
        rt.wait(root, until="running", timeout=10.0)
    print(json.dumps({"workers": rt.worker_pids}), flush=True)
    threading.Event().wait(60.0)  # killed long before this
    sys.exit(1)


if __name__ == "__main__":
    main()


class HistorySize:
    """A message starting with "big" is answered at once; any other reads the whole
    history and answers with its length and total characters."""

    def run(self, ctx: Any) -> str:
        if ctx.message.content.startswith("big"):
            return "ok"
        history = ctx.history
        return f"{len(history)} entries, {sum(len(e.text) for e in history)} characters"
