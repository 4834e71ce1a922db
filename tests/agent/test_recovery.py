"""Durable turns (semantics §17.1) with ChatAgent against the real model server: each
tool call's start is durable before the tool runs, under a key the tool is given; a
turn a crash interrupted (its worker SIGKILLed, its host SIGKILLed or stopped) runs on
from its last durable step, and a call that was running is reported unknown, never
silently run again."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from drivers import (
    TESTS,
    Recorder,
    eventually,
    family,
    line_from,
    local_pool,
    sigkilled_host,
    worker_with_tool,
    write_locked,
)
from tether import User
from tether.testing import ModelServer

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("api_key")]

CHAT = "tether.agents:ChatAgent"
KEY_ENV = "TETHER_TEST_MODEL_KEY"
SECRET = "sk-tether-test-recovery-0123456789"
SCRIPTED = "tether.driver.scripted:Scripted"


def _config(server: ModelServer, script: str, **extra: Any) -> dict[str, Any]:
    model = {"base_url": server.url, "name": script, "api_key_env": KEY_ENV, "timeout": 30}
    return {"model": model, "tools": ["run_command"], **extra}


def _agent(
    rt: tether.Runtime, server: ModelServer, script: str, replies: list[dict[str, Any]]
) -> tuple[str, str, User]:
    server.script(script, replies)
    return family(rt, CHAT, root_driver=SCRIPTED, config=_config(server, script))


def _call(argv: list[str]) -> dict[str, Any]:
    return {"name": "run_command", "arguments": {"argv": argv}}


# The tool reads its own start from the store while it runs: the row is there already.
_READS_ITS_START = """
import os, sqlite3, sys
key = os.environ["TETHER_CALL_ID"]
row = sqlite3.connect(sys.argv[1]).execute(
    "SELECT name, arguments FROM calls WHERE key=?", (key,)).fetchone()
print(key, row[0] if row else None)
"""


def test_a_tool_calls_start_is_durable_before_it_runs_and_the_tool_gets_its_call_key(
    server: ModelServer, db_path: str
) -> None:
    argv = [sys.executable, "-c", _READS_ITS_START, db_path]
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_call(argv), _call(argv)]},
        {"text": "done"},
    ]
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "reads-its-start", replies)
        rt.send(child, "go", authority=me)
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "completed"
        tools = [e for e in rt.transcript(child) if e.kind == "tool"]
    assert len(tools) == 2
    keys = []
    for entry in tools:
        out = json.loads(entry.text)["stdout"].split()
        assert entry.data is not None
        key = entry.data["call"]
        # the key it was given is its entry's, and its start was in the store as it ran
        assert out == [key, "run_command"], (out, entry.data)
        keys.append(key)
    assert len(set(keys)) == 2
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT key, tool_call_id FROM calls ORDER BY rowid").fetchall()
    assert [r[0] for r in rows] == keys
    assert [r[1] for r in rows] == [e.data["tool_call_id"] for e in tools if e.data]


def _kill(proc: psutil.Process) -> None:
    proc.send_signal(signal.SIGKILL)  # from outside: nothing of Tether's did it


def _worker(rt: tether.Runtime, session: str) -> psutil.Process:
    """The worker process running ``session``'s turn now."""
    turn = rt.status(session).turn
    assert turn is not None
    pool = local_pool(rt)
    return psutil.Process(eventually(lambda: pool.turns.worker(turn), what="its worker").pid)


