"""Durable turns (semantics §17.1) with the three framework adapters, the real frameworks
and the real Claude Code CLI against the scripted model server: a turn whose worker (or
host) is SIGKILLed while a tool runs recovers from its last durable step; the steps that
finished never run again (the tools note each run in a ledger file, the server counts
the requests), the call that was running is reported unknown to the model, and the turn
completes. And ``spawn_agent`` re-issued after a crash with the same call key makes no
second child.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import tether
from drivers import TESTS, Recorder, eventually, family, sigkilled_host, worker_with_tool
from tether.testing import ModelServer

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("api_key")]

KEY_ENV = "TETHER_TEST_RECOVER_KEY"
SECRET = "sk-tether-recover-0123456789"
SCRIPTED = "tether.driver.scripted:Scripted"
PYDANTIC = "tether.adapters.pydantic_ai:PydanticAIAgent"
OPENAI = "tether.adapters.openai_agents:OpenAIAgentsAgent"
WORKER_DIED = "unknown: its worker died while this call ran; it may or may not have taken effect"
HOST_STOPPED = "unknown: the host stopped while this call ran; it may or may not have taken effect"


def _config(server: ModelServer, script: str, agent: str, **extra: Any) -> dict[str, Any]:
    model = {"base_url": server.url, "name": script, "api_key_env": KEY_ENV, "timeout": 30}
    return {"agent": agent, "model": model, **extra}


ADAPTERS = {
    "pydantic_ai": (PYDANTIC, "adapter_agents:pydantic_ai_agent"),
    "openai_agents": (OPENAI, "adapter_agents_oai:ledgered"),
}


def _step(name: str, ledger: Path) -> dict[str, Any]:
    return {"name": "ledger_step", "arguments": {"step": name, "ledger": str(ledger)}}


def _ledger(ledger: Path) -> list[list[str]]:
    """The ledger's lines: ``[step, call key, worker pid]`` for each run of a step."""
    return [line.split() for line in ledger.read_text().splitlines()] if ledger.exists() else []


def _ran(ledger: Path, step: str) -> list[str]:
    return [line[1] for line in _ledger(ledger) if line[0] == step]


STEPS = ["user", "assistant", "tool", "assistant"]  # the message, three durable steps


def _kinds(log: list[tether.Entry]) -> list[str | None]:
    return [e.kind if e.kind != "marker" else e.action for e in log]


