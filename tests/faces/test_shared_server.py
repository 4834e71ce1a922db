"""The module-wide server of the face and CLI tests (``tests/tether_server.py``).

``settle`` runs after each test on a shared server: it must stop what the test left
running and see the server's process tree back to its idle shape, and it must fail
(not hang, not pass) when something cannot be stopped.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from drivers import HANG, SCRIPTED
from tether_server import SHARED, LiveServer, settle, shared_server, wait_until

SLEEP = {"steps": [{"op": "tool", "argv": ["sleep", "60"]}]}


def _sleeps(server: LiveServer) -> list[psutil.Process]:
    assert server.proc is not None
    top = psutil.Process(server.proc.pid)
    return [p for p in top.children(recursive=True) if p.name() == "sleep"]


def test_settle_aborts_what_a_test_left_running_and_the_workers_are_back(
    shared: LiveServer,
) -> None:
    server = shared
    assert server.proc is not None and server.proc.pid in SHARED
    root = server.call("session.open", {"driver": SCRIPTED})["session"]
    spawn = {"parent": root, "driver": SCRIPTED, "prompt": "go"}
    tool = server.call("subagent.spawn", {**spawn, "data": SLEEP})["session"]
    hang = server.call("subagent.spawn", {**spawn, "data": HANG})["session"]
    wait_until(lambda: _sleeps(server), what="the sleep tool")
    paused = server.call("subagent.pause", {"address": {"session": hang, "parent": root}})
    assert paused["turns"]
    settle(server)
    for kid in (tool, hang):
        assert server.call("subagent.status", {"session": kid})["state"] == "parked"
        assert server.call("subagent.turns", {"session": kid})["turns"][-1]["outcome"] == (
            "aborted"
        )
    assert not _sleeps(server)
    settle(server)  # nothing new since: a no-op


def test_settle_fails_when_a_turn_cannot_be_stopped(tmp_path: Path) -> None:
    with shared_server(tmp_path) as server:
        root = server.call("session.open", {"driver": SCRIPTED})["session"]
        # A one-shot has no address: nothing over RPC stops it (stopping the server does).
        once = {"op": "spawn", "slug": "once", "mode": "one-shot", "data": HANG}
        server.call("session.prompt", {"session": root, "content": "go", "data": {"steps": [once]}})
        server.wait_state(root, "idle")
        with pytest.raises(AssertionError, match=r"did not settle.*running"):
            settle(server, timeout=1.0)
