"""Runtime bugs the soak found, each kept as a minimal reproduction.

1. A paused turn's processes survive a host SIGKILL, frozen, forever. Pause SIGSTOPs
   the worker's group and escapees (semantics §14.4); when the host dies, the worker is to
   sweep its descendants when its host channel closes (semantics §14.3), but a stopped worker
   runs nothing: it and its tools stay in state T, orphaned, holding every descriptor
   they inherited from the host (the soak hung reading the dead host's stdout). Expected:
   gone within a few seconds of the host's death, like an unpaused turn's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from drivers import still_running

_HOST = textwrap.dedent(
    """
    import json, os, sys, threading, tether
    rt = tether.Runtime(sys.argv[1], workers=1, grace=1.0)
    root = rt.open_session("tether:Scripted", slug="r")
    tag = sys.argv[2]
    rt.prompt(root, "go", data={"steps": [{"op": "tool", "argv": [
        "env", "SOAK_TAG=" + tag, "sh", "-c", "sleep 60 & sleep 60; wait", tag]}]})
    rt.wait(root, until="running", timeout=10)
    u = tether.User(parent=root)
    deadline = __import__("time").monotonic() + 10
    while not rt.pause(root, authority=u, reason="look"):
        assert __import__("time").monotonic() < deadline
    assert rt.status(root).state == "paused"
    print(json.dumps({"workers": rt.worker_pids}), flush=True)
    threading.Event().wait(60)
    """
)


def _tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "environ", "status"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            env = (p.info["environ"] or {}).get("SOAK_TAG", "")
            if env == tag or tag in " ".join(p.info["cmdline"] or []):
                out.append(p)
    return out


@pytest.mark.timeout(60)
def test_paused_turn_dies_with_its_host(tmp_path: Path) -> None:
    tag = f"soakfind-{os.getpid()}-{time.monotonic_ns()}"
    host = subprocess.Popen(
        [sys.executable, "-c", _HOST, str(tmp_path / "s.db"), tag],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    left: list[psutil.Process] = []
    workers: list[psutil.Process] = []
    try:
        assert host.stdout is not None
        line = host.stdout.readline()  # the host prints once the turn is paused
        assert line, "the host did not start"
        workers = []
        for pid in json.loads(line)["workers"]:
            with contextlib.suppress(psutil.NoSuchProcess):
                workers.append(psutil.Process(pid))
        os.kill(host.pid, signal.SIGKILL)
        host.wait(10)
        deadline = time.monotonic() + 10.0
        while (left := _tagged(tag) + still_running(workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        states = [f"{p.pid}:{p.status()}" for p in left if p.is_running()]
        assert not left, f"tagged processes of the killed host still alive: {states}"
    finally:
        for p in _tagged(tag) + still_running(workers):
            with contextlib.suppress(psutil.NoSuchProcess):
                # the frozen worker holds the tools; kill the lot (they are ours, tagged)
                for q in [*p.parents()[:1], p]:
                    if q.cmdline() and "tether.runtime._launcher" in " ".join(q.cmdline()):
                        q.kill()
                p.kill()
        if host.poll() is None:
            host.kill()
            host.wait(10)
        if host.stdout is not None:
            host.stdout.close()