def test_a_worker_killed_mid_tool_recovers_the_turn_and_the_call_is_unknown_not_run_again(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    # Each run of the tool adds a line, then hangs: a call run twice would show two.
    tool = f"import time\nopen({str(ran)!r}, 'a').write('ran\\n')\ntime.sleep(300)"
    argv = [sys.executable, "-c", tool]
    replies: list[dict[str, Any]] = [
        {"text": "Running it.", "tool_calls": [_call(argv)]},
        {"text": "It may or may not have run; I will not run it again."},
    ]
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "killed-mid-tool", replies)
        rt.send(child, "run it", authority=me)
        turn = rt.wait(child, until="running").turn
        eventually(lambda: ran.exists(), timeout=30.0, what="the tool running")
        _kill(worker_with_tool(rt, "python"))
        ended = rec.turn_ended(child, timeout=30.0)
        assert (ended["outcome"], ended["turn"]) == ("completed", turn), ended
        [record] = rt.turns(child)
        assert (record.id, record.recoveries, record.outcome) == (turn, 1, "completed")
        log = rt.transcript(child)
    assert ran.read_text() == "ran\n"  # it ran once: never again after the crash
    kinds = [e.kind if e.kind != "marker" else e.action for e in log]
    assert kinds == ["user", "assistant", "recovered", "tool", "assistant"], kinds
    marker = log[2]
    assert marker.text == (
        "↻ Recovered after the worker died (attempt 1): 1 step kept,"
        " 1 tool call unknown (run_command)"
    )
    unknown = "unknown: its worker died while this call ran; it may or may not have taken effect"
    assert log[3].text == unknown and log[3].data is not None and log[3].data["unknown"]
    # the model was told, as the call's result, after the reply that asked for it
    _, second = server.requests_for("killed-mid-tool")
    assert second.body["messages"][-1] == {
        "role": "tool",
        "tool_call_id": first_call_id(log[1]),
        "content": unknown,
    }
    assert [m["role"] for m in second.body["messages"]] == ["user", "assistant", "tool"]


def first_call_id(entry: tether.Entry) -> str:
    assert entry.data is not None
    return str(entry.data["tool_calls"][0]["id"])


def test_a_worker_killed_mid_stream_sends_the_request_again_and_keeps_the_finished_steps(
    server: ModelServer, db_path: str
) -> None:
    replies: list[dict[str, Any]] = [
        {"tool_calls": [_call(["echo", "step-one"])]},
        {"text": "halfway", "chunk": 2, "hang": True},  # the worker dies mid-stream
        {"text": "the end"},
    ]
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "killed-mid-stream", replies)
        rt.send(child, "go", authority=me)
        server.wait_requests(2, script="killed-mid-stream", timeout=30.0)
        _kill(_worker(rt, child))
        ended = rec.turn_ended(child, timeout=30.0)
        assert ended["outcome"] == "completed", ended
        log = rt.transcript(child)
    kinds = [e.kind if e.kind != "marker" else e.action for e in log]
    # the finished step (the command and its result) never ran again
    assert kinds == ["user", "assistant", "tool", "recovered", "assistant"], kinds
    assert log[-1].text == "the end"
    requests = server.requests_for("killed-mid-stream")
    assert len(requests) == 3
    # the request in flight was sent again: the same messages as the one cut
    assert requests[2].body["messages"] == requests[1].body["messages"]


def test_a_turn_that_crashes_more_than_max_recoveries_ends_crashed_saying_so(
    server: ModelServer, db_path: str
) -> None:
    replies = [{"text": "never ends", "hang": True, "count": 10}]
    with tether.Runtime(db_path, workers=1, grace=1.0, max_recoveries=1) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "crashes-twice", replies)
        rt.send(child, "go", authority=me)
        for n in (1, 2):
            server.wait_requests(n, script="crashes-twice", timeout=30.0)
            _kill(_worker(rt, child))
        ended = rec.turn_ended(child, timeout=30.0)
        [record] = rt.turns(child)
    assert ended["outcome"] == "crashed"
    assert (record.recoveries, record.error) == (1, "crashed 2 times; not recovered again")


