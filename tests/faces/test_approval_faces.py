"""Approvals (semantics §17.2) through the faces of a real ``tether serve``: RPC
``subagent.approvals`` / ``subagent.decide``, the CLI's ``approvals`` / ``approve`` /
``deny``, the MCP face's ``list_approvals`` / ``decide_approval`` and A2A's
``input-required`` decided by a message, with ChatAgent
against the local model server. Each face: a pending call is listed, approving it runs
the tool, denying it tells the model who denied it and why, and a decision made already,
an unknown approval and the wrong authority are refused."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from a2a.client import Client as A2AClient
from a2a.client import ClientConfig, create_client
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import InvalidRequestError, TaskNotFoundError
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.struct_pb2 import Value
from mcp import ClientSession

from mcp_clients import call, http_session, ok
from tether.cli._terminal import shown
from tether.testing import ModelServer
from tether_server import (
    EventReader,
    LiveServer,
    await_until,
    rpc_error,
    shared_server,
    tether_cli,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)

CHAT = "tether.agents:ChatAgent"
MCP_SCRIPT = "mcp"  # the script of the roots MCP clients open (the server's --config)


def _config(model: ModelServer, script: str) -> dict[str, Any]:
    return {
        "model": {"base_url": model.url, "name": script, "retries": 0},
        "tools": ["run_command"],
        "tool_policy": {"run_command": {"approval": "required"}},
    }


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with ModelServer() as server:
        yield server


@pytest.fixture(scope="module")
def shared(model: ModelServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server for the module; the roots MCP clients open are ChatAgents."""
    workdir = tmp_path_factory.mktemp("approvals")
    config = workdir / "agent.json"
    config.write_text(json.dumps(_config(model, MCP_SCRIPT)))
    with shared_server(workdir, "--driver", CHAT, "--config", str(config)) as live:
        yield live


def _touch(path: Path) -> list[str]:
    """A command that leaves ``path`` behind: whether it ran shows on disk."""
    return [sys.executable, "-c", f"open({str(path)!r}, 'a').write('ran\\n')"]


def _two_calls(first: Path, second: Path) -> list[dict[str, Any]]:
    """A model that asks for two commands, one after the other, then ends."""
    return [
        {"tool_calls": [{"name": "run_command", "arguments": {"argv": _touch(first)}}]},
        {"tool_calls": [{"name": "run_command", "arguments": {"argv": _touch(second)}}]},
        {"text": "Done."},
    ]


def _tool_results(model: ModelServer, script: str) -> list[str]:
    """The tool results the model read in its last request."""
    body = model.requests_for(script)[-1].body
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def _pending(server: LiveServer, session: str, scope: str = "session") -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = wait_until(
        lambda: server.call("subagent.approvals", {"session": session, "scope": scope})[
            "approvals"
        ],
        timeout=20.0,
        what=f"a pending approval under {session}",
    )
    return found


def _next_pending(server: LiveServer, session: str, after: str) -> dict[str, Any]:
    """The pending approval of ``session`` that comes after the one ``after``."""

    def listed() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = server.call("subagent.approvals", {"session": session})[
            "approvals"
        ]
        return found

    found: dict[str, Any] = wait_until(
        lambda: next((a for a in listed() if a["id"] != after), None),
        timeout=20.0,
        what=f"the next approval of {session}",
    )
    return found


def _ended(server: LiveServer, session: str) -> str:
    outcome: str = wait_until(
        lambda: server.call("subagent.turns", {"session": session})["turns"][-1]["outcome"],
        timeout=20.0,
        what=f"the turn of {session} to end",
    )
    return outcome


def _markers(server: LiveServer, session: str) -> list[str]:
    entries = server.call("subagent.transcript", {"session": session})["entries"]
    return [e["text"] for e in entries if e["kind"] == "marker"]