def _script(server: ModelServer, script: str, ledger: Path, hang: Path | None = None) -> None:
    """One finished step (``one``), one that hangs until killed (``hang``, noted in the
    ledger ``hang`` if given), the end."""
    server.script(
        script,
        [
            {"text": "First step.", "tool_calls": [_step("one", ledger)]},
            {"text": "Second step.", "tool_calls": [_step("hang", hang or ledger)]},
            {"text": "It may or may not have run; I will not run it again."},
            {"text": "Still the same conversation."},
        ],
    )


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize("idempotent", [False, True], ids=["unknown", "idempotent"])
def test_a_worker_killed_mid_tool_recovers_the_adapters_turn_without_running_a_finished_step_again(
    server: ModelServer, db_path: str, tmp_path: Path, adapter: str, idempotent: bool
) -> None:
    driver, factory = ADAPTERS[adapter]
    script = f"recover-{adapter}-{idempotent}"
    ledger = tmp_path / "ledger"
    _script(server, script, ledger)
    policy = {"ledger_step": {"idempotent": True}} if idempotent else {}
    config = _config(server, script, factory, tool_policy=policy)
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = family(rt, driver, root_driver=SCRIPTED, config=config)
        rt.send(child, "go", authority=me)
        turn = rt.wait(child, until="running").turn
        eventually(lambda: _ran(ledger, "hang"), timeout=30.0, what="the hanging step")
        [[_, key, pid]] = [line for line in _ledger(ledger) if line[0] == "hang"]
        Path(f"{ledger}.go").touch()  # a run again returns at once
        os.kill(int(pid), signal.SIGKILL)  # from outside: a crash
        ended = rec.turn_ended(child, timeout=30.0)
        assert (ended["outcome"], ended["turn"]) == ("completed", turn), ended
        [record] = rt.turns(child)
        assert (record.recoveries, record.outcome) == (1, "completed")
        log = rt.transcript(child)
        # the next turn reads the recovered one as it went
        rt.send(child, "and now?", authority=me)
        assert rec.turn_ended(child, count=2, timeout=30.0)["outcome"] == "completed"
    requests = server.requests_for(script)
    assert len(requests) == 4  # no request of a finished step was sent again
    assert _ran(ledger, "one") == [_ran(ledger, "one")[0]]  # the finished step ran once
    third = requests[2].body
    last = _tool_messages(third, adapter)[-1]
    if idempotent:  # run again, with the same call key
        assert _ran(ledger, "hang") == [key, key]
        assert last == "hang done"
        assert _kinds(log) == [*STEPS, "recovered", "tool", "assistant"]
    else:  # never run again: the model is told it is unknown
        assert _ran(ledger, "hang") == [key]
        assert last == WORKER_DIED
        unknown = log[5]
        assert (unknown.kind, unknown.text) == ("tool", WORKER_DIED)
        assert unknown.data is not None and unknown.data["unknown"] is True
        assert unknown.data["call"] == key
    assert log[4].text == (
        "↻ Recovered after the worker died (attempt 1): 3 steps kept,"
        " 1 tool call unknown (ledger_step)"
    )
    assert log[-1].text == "It may or may not have run; I will not run it again."
    # every tool entry names its call by its key, the one the tool was given
    tools = [e for e in log if e.kind == "tool"]
    assert [(e.data or {}).get("call") for e in tools] == [_ran(ledger, "one")[0], key]
    # the next turn's request holds the recovered turn as the model saw it
    fourth = requests[3].body
    assert _tool_messages(fourth, adapter)[-2:] == _tool_messages(third, adapter)[-2:]
    assert fourth["messages"][-1] == {"role": "user", "content": "and now?"}
    assert fourth["messages"][-2]["content"] == log[-1].text


def _tool_messages(body: dict[str, Any], adapter: str) -> list[str]:
    """The tool results a chat-completions request carries, in order."""
    return [str(m["content"]) for m in body["messages"] if m.get("role") == "tool"]


def _host_argv(db_path: str, config: dict[str, Any], mark: Path, driver: str) -> list[str]:
    """A host (tests/recovery_host.py) running one turn of ``driver``; its first line
    once the file ``mark`` exists."""
    host = str(TESTS / "recovery_host.py")
    return [sys.executable, host, db_path, json.dumps(config), str(mark), driver]


