"""A Tether host running a recoverable turn, for the durable-turn tests (run as a script).

Usage: ``python recovery_host.py DB_PATH CONFIG_JSON MARK [DRIVER [CONTROLS_JSON]]``. It
opens a root session of DRIVER (by default ChatAgent) with the config, sends it one
message, waits until the file ``MARK`` exists (the turn's tool wrote it: the tool runs),
issues the controls (a list of ``[kind, reason]``: an interrupt's kind, or ``pause``),
prints one JSON line ``{"root": ..., "turn": ...}`` once each has returned, and then
waits to be killed (SIGKILL) or
stopped (SIGTERM: the runtime is closed with ``turns="suspend"``, as ``tether serve``
does on a deploy).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import tether


def main() -> None:
    path, config, mark = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    driver = sys.argv[4] if len(sys.argv) > 4 else "tether.agents:ChatAgent"
    controls = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []
    rt = tether.Runtime(path, workers=1, grace=1.0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    root = rt.open_session(driver, config=config)
    rt.prompt(root, "run it")
    turn = rt.wait(root, until="running", timeout=30.0).turn
    deadline = time.monotonic() + 30.0
    while not os.path.exists(mark):  # the tool's own file: no event reaches this process
        assert time.monotonic() < deadline, "the tool never ran"
        time.sleep(0.01)
    me = tether.User(parent=root)
    for kind, reason in controls:
        if kind == "pause":
            rt.pause(root, authority=me, reason=reason)
        else:
            rt.interrupt(root, authority=me, kind=kind, reason=reason)
    print(json.dumps({"root": root, "turn": turn}), flush=True)
    stop.wait(60.0)
    rt.close(turns="suspend")
    sys.exit(0)


if __name__ == "__main__":
    main()