def test_a_session_that_parks_on_a_crash_ends_its_turn_crashed_as_before(
    server: ModelServer, db_path: str
) -> None:
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        server.script("parks", [{"text": "never ends", "hang": True}])
        root = rt.open_session(SCRIPTED)
        child = rt.spawn(root, CHAT, config=_config(server, "parks"), on_crash="park")
        assert isinstance(child, str)
        rt.send(child, "go", authority=User(parent=root))
        server.wait_requests(1, script="parks", timeout=30.0)
        _kill(_worker(rt, child))
        assert rec.turn_ended(child, timeout=30.0)["outcome"] == "crashed"
        assert rt.turns(child)[0].recoveries == 0


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({"on_crash": "retry"}, "on_crash must be one of"),
        ({"max_recoveries": -1}, "max_recoveries must be an integer"),
        ({"max_recoveries": True}, "max_recoveries must be an integer"),
    ],
)
def test_a_bad_crash_policy_is_refused_naming_the_field(given: dict[str, Any], error: str) -> None:
    with tether.Runtime(workers=1) as rt, pytest.raises(tether.InvalidParams, match=error):
        rt.open_session(SCRIPTED, **given)
    with pytest.raises(tether.InvalidParams, match=error):
        tether.Runtime(workers=1, **given)


def _host_argv(server: ModelServer, script: str, final: str, db_path: str, ran: Path) -> list[str]:
    """A host (tests/recovery_host.py) whose ChatAgent runs a tool that notes each run in
    ``ran`` and hangs, then says ``final``. The host goes on once the tool's note is
    written (the file ``<ran>.started``, made after it)."""
    started = f"{ran}.started"
    tool = (
        f"import time\nopen({str(ran)!r}, 'a').write('ran\\n')\n"
        f"open({started!r}, 'w').close()\ntime.sleep(300)"
    )
    server.script(
        script,
        [
            {"text": "Running it.", "tool_calls": [_call([sys.executable, "-c", tool])]},
            {"text": final},
        ],
    )
    config = json.dumps(_config(server, script))
    return [sys.executable, str(TESTS / "recovery_host.py"), db_path, config, started]