def test_a_pydantic_ai_turn_whose_host_was_sigkilled_mid_tool_recovers_at_the_next_start(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    script, ledger, hang = "recover-pydantic-host", tmp_path / "ledger", tmp_path / "hang"
    _script(server, script, ledger, hang)
    config = _config(server, script, ADAPTERS["pydantic_ai"][1])
    argv = _host_argv(db_path, config, hang, PYDANTIC)  # killed once the step hangs
    with sigkilled_host(argv, timeout=60.0) as (ready, _tree):
        pass  # the whole old host is gone before the next start
    [key] = _ran(hang, "hang")
    root, turn = ready["root"], ready["turn"]
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rt.wait(root, until="idle", timeout=30.0)
        [record] = rt.turns(root)
        log = rt.transcript(root)
    assert (record.id, record.outcome, record.recoveries) == (turn, "completed", 1)
    assert len(_ran(ledger, "one")) == 1 and _ran(hang, "hang") == [key]
    assert _kinds(log) == [*STEPS, "recovered", "tool", "assistant"]
    assert log[4].text.startswith("↻ Recovered after the host stopped (attempt 1): 3 steps kept")
    requests = server.requests_for(script)
    assert len(requests) == 3
    assert _tool_messages(requests[2].body, "pydantic_ai")[-1] == HOST_STOPPED


def _spawned(ledger: Path) -> list[list[str]]:
    return [line.split()[:2] for line in ledger.read_text().splitlines()]


def test_spawn_agent_re_issued_with_its_call_key_after_a_worker_crash_makes_no_second_child(
    db_path: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        root = rt.open_session(SPAWNS, config={"ledger": str(ledger)})
        rt.prompt(root, "go")
        # a whole line: the file exists a moment before its line is written
        eventually(
            lambda: ledger.exists() and ledger.read_text().endswith("\n"),
            timeout=30.0,
            what="the spawns",
        )
        [[first, second, pid]] = [line.split() for line in ledger.read_text().splitlines()]
        os.kill(int(pid), signal.SIGKILL)
        assert rec.turn_ended(root, timeout=30.0)["outcome"] == "completed"
        children = [a.id for a in rt.list_agents(root)]
    # the call's two spawns, re-issued in order, got the children made before the crash
    assert first != second and _spawned(ledger) == [[first, second], [first, second]]
    assert sorted(children) == sorted([first, second])


def test_spawn_agent_re_issued_after_a_host_sigkill_finds_its_child_in_the_store(
    db_path: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    argv = _host_argv(db_path, {"ledger": str(ledger)}, ledger, SPAWNS)
    with sigkilled_host(argv, timeout=60.0) as (ready, _tree):
        pass
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rt.wait(ready["root"], until="idle", timeout=30.0)
        assert rt.turns(ready["root"])[0].outcome == "completed"
        children = [a.id for a in rt.list_agents(ready["root"])]
    [made, again] = _spawned(ledger)
    assert made == again and sorted(children) == sorted(made)


SPAWNS = "recovery_drivers:SpawnsInACall"


CLAUDE = "tether.adapters.claude_code:ClaudeCodeAgent"
CLAUDE_MODEL = "claude-sonnet-4-5"  # the CLI refuses model names it does not know


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _bash(command: str) -> dict[str, Any]:
    return {"name": "Bash", "arguments": {"command": command, "description": "run it"}}


@pytest.mark.timeout(150)  # a CLI starts in a second or two, more on a loaded machine
def test_a_claude_code_turn_whose_worker_was_killed_mid_bash_resumes_its_session(
    server: ModelServer, db_path: str, tmp_path: Path
) -> None:
    pytest.importorskip("claude_agent_sdk")
    home, ledger = tmp_path / "home", tmp_path / "ledger"
    home.mkdir()
    hang = f"echo hang >> {ledger}; sleep 300"
    server.script(
        CLAUDE_MODEL,
        [
            {"text": "First step.", "tool_calls": [_bash(f"echo one >> {ledger}")]},
            {"text": "Second step.", "tool_calls": [_bash(hang)]},
            {"text": "It may or may not have run; I will not run it again."},
        ],
    )
    config = {
        "claude": {"model": CLAUDE_MODEL, "cwd": str(home), "env": {"HOME": str(home)}},
        "model": {"base_url": server.root, "api_key_env": KEY_ENV},
    }
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = family(rt, CLAUDE, root_driver=SCRIPTED, config=config)
        rt.send(child, "go", authority=me)
        turn = rt.wait(child, until="running").turn
        eventually(lambda: "hang" in _text(ledger), timeout=60.0, what="the hanging command")
        worker = worker_with_tool(rt, "sleep")
        worker.send_signal(signal.SIGKILL)
        ended = rec.turn_ended(child, timeout=60.0)
        assert (ended["outcome"], ended["turn"]) == ("completed", turn), ended
        [record] = rt.turns(child)
        log = rt.transcript(child)
    assert record.recoveries == 1
    assert ledger.read_text() == "one\nhang\n"  # no step ran again
    assert _kinds(log) == [*STEPS, "recovered", "tool", "assistant"], _kinds(log)
    unknown = log[5]
    assert (unknown.text, (unknown.data or {}).get("unknown")) == (WORKER_DIED, True)
    requests = server.requests_for(CLAUDE_MODEL)
    assert len(requests) == 3  # the finished steps' requests were not sent again
    sent = json.dumps(requests[2].body["messages"])
    # the CLI's own "interrupted" result for the call, and Tether's message naming it
    assert "Tool call interrupted" in sent, sent[-2000:]
    assert f"the command `{hang}` was running" in sent
    assert log[-1].text == "It may or may not have run; I will not run it again."
