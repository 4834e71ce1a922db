"""The MCP face, driven by the official ``mcp`` SDK's client: over stdio against
``tether mcp`` in a subprocess, and over Streamable HTTP against ``tether serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from drivers import HANG, TESTS
from mcp_clients import call, http_session, ok
from tether_server import TETHER, LiveServer, await_until, running_server

pytestmark = pytest.mark.timeout(90)

_ENV = {
    "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    "TETHER_LOG": "info",
    "TETHER_LOG_FORMAT": "json",
}


@asynccontextmanager
async def stdio_session(
    path: Path, *args: str, errlog: Path | None = None, env: dict[str, str] | None = None
) -> AsyncIterator[ClientSession]:
    """``tether mcp`` in a subprocess, with an initialized client session over stdio."""
    params = StdioServerParameters(
        command=TETHER,
        args=["mcp", "--path", str(path), "--workers", "2", "--grace", "1", *args],
        env={**_ENV, **(env or {})},
    )
    with (errlog or path.with_suffix(".err")).open("w") as err:
        async with (
            stdio_client(params, errlog=err) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


async def running_turn(session: ClientSession, root: str, agent: str) -> str:
    async def look() -> str | None:
        agents = (await ok(session, "list_agents", agent=root, scope="descendants"))["agents"]
        info = next(a for a in agents if a["id"] == agent)
        return info["turn"] if info["state"] == "running" else None

    return await await_until(look, f"{agent} to run")


async def entries(session: ClientSession, agent: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        page = await ok(session, "read_transcript", agent=agent, after=after, limit=50)
        out.extend(page["entries"])
        if not page["more"]:
            return out
        after = out[-1]["seq"]


def test_an_mcp_client_steers_and_cancels_a_hanging_child_with_a_turn_guard(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with stdio_session(tmp_path / "state.db") as mcp:
            tools = {t.name: t for t in (await mcp.list_tools()).tools}
            assert {
                "spawn_agent",
                "send_message",
                "interrupt_agent",
                "pause_agent",
                "resume_agent",
                "list_agents",
                "read_transcript",
                "stop_report",
            } <= set(tools)
            # The schemas extend those of tether.tools: same fields, plus the face's own.
            spawn = tools["spawn_agent"].input_schema["properties"]
            assert {"slug", "prompt", "mode", "data", "parent", "wait"} <= set(spawn)
            assert "turn" in tools["interrupt_agent"].input_schema["properties"]

            root = (await ok(mcp, "spawn_agent", prompt="lead", wait=True))["agent"]
            child = (
                await ok(mcp, "spawn_agent", parent=root, slug="worker", prompt="w", data=HANG)
            )["agent"]
            turn = await running_turn(mcp, root, child)

            steer = await ok(mcp, "interrupt_agent", agent=child, kind="steer", reason="go left")
            assert steer == {"accepted": True, "turn": turn}

            async def steered() -> bool:
                return any("go left</steer>" in e["text"] for e in await entries(mcp, child))

            await await_until(steered, "the steer to reach a boundary")

            paused = await ok(mcp, "pause_agent", agent=child, reason="let me look")
            assert paused == {"accepted": True, "turns": [turn]}
            listed = (await ok(mcp, "list_agents", agent=root))["agents"]
            assert [(a["id"], a["state"]) for a in listed] == [(child, "paused")]
            resumed = await ok(mcp, "resume_agent", agent=child)
            assert resumed == {"accepted": True, "turns": [turn]}

            other = "t_" + "0" * 32  # well formed, but no turn of this agent's
            stale = await ok(mcp, "interrupt_agent", agent=child, kind="cancel", turn=other)
            assert stale == {"accepted": True, "turn": None}
            typo = await call(mcp, "interrupt_agent", agent=child, kind="cancel", turn="t_stale")
            assert typo["error"] == "invalid-params", typo  # no turn ever has that id
            assert await running_turn(mcp, root, child) == turn  # the stale guard did nothing

            cancel = await ok(
                mcp, "interrupt_agent", agent=child, kind="cancel", reason="enough", turn=turn
            )
            assert cancel == {"accepted": True, "turn": turn}
            done = await ok(mcp, "wait_agent", agent=child, timeout=20)
            assert done["agent"]["state"] == "parked"  # a stopped session holds its queue

            seen = await entries(mcp, child)
            actions = [(e["action"], e["turn"]) for e in seen if e["kind"] == "marker"]
            assert actions == [
                ("steered", turn),
                ("paused", turn),
                ("resumed", turn),
                ("cancelled", turn),
            ]
            assert seen[-1]["text"].startswith("cancelled after")
            page = await ok(mcp, "read_transcript", agent=child, limit=1)
            assert len(page["entries"]) == 1 and page["more"] is True

            # The stop report of that turn (semantics §15.6).
            report = (await ok(mcp, "stop_report", turn=turn))["report"]
            assert (report["turn"], report["session"], report["kind"]) == (turn, child, "cancel")
            assert report["origin"] == "user" and report["reason"] == "enough"
            assert report["outcome"] == "cancelled" and report["partial"] == seen[-1]["text"]
            first = (await ok(mcp, "read_transcript", agent=root))["entries"][0]["turn"]
            assert await ok(mcp, "stop_report", turn=first) == {"report": None}

            # A child spawned with wait answers with its first turn's outcome and words.
            quick = await ok(mcp, "spawn_agent", parent=root, prompt="quick", wait=True)
            assert (quick["outcome"], quick["text"]) == ("completed", "ok: quick")

            # The same client sees its root and the children under it.
            listed = (await ok(mcp, "list_agents", scope="descendants"))["agents"]
            assert [a["id"] for a in listed] == [root, child, quick["agent"]]

    anyio.run(body)


def test_an_mcp_client_is_refused_agents_it_did_not_open(server: LiveServer) -> None:
    async def body() -> None:
        async with http_session(server) as alice, http_session(server) as bob:
            root = (await ok(alice, "spawn_agent", slug="alices"))["agent"]
            child = (await ok(alice, "spawn_agent", parent=root, prompt="w", data=HANG))["agent"]
            turn = await running_turn(alice, root, child)
            for tool, args in [
                ("interrupt_agent", {"agent": child, "kind": "abort"}),
                ("interrupt_agent", {"agent": root, "kind": "cancel"}),
                ("pause_agent", {"agent": child}),
                ("send_message", {"to": child, "text": "hi"}),
                ("read_transcript", {"agent": child}),
                ("spawn_agent", {"parent": root}),
                ("list_agents", {"agent": root}),
                ("read_budget", {"agent": child}),
                ("set_budget", {"agent": root, "budget": {"turns": 9}}),
                ("set_budget", {"agent": child, "remove": True}),
            ]:
                refused = await call(bob, tool, **args)
                assert refused["error"] == "subagent-unauthorized", (tool, refused)
            assert (await ok(bob, "list_agents"))["agents"] == []
            # Nothing bob tried touched the child.
            assert await running_turn(alice, root, child) == turn
            assert (await call(bob, "interrupt_agent", agent="s_nobody"))["error"] in (
                "not-found",
                "subagent-unauthorized",
            )
            bad = await call(alice, "interrupt_agent", agent=child, kind="explode")
            assert bad["error"] == "invalid-params"
            stopped = await ok(alice, "interrupt_agent", agent=child, kind="abort")
            assert stopped["turn"] == turn
            report = (await ok(alice, "stop_report", turn=turn))["report"]
            assert report["kind"] == "abort" and report["session"] == child
            refused = await call(bob, "stop_report", turn=turn)  # not bob's to read
            assert refused["error"] == "subagent-unauthorized"

    anyio.run(body)


def test_a_stop_report_of_another_clients_turn_is_refused_as_an_unknown_turn_naming_no_agent(
    server: LiveServer,
) -> None:
    async def body() -> None:
        async with http_session(server) as alice, http_session(server) as bob:
            root = (await ok(alice, "spawn_agent", slug="alices"))["agent"]
            child = (await ok(alice, "spawn_agent", parent=root, prompt="w", data=HANG))["agent"]
            turn = await running_turn(alice, root, child)
            await ok(alice, "interrupt_agent", agent=child, kind="abort")
            report = (await ok(alice, "stop_report", turn=turn))["report"]
            assert report["session"] == child and report["kind"] == "abort"
            # A turn of hers that no stop reached: no report, and no refusal.
            done = await ok(alice, "send_message", to=root, text="quick", wait=True)
            assert done["outcome"] == "completed"
            assert await ok(alice, "stop_report", turn=done["turn"]) == {"report": None}
            # Bob holds her turn's id: he learns what he would of a made-up one.
            foreign = await call(bob, "stop_report", turn=turn)
            unknown = await call(bob, "stop_report", turn="t_" + "0" * (len(turn) - 2))
            assert foreign == unknown and foreign["error"] == "subagent-unauthorized", foreign
            assert root not in json.dumps(foreign) and child not in json.dumps(foreign)

    anyio.run(body)


def test_a_root_given_with_root_is_held_by_every_client_of_tether_mcp(tmp_path: Path) -> None:
    path = tmp_path / "state.db"

    async def open_root() -> str:
        async with stdio_session(path) as mcp:
            return str((await ok(mcp, "spawn_agent", slug="kept"))["agent"])

    async def body(root: str) -> None:
        async with stdio_session(path) as stranger:
            refused = await call(stranger, "read_transcript", agent=root)
            assert refused["error"] == "subagent-unauthorized"
        async with stdio_session(path, "--root", root) as holder:
            sent = await ok(holder, "send_message", to=root, text="again", wait=True, timeout=20)
            assert sent["outcome"] == "completed" and sent["text"] == "ok: again"
            listed = (await ok(holder, "list_agents"))["agents"]
            assert [a["id"] for a in listed] == [root]

    root = anyio.run(open_root)
    anyio.run(body, root)


def test_cancelling_a_waiting_mcp_call_ends_the_wait_and_not_the_agent(tmp_path: Path) -> None:
    errlog = tmp_path / "mcp.err"

    async def body() -> None:
        async with stdio_session(tmp_path / "state.db", errlog=errlog) as mcp:
            root = (await ok(mcp, "spawn_agent"))["agent"]
            progressed = anyio.Event()
            notes: list[str | None] = []

            async def on_progress(
                progress: float, total: float | None, message: str | None
            ) -> None:
                notes.append(message)
                progressed.set()

            async def waiting_call() -> None:
                await mcp.call_tool(
                    "send_message",
                    {"to": root, "text": "w", "data": HANG, "wait": True, "timeout": 60},
                    progress_callback=on_progress,
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting_call)
                with anyio.fail_after(20):
                    await progressed.wait()  # progress notifications while it waits
                tg.cancel_scope.cancel()  # the client sends notifications/cancelled

            def logged() -> bool:
                return any(
                    json.loads(line).get("event") == "mcp.call_cancelled"
                    for line in errlog.read_text().splitlines()
                    if line.startswith("{")
                )

            async def ended() -> bool:
                return logged()

            await await_until(ended, "the server to end the waiting call")
            assert notes and all(isinstance(n, str) for n in notes)
            # The wait ended; the agent did not, and the server still answers.
            info = (await ok(mcp, "list_agents"))["agents"][0]
            assert info["id"] == root and info["state"] == "running"
            stopped = await ok(mcp, "interrupt_agent", agent=root, kind="abort")
            assert stopped["turn"] == info["turn"]

    anyio.run(body)


def test_mcp_over_http_needs_the_token_when_one_is_set(tmp_path: Path) -> None:
    async def body(server: LiveServer) -> None:
        async with http_session(server, "s3cret") as mcp:
            root = await ok(mcp, "spawn_agent", prompt="hi", wait=True, timeout=20)
            assert root["outcome"] == "completed" and root["text"] == "ok: hi"
        with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a 401 varies
            async with http_session(server, "wrong"):
                pass

    with running_server(tmp_path, "--token", "s3cret") as server:
        init = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-11-25",
                    "capabilities": {},
                    "clientInfo": {"name": "t", "version": "0"},
                },
            }
        ).encode()
        accept = {"Accept": "application/json, text/event-stream"}
        assert server.request("POST", "/mcp", init, accept, auth=False)[0] == 401
        anyio.run(body, server)


def test_mcp_and_a2a_refuse_a_page_of_another_origin_that_lacks_the_token(
    server: LiveServer, tmp_path: Path
) -> None:
    for path in ("/mcp", "/a2a"):
        for header in ({"Host": "evil.example:7777"}, {"Origin": "http://evil.example"}):
            answer = server.request("POST", path, b"{}", header, auth=False)
            assert answer[0] == 401, (path, header)
    assert server.request("GET", "/.well-known/agent-card.json", None, auth=False)[0] == 401
    assert server.request("GET", "/.well-known/agent-card.json", None)[0] == 200
    done = subprocess.run(
        [TETHER, "serve", "--host", "0.0.0.0", "--path", str(tmp_path / "x.db")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "--token" in done.stderr


def test_serve_without_the_agents_extra_says_so_on_mcp_and_a2a(tmp_path: Path) -> None:
    # Packages named mcp and a2a that cannot be imported stand for an install without
    # the extra tether-runtime[agents].
    shadow = tmp_path / "shadow"
    for name in ("mcp", "a2a"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    with running_server(tmp_path, env=env) as server:
        for path in ("/mcp", "/a2a", "/.well-known/agent-card.json"):
            method = "GET" if path.startswith("/.well-known") else "POST"
            status, body = server.request(method, path, b"{}")
            assert status == 501 and b"tether-runtime[agents]" in body, (path, status, body)
        assert server.call("session.open", {"driver": "tether:Scripted"})["session"]
    done = subprocess.run(
        [TETHER, "mcp", "--path", str(tmp_path / "y.db")],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1 and "tether-runtime[agents]" in done.stderr, done.stderr


def test_the_server_and_the_command_import_neither_sdk_until_a_face_is_built() -> None:
    code = (
        "import sys, tether.serve.server, tether.cli.main\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'a2a'))\n"
        "assert not loaded, loaded\n"
        "import tether.serve.faces as f, tether\n"
        "rt = tether.Runtime(workers=1)\n"
        "try:\n"
        "    paths = [r.path for face in f.build_faces(rt, f.FaceOptions()) for r in face.routes]\n"
        "finally:\n"
        "    rt.close()\n"
        "assert {'/mcp', '/a2a', '/.well-known/agent-card.json'} <= set(paths), paths\n"
        "assert 'mcp.server.lowlevel' in sys.modules and 'a2a.server.routes' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert done.returncode == 0, done.stderr


def test_tether_mcp_keeps_what_drivers_and_tools_print_off_the_protocol_stream(
    tmp_path: Path,
) -> None:
    errlog = tmp_path / "mcp.err"
    tests = str(TESTS)

    async def body() -> None:
        env = {"PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), tests])}
        chatty = ("--driver", "face_drivers:Chatty")
        async with stdio_session(tmp_path / "state.db", *chatty, errlog=errlog, env=env) as mcp:
            done = await ok(mcp, "spawn_agent", prompt="talk", wait=True, timeout=30)
            assert done["outcome"] == "completed"
            assert done["text"] == "said on the transcript"
            assert (await ok(mcp, "list_agents"))["agents"][0]["id"] == done["agent"]

    anyio.run(body)
    stderr = errlog.read_text()
    for noise in ("noise from print", "noise from fd 1", "noise from a child"):
        assert noise in stderr, noise  # on stderr, so not on the protocol stream


def test_a_tool_that_fails_unexpectedly_answers_an_error_id_and_not_the_exceptions_text(
    tmp_path: Path,
) -> None:
    errlog = tmp_path / "mcp.err"

    async def body() -> str:
        async with stdio_session(tmp_path / "state.db", errlog=errlog) as mcp:
            root = (await ok(mcp, "spawn_agent", slug="reader"))["agent"]
            # An offset past the store's 64-bit integers fails inside the store: nothing
            # checks it before (over stdio, no HTTP edge refuses the number).
            failed = await call(mcp, "read_transcript", agent=root, after=2**63)
            assert failed["error"] == "internal", failed
            assert "SQLite" not in failed["message"] and "too large" not in failed["message"]
            error_id: str = failed["message"].removeprefix("internal error (id ")[:-1]
            assert error_id.startswith("err_"), failed
            assert (await ok(mcp, "read_transcript", agent=root))["entries"] == []
            return error_id

    error_id = anyio.run(body)
    logged = [json.loads(line) for line in errlog.read_text().splitlines() if error_id in line]
    assert [(r["event"], r["tool"]) for r in logged] == [("mcp.internal_error", "read_transcript")]


def test_a_driver_config_that_cannot_be_read_stops_both_commands_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "agent.json"
    bad.write_text("[1, 2]")
    for command in (["mcp"], ["serve", "--port", "0"]):
        done = subprocess.run(
            [TETHER, *command, "--path", str(tmp_path / "z.db"), "--config", str(bad)],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 1, (command, done.stderr)
        assert "agent.json" in done.stderr and "JSON object" in done.stderr, done.stderr


def test_tether_mcp_drains_and_exits_on_sigterm_leaving_no_process(tmp_path: Path) -> None:
    errlog = tmp_path / "mcp.err"
    with errlog.open("w") as err:
        proc = subprocess.Popen(
            [TETHER, "mcp", "--path", str(tmp_path / "state.db"), "--workers", "2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, **_ENV},
        )
    try:
        deadline = time.monotonic() + 30
        while "mcp.stdio_serving" not in errlog.read_text():
            assert proc.poll() is None, errlog.read_text()
            assert time.monotonic() < deadline, "tether mcp never started serving"
            time.sleep(0.05)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert tree, "the runtime's workers should be running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, errlog.read_text()
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
        assert proc.stdout is not None and proc.stdout.read() == b""  # nothing but protocol
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def test_an_mcp_subtree_cancel_stops_every_running_turn_below_the_agent(tmp_path: Path) -> None:
    async def body() -> None:
        async with stdio_session(tmp_path / "state.db") as mcp:
            root = (await ok(mcp, "spawn_agent"))["agent"]
            a = (await ok(mcp, "spawn_agent", parent=root, prompt="w", data=HANG))["agent"]
            b = (await ok(mcp, "spawn_agent", parent=a, prompt="w", data=HANG))["agent"]
            turns = {await running_turn(mcp, root, a), await running_turn(mcp, root, b)}
            stopped = await ok(mcp, "interrupt_agent", agent=a, kind="cancel", scope="subtree")
            assert stopped["accepted"] is True and set(stopped["turns"]) == turns
            for agent in (a, b):
                assert (await ok(mcp, "wait_agent", agent=agent))["agent"]["state"] == "parked"
            assert (await ok(mcp, "list_agents"))["agents"][0]["state"] == "idle"  # the root

    anyio.run(body)


def test_an_http_mcp_client_naming_its_owner_acts_on_its_agents_after_reconnecting(
    server: LiveServer,
) -> None:
    async def body() -> None:
        async with http_session(server, owner="alice@laptop") as first:
            root = (await ok(first, "spawn_agent", slug="kept"))["agent"]
            child = (await ok(first, "spawn_agent", parent=root, prompt="w", data=HANG))["agent"]
            turn = await running_turn(first, root, child)
        # A new connection (a new MCP session) naming the same owner holds the same roots.
        async with http_session(server, owner="alice@laptop") as again:
            assert [a["id"] for a in (await ok(again, "list_agents"))["agents"]] == [root]
            steer = await ok(again, "interrupt_agent", agent=child, kind="steer", reason="left")
            assert steer == {"accepted": True, "turn": turn}
            # Another owner, or none, is a stranger to them.
            async with http_session(server, owner="bob") as bob, http_session(server) as anon:
                for stranger in (bob, anon):
                    refused = await call(stranger, "interrupt_agent", agent=child, kind="abort")
                    assert refused["error"] == "subagent-unauthorized"
                    assert (await ok(stranger, "list_agents"))["agents"] == []
            stopped = await ok(again, "interrupt_agent", agent=child, kind="abort", turn=turn)
            assert stopped == {"accepted": True, "turn": turn}

    anyio.run(body)


def test_tether_mcp_on_a_store_a_server_holds_says_so_in_one_line(tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        done = subprocess.run(
            [TETHER, "mcp", "--path", str(tmp_path / "state.db")],
            capture_output=True,
            text=True,
            timeout=60,
            input="",  # a pipe closed at once: only the store stops it
        )
        assert server.proc is not None and server.proc.poll() is None
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("tether mcp: the store ") and "in use" in done.stderr
    assert done.stdout == ""


def test_tether_mcp_with_stdin_at_end_of_file_from_the_start_exits_cleanly(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [TETHER, "mcp", "--path", str(tmp_path / "state.db"), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert done.stdout == ""


def test_a_waited_message_queued_behind_a_running_turn_says_so_in_its_progress(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with stdio_session(tmp_path / "state.db") as mcp:
            root = (await ok(mcp, "spawn_agent"))["agent"]
            await ok(mcp, "send_message", to=root, text="first", data=HANG)
            turn = await await_until(
                lambda: _running(mcp), "the first turn to run"
            )  # two workers: the second message has one free, and still waits its turn
            notes: list[str | None] = []

            async def on_progress(
                progress: float, total: float | None, message: str | None
            ) -> None:
                notes.append(message)

            result = await mcp.call_tool(
                "send_message",
                {"to": root, "text": "second", "wait": True, "timeout": 2.5},
                progress_callback=on_progress,
            )
            assert result.structured_content is not None
            assert result.structured_content["timed_out"] is True
            assert notes and set(notes) == {f"queued behind the running turn {turn}"}, notes
            await ok(mcp, "interrupt_agent", agent=root, kind="abort", turn=turn)

    async def _running(mcp: ClientSession) -> str | None:
        info = (await ok(mcp, "list_agents"))["agents"][0]
        return info["turn"] if info["state"] == "running" else None

    anyio.run(body)


def test_an_mcp_client_opens_reads_raises_and_removes_a_budget(server: LiveServer) -> None:
    async def body() -> None:
        async with http_session(server) as mcp:
            tools = {t.name: t for t in (await mcp.list_tools()).tools}
            assert {"read_budget", "set_budget"} <= set(tools)
            assert "budget" in tools["spawn_agent"].input_schema["properties"]
            once = {"turns": 1, "on_soft": "none"}
            opened = await ok(mcp, "spawn_agent", prompt="one", budget=once, wait=True)
            root = opened["agent"]
            assert opened["outcome"] == "completed"
            status = (await ok(mcp, "read_budget", agent=root))["budget"]
            assert (status["state"], status["decided_by"]) == ("exhausted", root)
            assert status["limits"] == {"turns": 1} and status["spent"]["turns"] == 1
            refused = await call(mcp, "spawn_agent", parent=root, prompt="x")
            assert refused["error"] == "budget-exhausted", refused
            # An exhausted tree takes the message and parks it: no turn starts.
            await ok(mcp, "send_message", to=root, text="two")
            (info,) = (await ok(mcp, "list_agents"))["agents"]
            assert (info["state"], info["pending"]) == ("parked", 1)

            for wrong in ({}, {"budget": {"turns": 3}, "remove": True}, {"budget": {"turns": 0}}):
                bad = await call(mcp, "set_budget", agent=root, **wrong)
                assert bad["error"] == "invalid-params", (wrong, bad)
            assert await ok(mcp, "set_budget", agent=root, budget={"turns": 3}) == {
                "accepted": True
            }
            status = (await ok(mcp, "read_budget", agent=root))["budget"]
            assert status["state"] == "ok" and status["remaining"] == {"turns": 2}
            too_big = await call(mcp, "spawn_agent", parent=root, budget={"turns": 5})
            assert too_big["error"] == "invalid-params" and "fit" in too_big["message"]
            child = (await ok(mcp, "spawn_agent", parent=root, budget={"turns": 1}))["agent"]
            assert (await ok(mcp, "read_budget", agent=child))["budget"]["limits"] == {"turns": 1}

            # The waking send: the parked message runs first, then this one.
            sent = await ok(mcp, "send_message", to=root, text="three", wait=True, timeout=20)
            assert sent["outcome"] == "completed" and sent["text"] == "ok: three"
            users = [e["text"] for e in await entries(mcp, root) if e["kind"] == "user"]
            assert users == ["one", "two", "three"]
            status = (await ok(mcp, "read_budget", agent=root))["budget"]
            assert status["spent"]["turns"] == 3 and status["state"] == "exhausted"

            assert await ok(mcp, "set_budget", agent=root, remove=True) == {"accepted": True}
            status = (await ok(mcp, "read_budget", agent=root))["budget"]
            assert (status["state"], status["budget"], status["limits"]) == ("ok", None, {})

    anyio.run(body)