def test_a_turn_whose_host_was_sigkilled_mid_tool_recovers_at_the_next_start_without_a_send(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    final = "Recovered, without running it again."
    argv = _host_argv(server, "host-killed", final, db_path, ran)
    with sigkilled_host(argv, timeout=60.0) as (ready, _tree):
        pass  # the whole old host is gone before the next start
    root, turn = ready["root"], ready["turn"]
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        # claimed before the start returned: running (or done already), never parked
        assert rt.status(root).state in ("running", "idle")
        rt.wait(root, until="idle", timeout=30.0)
        [record] = rt.turns(root)
        log = rt.transcript(root)
    assert (record.id, record.outcome, record.recoveries) == (turn, "completed", 1)
    assert ran.read_text() == "ran\n"
    kinds = [e.kind if e.kind != "marker" else e.action for e in log]
    assert kinds == ["user", "assistant", "recovered", "tool", "assistant"], kinds
    assert log[2].text == (
        "↻ Recovered after the host stopped (attempt 1): 1 step kept,"
        " 1 tool call unknown (run_command)"
    )
    unknown = "unknown: the host stopped while this call ran; it may or may not have taken effect"
    assert log[3].text == unknown
    assert server.requests_for("host-killed")[-1].body["messages"][-1]["content"] == unknown


def test_a_deploy_that_stops_the_host_with_sigterm_suspends_the_turn_and_the_next_start_recovers_it(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    argv = _host_argv(server, "deployed", "Back after the deploy.", db_path, ran)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as host:
        ready = json.loads(line_from(host, 60.0))
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=30.0) == 0  # it closed: nothing killed it
    root, turn = ready["root"], ready["turn"]
    with sqlite3.connect(db_path) as db:  # left open by the close, not ended
        assert db.execute("SELECT outcome FROM turns WHERE id=?", (turn,)).fetchone() == (None,)
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rt.wait(root, until="idle", timeout=30.0)
        [record] = rt.turns(root)
        log = rt.transcript(root)
    assert (record.id, record.outcome, record.recoveries) == (turn, "completed", 1)
    assert ran.read_text() == "ran\n"
    assert log[2].text.startswith("↻ Recovered after the host stopped (attempt 1)")
    assert log[-1].text == "Back after the deploy."


# ---- controls across a crash (semantics §17.1) -----------------------------------------------


def _host_with_controls(
    server: ModelServer, script: str, db_path: str, ran: Path, controls: list[list[str]]
) -> tuple[str, str]:
    """A host whose ChatAgent runs a hanging tool, given ``controls`` once the tool runs,
    SIGKILLed once each control has returned: its root and turn."""
    argv = _host_argv(server, script, "Went on, as steered.", db_path, ran)
    controls_argv = [*argv, "tether.agents:ChatAgent", json.dumps(controls)]
    with sigkilled_host(controls_argv, timeout=60.0) as (ready, _tree):
        pass
    return ready["root"], ready["turn"]


def test_a_cancel_accepted_before_the_host_died_ends_the_recovered_turn_cancelled(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    # The pause holds the cancel back from the driver: the turn is still open when the
    # host dies, with only the record of the cancel to go on.
    ran = tmp_path / "ran"
    controls = [["pause", "hold it"], ["cancel", "not needed any more"]]
    root, turn = _host_with_controls(server, "cancelled-then-killed", db_path, ran, controls)
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        info = rt.wait(root, until="parked", timeout=30.0)
        assert info.turn is None
        [record] = rt.turns(root)
        report = rt.stop_report(turn)
        log = rt.transcript(root)
    assert (record.id, record.outcome, record.cause, record.reason) == (
        turn,
        "cancelled",
        "user",
        "not needed any more",
    )
    assert report is not None and (report.kind, report.outcome, report.via) == (
        "cancel",
        "cancelled",
        "recovery",
    )
    assert ran.read_text() == "ran\n"  # nothing of the turn ran again
    assert len(server.requests_for("cancelled-then-killed")) == 1
    actions = [e.action for e in log if e.kind == "marker"]
    assert actions == ["paused", "cancelled"], actions


def test_a_turn_paused_before_the_host_died_recovers_paused_and_its_steer_reaches_it_on_resume(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    controls = [["steer", "use the cached build"], ["pause", "hold it"]]
    root, turn = _host_with_controls(server, "paused-then-killed", db_path, ran, controls)
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        # recovered paused: running, its turn the same, and no worker takes it
        info = rt.status(root)
        assert (info.state, info.turn, info.dispatched) == ("paused", turn, False), info
        assert len(server.requests_for("paused-then-killed")) == 1
        rt.resume(root, authority=User(parent=root))
        rt.wait(root, until="idle", timeout=30.0)
        [record] = rt.turns(root)
        log = rt.transcript(root)
    assert (record.id, record.outcome, record.recoveries) == (turn, "completed", 1)
    assert ran.read_text() == "ran\n"
    actions = [e.action for e in log if e.kind == "marker"]
    assert actions == ["paused", "recovered", "resumed", "steered"], actions
    last = server.requests_for("paused-then-killed")[-1].body["messages"]
    assert "use the cached build" in json.dumps(last)


def test_a_control_of_a_recoverable_turn_answers_only_once_its_record_is_durable(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    """With the store's write lock held by another process, the cancel stands (the
    turn stops) but its call says the record may not survive a crash, instead of
    returning as if it would."""
    ran = tmp_path / "ran"
    tool = f"import time\nopen({str(ran)!r}, 'a').write('ran\\n')\ntime.sleep(300)"
    replies: list[dict[str, Any]] = [{"tool_calls": [_call([sys.executable, "-c", tool])]}]
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = _agent(rt, server, "control-under-lock", replies)
        rt.send(child, "go", authority=me)
        eventually(lambda: ran.exists(), timeout=30.0, what="the tool running")
        with write_locked(db_path):
            with pytest.raises(tether.StoreUnavailable, match="took effect, but its record"):
                rt.interrupt(child, authority=me, kind="abort", reason="stop now")
            assert rec.turn_ended(child, timeout=10.0)["outcome"] == "aborted"
        # the lock gone, the queued records commit: the abort is there after all

        def turns() -> list[tether.TurnRecord] | None:
            try:
                return rt.turns(child)
            except tether.StoreUnavailable:
                return None  # the writer's retry has not come round yet

        records = eventually(turns, timeout=20.0, what="the store back")
        assert [r.outcome for r in records] == ["aborted"]