def test_rpc_lists_a_nested_approval_from_the_root_and_decides_it_with_a_parents_authority(
    server: LiveServer, model: ModelServer, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    model.script("rpc", _two_calls(first, second))
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    with EventReader(server, session=root) as events:
        child = server.call(
            "subagent.spawn",
            {"parent": root, "driver": CHAT, "config": _config(model, "rpc"), "prompt": "go"},
        )["session"]
        [a] = _pending(server, root, "subtree")  # seen from the root
        assert (a["session"], a["tool"], a["state"]) == (child, "run_command", "pending")
        assert a["arguments"] == {"argv": _touch(first)}
        assert server.call("subagent.approvals", {"session": root})["approvals"] == []
        asked = events.wait_for(lambda e: e.get("event") == "approval", what="the approval")
        assert asked["data"]["data"]["approval"]["id"] == a["id"]
        assert asked["data"]["session"] == child and root in asked["data"]["lineage"]
        assert server.call("subagent.approval", {"approval": a["id"]})["approval"] == a
        assert not first.exists()

        # the wrong authority (the child's own id as its parent) changes nothing
        wrong = {"approval": a["id"], "parent": child}
        assert rpc_error(server.rpc("subagent.decide", wrong)) == (-32000, "subagent-unauthorized")
        unknown = {"approval": "a_nosuch", "parent": root}
        assert rpc_error(server.rpc("subagent.decide", unknown)) == (-32000, "not-found")
        bad = {"approval": a["id"], "parent": root, "decision": "maybe"}
        assert rpc_error(server.rpc("subagent.decide", bad)) == (-32602, "invalid-params")

        mine = {"approval": a["id"], "parent": root, "name": "alice"}
        approved = server.call("subagent.decide", mine)["approval"]
        assert (approved["state"], approved["decided_by"]) == ("approved", "alice")
        decided = events.wait_for(
            lambda e: (
                e.get("event") == "approval"
                and e["data"]["data"]["approval"]["state"] == "approved"
            ),
            what="the decision's event",
        )
        assert decided["data"]["data"]["approval"]["id"] == a["id"]
        again = {**mine, "decision": "deny", "reason": "too late"}
        code, data_code = rpc_error(answer := server.rpc("subagent.decide", again))
        assert (code, data_code) == (-32000, "already-decided")
        assert "approved already (by user alice)" in answer["error"]["message"]

    b = _next_pending(server, child, a["id"])  # the tool ran; the model asks again
    assert first.read_text() == "ran\n"
    deny = {"approval": b["id"], "parent": root, "decision": "deny", "reason": "not that one"}
    assert server.call("subagent.decide", deny)["approval"]["state"] == "denied"
    assert _ended(server, child) == "completed"  # the model was told, and went on
    assert not second.exists()
    assert _tool_results(model, "rpc")[-1] == "denied by user: not that one"
    markers = _markers(server, child)
    assert f"✓ Approved by user alice ({a['id']})" in markers
    assert f"✗ Denied by user ({b['id']}): not that one" in markers


def test_the_cli_lists_approves_and_denies_with_the_exit_codes_of_its_other_commands(
    server: LiveServer, model: ModelServer, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    replies = _two_calls(first, second)
    argv = [*_touch(first), "\u202e\x9b"]  # what a terminal would act on: shown escaped
    replies[0]["tool_calls"][0]["arguments"] = {"argv": argv}
    model.script("cli", replies)
    root = server.call("session.open", {"driver": CHAT, "config": _config(model, "cli")})["session"]
    server.call("session.prompt", {"session": root, "content": "go"})
    [a] = _pending(server, root)

    listed = tether_cli(server, "approvals", root, "--subtree")  # its own, and below
    assert listed.returncode == 0, listed.stderr
    call_shown = shown(json.dumps(argv, ensure_ascii=False))
    assert listed.stdout == f"{a['id']}  {root}  run_command {call_shown}\n"
    assert "\\u202e" in listed.stdout and "\u202e" not in listed.stdout

    wrong = tether_cli(server, "approve", a["id"], "--parent", "s_not_its_parent")
    assert wrong.returncode == 1 and "tether: subagent-unauthorized:" in wrong.stderr
    unknown = tether_cli(server, "approve", "a_nosuch")
    assert unknown.returncode == 1 and "tether: not-found:" in unknown.stderr
    usage = tether_cli(server, "deny", a["id"])  # a denial says why
    assert usage.returncode == 2 and "--reason" in usage.stderr

    edited = ["--arguments", json.dumps({"argv": _touch(tmp_path / "edited")})]
    done = tether_cli(server, "approve", a["id"], "--as", "alice", *edited)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"approved {a['id']} with edited arguments\n"
    again = tether_cli(server, "deny", a["id"], "--reason", "too late")
    assert again.returncode == 1
    assert f"tether: already-decided: approval {a['id']} was approved already" in again.stderr

    b = _next_pending(server, root, a["id"])
    assert (tmp_path / "edited").exists() and not first.exists()  # the edit ran, not the call
    denied = tether_cli(server, "deny", b["id"], "--reason", "no\x1b[2J", "--as", "bob")
    assert denied.returncode == 0 and denied.stdout == f"denied {b['id']}\n", denied.stderr
    assert _ended(server, root) == "completed"
    assert not second.exists()
    assert _tool_results(model, "cli")[-1] == "denied by user bob: no\x1b[2J"
    assert server.call("subagent.approvals", {"session": root})["approvals"] == []


def test_an_mcp_client_lists_and_decides_the_calls_of_its_own_agents_only(
    server: LiveServer, model: ModelServer, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    model.script(MCP_SCRIPT, _two_calls(first, second))

    async def body() -> None:
        async with http_session(server, owner="alice") as mcp, http_session(server) as other:
            tools = {t.name: t for t in (await mcp.list_tools()).tools}
            assert {"list_approvals", "decide_approval"} <= set(tools)
            props = tools["decide_approval"].input_schema["properties"]
            assert {"approval", "decision", "reason", "arguments"} <= set(props)
            root = (await ok(mcp, "spawn_agent", prompt="go"))["agent"]

            async def pending() -> list[dict[str, Any]]:
                found: list[dict[str, Any]] = (await ok(mcp, "list_approvals"))["approvals"]
                return found

            [a] = await _until(pending)
            assert (a["session"], a["tool"]) == (root, "run_command")
            mine = await ok(mcp, "list_approvals", agent=root)
            assert [x["id"] for x in mine["approvals"]] == [a["id"]]

            # another client sees none of it, and may not decide it
            assert (await ok(other, "list_approvals"))["approvals"] == []
            refused = await call(other, "decide_approval", approval=a["id"])
            assert refused["error"] == "subagent-unauthorized"
            assert root not in refused["message"] and "approved" not in refused["message"]
            unknown = await call(mcp, "decide_approval", approval="a_nosuch")
            assert unknown["error"] == "not-found"

            approved = await ok(mcp, "decide_approval", approval=a["id"])
            assert approved["approval"]["state"] == "approved"
            again = await call(mcp, "decide_approval", approval=a["id"], decision="deny")
            assert again["error"] == "already-decided"

            async def next_one() -> list[dict[str, Any]]:
                return [x for x in await pending() if x["id"] != a["id"]]

            [b] = await _until(next_one)
            assert first.read_text() == "ran\n"
            denied = await ok(
                mcp, "decide_approval", approval=b["id"], decision="deny", reason="enough"
            )
            assert denied["approval"]["state"] == "denied"
            await _until(lambda: _ended_mcp(mcp, root))

    anyio.run(body)
    assert not second.exists()
    assert _tool_results(model, MCP_SCRIPT)[-1] == "denied by user: enough"


async def _until(check: Any, timeout: float = 20.0) -> Any:
    return await await_until(check, "the condition", timeout)


async def _ended_mcp(mcp: ClientSession, root: str) -> bool:
    [info] = (await ok(mcp, "list_agents"))["agents"]
    assert info["id"] == root
    return bool(info["state"] == "idle")


def _a2a_message(text: str, *, task: str = "", context: str = "", **tether: Any) -> Message:
    parts = [Part(text=text)]
    if tether:
        parts.append(Part(data=ParseDict({"tether": tether}, Value())))
    return Message(
        message_id=f"m-{text}-{tether.get('approval', '')}",
        role=Role.ROLE_USER,
        parts=parts,
        context_id=context,
        task_id=task,
    )


async def _a2a_send(client: A2AClient, msg: Message) -> Task:
    [answer] = [r async for r in client.send_message(SendMessageRequest(message=msg))]
    return answer.task


def _asked(task: Task) -> list[dict[str, Any]]:
    """The pending calls an input-required task names in its status's data part."""
    assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED, task.status
    text, data = task.status.message.parts
    assert "waiting for approval: run_command" in text.text
    found: list[dict[str, Any]] = MessageToDict(data.data)["tether"]["approvals"]
    return found


def test_an_a2a_task_waiting_on_an_approval_is_input_required_and_a_message_decides_it(
    server: LiveServer, model: ModelServer, tmp_path: Path
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    model.script(MCP_SCRIPT, _two_calls(first, second))

    async def body() -> None:
        headers = {"Authorization": f"Bearer {server.token}"} if server.token else {}
        async with httpx.AsyncClient(headers=headers, timeout=30) as http:
            config = ClientConfig(httpx_client=http, streaming=False)
            client = await create_client(server.url, client_config=config)
            try:
                task = await _a2a_send(client, _a2a_message("go"))  # returns once it asks
                [a] = _asked(task)
                assert (a["tool"], a["arguments"]) == ("run_command", {"argv": _touch(first)})
                assert not first.exists()
                t, ctx = task.id, task.context_id
                get = await client.get_task(GetTaskRequest(id=t))
                assert get.status.state == TaskState.TASK_STATE_INPUT_REQUIRED

                unknown = _a2a_message("x", task=t, approval="a_nosuch", decision="approve")
                with pytest.raises(TaskNotFoundError):
                    await _a2a_send(client, unknown)
                approve = _a2a_message(
                    "ok", task=t, context=ctx, approval=a["id"], decision="approve"
                )
                task = await _a2a_send(client, approve)  # returns at the next call's approval
                [b] = _asked(task)
                assert b["id"] != a["id"] and first.read_text() == "ran\n"
                with pytest.raises(InvalidRequestError, match="approved already"):
                    await _a2a_send(
                        client, _a2a_message("no", task=t, approval=a["id"], decision="deny")
                    )
                deny = _a2a_message("enough", task=t, approval=b["id"], decision="deny")
                task = await _a2a_send(client, deny)  # the model is told, and ends the task
                assert task.status.state == TaskState.TASK_STATE_COMPLETED
            finally:
                await client.close()

    anyio.run(body)
    assert not second.exists()
    assert _tool_results(model, MCP_SCRIPT)[-1] == "denied by user: enough"
