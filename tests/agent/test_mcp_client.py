"""The MCP client of the agent kit (semantics §15.3) against a real MCP server built with the
official SDK (tether.testing.mcp_server), over stdio and Streamable HTTP.

The server logs every request and notification it receives (and each handler's end) to
a JSON-lines file; the tests read it to prove what reached the server, and psutil to
prove which processes are gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest

from drivers import ROOT
from tether import InvalidParams
from tether.agents import McpResult, McpTimeout, McpTools
from tether.contain import procs
from tether.contain.procs import TREE_ENV
from tether.testing.mcp_server import LOG_ENV, read_log

SRC = str(ROOT / "src")
WAIT = 30.0  # deadline for anything a test waits on (a loaded machine starts Python slowly)

Record = dict[str, Any]


def _env(log: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)
    return {LOG_ENV: str(log), "PYTHONPATH": path}


def stdio_server(log: Path) -> dict[str, Any]:
    return {"command": [sys.executable, "-m", "tether.testing.mcp_server"], "env": _env(log)}


def read_line(stream: IO[str], timeout: float = WAIT) -> str:
    """The next line a child prints, waiting at most ``timeout`` for it to start."""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        assert sel.select(timeout), "the child printed nothing in time"
    return stream.readline()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


async def logged(log: Path, pred: Callable[[Record], bool], timeout: float = WAIT) -> Record:
    """The first record of ``log`` that ``pred`` accepts, waiting for it (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        for record in read_log(str(log)):
            if pred(record):
                return record
        if time.monotonic() > deadline:
            raise AssertionError(f"no such record in {read_log(str(log))}")
        await asyncio.sleep(0.01)


def call_of(tool: str) -> Callable[[Record], bool]:
    return lambda r: r["event"] == "request" and r.get("tool") == tool


def cancel_of(request_id: object) -> Callable[[Record], bool]:
    return lambda r: r.get("method") == "notifications/cancelled" and r["requestId"] == request_id


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def started(tools: McpTools, name: str, args: dict[str, Any], log: Path) -> Any:
    """Start a call in a task and return (task, the server's record of its request)."""
    task = asyncio.create_task(tools.call(name, args))
    tool = name.rsplit("__", 1)[1]
    record = await logged(log, call_of(tool))
    return task, record


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "mcp.jsonl"


def _http_server(log: Path, *flags: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.testing.mcp_server", "--http", "0", *flags],
        env={**os.environ, **_env(log)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = read_line(proc.stdout).strip()  # the server prints its URL once listening
        assert line.startswith("http://127.0.0.1:"), line
        yield line
    finally:
        proc.kill()
        proc.wait(timeout=WAIT)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def http_url(log: Path) -> Iterator[str]:
    yield from _http_server(log)


@pytest.fixture
def hung_http_url(log: Path) -> Iterator[str]:
    """An HTTP server that reads the handshake and never answers it."""
    yield from _http_server(log, "--hang-handshake")


def test_mcp_tools_are_offered_as_mcp_server_tool_with_their_schemas_and_a_call_returns(
    log: Path,
) -> None:
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)})
        try:
            specs = await tools.list_tools()
            by_name = {s["function"]["name"]: s for s in specs}
            assert set(by_name) == {
                "mcp__t__echo",
                "mcp__t__hang",
                "mcp__t__stubborn",
                "mcp__t__progress",
                "mcp__t__spawn_child",
            }
            echo = by_name["mcp__t__echo"]
            assert echo["type"] == "function"
            assert echo["function"]["description"] == "Return the text unchanged."
            params = echo["function"]["parameters"]
            assert params["type"] == "object" and params["required"] == ["text"]
            assert params["properties"]["text"]["type"] == "string"
            result = await tools.call("mcp__t__echo", {"text": "hello"})
            assert result.text == "hello" and not result.is_error
            record = await logged(log, call_of("echo"))
            assert result.request_id == str(record["id"])
            # the server is kept across calls
            pid = tools.server_pids()["t"]
            assert (await tools.call("mcp__t__echo", {"text": "again"})).text == "again"
            assert tools.server_pids() == {"t": pid}
        finally:
            await tools.aclose()

    run(main())


def test_a_tool_error_and_a_bad_call_come_back_as_error_results(log: Path) -> None:
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)})
        try:
            bad = await tools.call("mcp__t__hang", {"seconds": "soon"})
            assert bad.is_error and "seconds" in bad.text
            missing = await tools.call("mcp__t__nope", {})
            assert missing.is_error and "\n" not in missing.text
            with pytest.raises(InvalidParams, match="no MCP server named 'x'"):
                await tools.call("mcp__x__echo", {})
        finally:
            await tools.aclose()

    run(main())


def test_cancelling_a_hung_stdio_call_sends_notifications_cancelled_for_that_request(
    log: Path,
) -> None:
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)}, grace=10.0)
        try:
            task, request = await started(tools, "mcp__t__hang", {"seconds": 60}, log)
            pid = tools.server_pids()["t"]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert tools.last_fate == "cancelled"
            # the server received the cancel for exactly that request, and its handler ended
            await logged(log, cancel_of(request["id"]))
            await logged(log, lambda r: r["event"] == "handler_cancelled")
            # a cooperative end keeps the server
            assert tools.server_pids() == {"t": pid}
            assert (await tools.call("mcp__t__echo", {"text": "on"})).text == "on"
        finally:
            await tools.aclose()

    run(main())


def test_parallel_calls_each_report_their_own_fate_and_a_returned_one_reports_none(
    tmp_path: Path,
) -> None:
    logs = {name: tmp_path / f"{name}.jsonl" for name in ("a", "b")}

    async def main() -> None:
        servers = {name: stdio_server(path) for name, path in logs.items()}
        tools = McpTools(servers, grace=0.5)
        fates: dict[str, list[str]] = {"hang": [], "stubborn": [], "echo": []}

        def fate_of(name: str) -> Callable[[str, str], None]:
            return lambda fate, _partial: fates[name].append(fate)

        try:
            hang = asyncio.create_task(
                tools.call("mcp__a__hang", {"seconds": 60}, on_stop=fate_of("hang"))
            )
            stubborn = asyncio.create_task(
                tools.call("mcp__b__stubborn", {"seconds": 60}, on_stop=fate_of("stubborn"))
            )
            await logged(logs["a"], call_of("hang"))
            await logged(logs["b"], call_of("stubborn"))
            echo = asyncio.create_task(
                tools.call("mcp__a__echo", {"text": "mine"}, on_stop=fate_of("echo"))
            )
            hang.cancel()
            stubborn.cancel()
            done = await asyncio.gather(hang, stubborn, echo, return_exceptions=True)
            assert isinstance(done[0], asyncio.CancelledError)
            assert isinstance(done[1], asyncio.CancelledError)
            assert isinstance(done[2], McpResult) and done[2].text == "mine"
            assert fates == {"hang": ["cancelled"], "stubborn": ["abandoned"], "echo": []}
        finally:
            await tools.aclose()

    run(main())


def test_a_stubborn_call_is_abandoned_after_grace_its_tree_killed_and_a_new_server_serves_next(
    log: Path,
) -> None:
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)}, grace=0.5)
        try:
            child = int((await tools.call("mcp__t__spawn_child", {})).text)
            pid = tools.server_pids()["t"]
            assert psutil.Process(child).ppid() == pid
            task, _ = await started(tools, "mcp__t__stubborn", {"seconds": 60}, log)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert tools.last_fate == "abandoned"
            assert gone(pid) and gone(child)  # the whole tree, at once
            assert tools.server_pids() == {}
            result = await tools.call("mcp__t__echo", {"text": "fresh"})
            assert result == McpResult("fresh", request_id=result.request_id)
            assert tools.server_pids()["t"] != pid
        finally:
            await tools.aclose()

    run(main())


def test_a_result_that_arrives_after_the_cancel_is_never_returned(log: Path) -> None:
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)}, grace=20.0)
        try:
            task, request = await started(tools, "mcp__t__stubborn", {"seconds": 0.5}, log)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the server finished the call and answered it after our cancel...
            rid = request["id"]
            late = await logged(log, lambda r: r["event"] == "returned" and r["id"] == rid)
            cancel = await logged(log, cancel_of(request["id"]))
            assert cancel["t"] >= late["t"]  # it read the cancel only once unblocked
            # ...and its end within grace makes the stop a cooperative one
            assert tools.last_fate == "cancelled"
            # the late result is nowhere: the next call gets its own
            assert (await tools.call("mcp__t__echo", {"text": "next"})).text == "next"
        finally:
            await tools.aclose()

    run(main())


def test_idle_timeout_fires_without_progress_and_every_progress_notice_resets_it(
    log: Path,
) -> None:
    async def main() -> None:
        policies = {"mcp:t/*": {"idle_timeout": 0.8}}
        tools = McpTools({"t": stdio_server(log)}, policies=policies, grace=10.0)
        try:
            await tools.call("mcp__t__echo", {"text": "warm"})  # the server is up
            with pytest.raises(McpTimeout) as caught:
                await tools.call("mcp__t__hang", {"seconds": 60})
            assert caught.value.kind == "idle_timeout"
            assert tools.last_fate == "cancelled"
            hang = await logged(log, call_of("hang"))
            await logged(log, cancel_of(hang["id"]))
            # progress every 0.3 s keeps a 2.4 s call alive under a 0.8 s idle timeout
            seen: list[float] = []
            result = await tools.call(
                "mcp__t__progress",
                {"steps": 8, "every": 0.3},
                on_progress=lambda: seen.append(time.monotonic()),
            )
            assert result.text == "8 steps" and not result.is_error
            assert len(seen) == 8
        finally:
            await tools.aclose()

    run(main())


def test_max_duration_fires_even_while_progress_keeps_coming(log: Path) -> None:
    async def main() -> None:
        policies = {"mcp:t/progress": {"max_duration": 1.0, "idle_timeout": 30}}
        tools = McpTools({"t": stdio_server(log)}, policies=policies, grace=10.0)
        try:
            await tools.call("mcp__t__echo", {"text": "warm"})
            with pytest.raises(McpTimeout) as caught:
                await tools.call("mcp__t__progress", {"steps": 100, "every": 0.1})
            assert caught.value.kind == "max_duration"
            assert caught.value.partial.startswith("progress ")  # what arrived before the stop
            assert tools.last_fate == "cancelled"
            progress = await logged(log, call_of("progress"))
            await logged(log, cancel_of(progress["id"]))
        finally:
            await tools.aclose()

    run(main())


def test_the_kill_policy_kills_the_server_at_once_without_waiting_grace(log: Path) -> None:
    async def main() -> None:
        policies = {"mcp:t/hang": {"preempt": "kill", "grace": 60}}
        tools = McpTools({"t": stdio_server(log)}, policies=policies)
        try:
            task, request = await started(tools, "mcp__t__hang", {"seconds": 60}, log)
            pid = tools.server_pids()["t"]
            began = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - began < 30  # not the 60 s grace
            assert tools.last_fate == "killed" and gone(pid)
            assert not [r for r in read_log(str(log)) if cancel_of(request["id"])(r)]
            assert (await tools.call("mcp__t__echo", {"text": "back"})).text == "back"
        finally:
            await tools.aclose()

    run(main())


def test_a_server_that_dies_mid_call_is_a_one_line_error_and_restarts_at_next_use(
    log: Path,
) -> None:
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)})
        try:
            task, _ = await started(tools, "mcp__t__hang", {"seconds": 60}, log)
            pid = tools.server_pids()["t"]
            os.kill(pid, signal.SIGKILL)
            result = await asyncio.wait_for(task, WAIT)
            assert result.is_error and "ended during the call" in result.text
            assert "\n" not in result.text
            assert (await tools.call("mcp__t__echo", {"text": "alive"})).text == "alive"
            assert tools.server_pids()["t"] != pid
        finally:
            await tools.aclose()

    run(main())


def test_aclose_kills_every_stdio_server_tree_and_leaves_no_process(log: Path) -> None:
    async def main() -> None:
        tools = McpTools({"a": stdio_server(log), "b": stdio_server(log)})
        child = int((await tools.call("mcp__a__spawn_child", {})).text)
        await tools.call("mcp__b__echo", {"text": "x"})
        pids = tools.server_pids()
        assert set(pids) == {"a", "b"}
        await tools.aclose()
        assert tools.server_pids() == {}
        assert all(gone(p) for p in [*pids.values(), child])

    run(main())


def test_over_http_a_cancel_closes_the_requests_stream_and_the_server_sees_it(
    log: Path, http_url: str
) -> None:
    async def main() -> None:
        tools = McpTools({"web": {"url": http_url, "headers": {"X-Test": "1"}}}, grace=10.0)
        try:
            names = [s["function"]["name"] for s in await tools.list_tools()]
            assert "mcp__web__hang" in names
            assert (await tools.call("mcp__web__echo", {"text": "hi"})).text == "hi"
            assert tools.server_pids() == {}  # not ours to start or kill
            task, request = await started(tools, "mcp__web__hang", {"seconds": 60}, log)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert tools.last_fate == "cancelled"
            # what the server saw: the request's HTTP stream closed, and so its handler
            # was cancelled (the SDK server turns the disconnect into a cancel)
            rid = request["id"]
            await logged(log, lambda r: r["event"] == "http_disconnect" and r["id"] == rid)
            await logged(log, lambda r: r["event"] == "handler_cancelled" and r["id"] == rid)
            assert (await tools.call("mcp__web__echo", {"text": "still"})).text == "still"
        finally:
            await tools.aclose()

    run(main())


def test_over_http_a_stubborn_call_is_abandoned_after_grace_and_its_late_result_dropped(
    log: Path, http_url: str
) -> None:
    async def main() -> None:
        tools = McpTools({"web": {"url": http_url}}, grace=0.5)
        try:
            task, request = await started(tools, "mcp__web__stubborn", {"seconds": 3}, log)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert tools.last_fate == "abandoned"  # no process of ours to kill
            rid = request["id"]
            # the server answers it later, on a stream we closed; the next call gets its own
            await logged(log, lambda r: r["event"] == "returned" and r["id"] == rid)
            assert (await tools.call("mcp__web__echo", {"text": "own"})).text == "own"
        finally:
            await tools.aclose()

    run(main())


@pytest.mark.parametrize(
    ("servers", "policies", "message"),
    [
        ({"a": {}}, None, "'a': give exactly one of 'command' or 'url'"),
        ({"a": {"command": [], "url": "http://x"}}, None, "'a': give exactly one"),
        ({"a": {"command": "python srv.py"}}, None, "'a': 'command' must be a non-empty list"),
        ({"a": {"command": ["x"], "env": {"K": 1}}}, None, "'a': 'env' must map strings"),
        ({"a": {"command": ["x"], "cwd": 3}}, None, "'a': 'cwd' must be a string"),
        ({"a": {"command": ["x"], "port": 3}}, None, "'a': unknown field 'port'"),
        ({"a": {"url": "ftp://x"}}, None, "'a': 'url' must be an http"),
        ({"a": {"url": "http://x", "headers": ["h"]}}, None, "'a': 'headers' must map"),
        ({"a__b": {"command": ["x"]}}, None, "mcp server name 'a__b'"),
        ({"a": {"command": ["x"], "connect_timeout": 0}}, None, "'connect_timeout'"),
        ({}, {"files/*": {}}, "tool policy 'files/\\*'"),
        ({}, {"mcp:a/b": {"preempt": "sometimes"}}, "tool policy 'mcp:a/b'.*preempt"),
        ({}, {"mcp:a/b": {"max_duration": -1}}, "'max_duration' must be positive"),
        ({}, {"run_command": {"timeout": 3}}, "tool policy 'run_command'.*timeout"),
    ],
)
def test_a_bad_config_is_invalid_params_naming_the_server_and_field(
    servers: dict[str, Any], policies: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(InvalidParams, match=message):
        McpTools(servers, policies=policies)


def test_a_tools_policy_is_its_most_specific_matches() -> None:
    tools = McpTools(
        {"search": {"url": "http://127.0.0.1:1/mcp"}, "files": {"command": ["srv"]}},
        policies={
            "run_command": {"max_duration": 600},
            "mcp:*/*": {"grace": 2},
            "mcp:search/*": {"idle_timeout": 30, "max_duration": 300},
            "mcp:search/deep*": {"max_duration": 900},
            "mcp:files/migrate": {"preempt": "never"},
        },
        grace=7,
    )
    assert tools.policy("run_command").max_duration == 600
    assert tools.policy("run_command").grace == 7  # the constructor's default
    web = tools.policy("mcp__search__web")
    assert (web.idle_timeout, web.max_duration, web.grace) == (30, 300, 2)
    deep = tools.policy("mcp__search__deep_dive")
    assert (deep.idle_timeout, deep.max_duration) == (30, 900)
    migrate = tools.policy("mcp__files__migrate")
    assert migrate.preempt == "never" and migrate.grace == 2
    assert tools.policy("mcp__files__read").preempt == "cooperative"
    assert tools.policy("spawn_agent").max_duration is None


def test_a_stdio_server_runs_in_the_callers_process_group_with_the_tree_tag_only(
    log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's group stop (pause) and tag sweep reach the server; the worker's other
    # variables (an API key) do not.
    monkeypatch.setenv(TREE_ENV, "tree-under-test")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")

    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)})
        try:
            await tools.call("mcp__t__echo", {"text": "x"})
            server = psutil.Process(tools.server_pids()["t"])
            assert os.getpgid(server.pid) == os.getpgrp()
            assert server.ppid() == os.getpid()
            env = server.environ()
            assert env[TREE_ENV] == "tree-under-test" and "OPENAI_API_KEY" not in env
        finally:
            await tools.aclose()

    run(main())


def test_a_cancel_repeated_during_the_stop_still_ends_with_the_server_killed(log: Path) -> None:
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)}, grace=1.0)
        try:
            task, _ = await started(tools, "mcp__t__stubborn", {"seconds": 60}, log)
            pid = tools.server_pids()["t"]
            task.cancel()
            for _ in range(5):  # more cancels while it waits out the grace
                await asyncio.sleep(0.05)
                task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert tools.last_fate == "abandoned" and gone(pid)
        finally:
            await tools.aclose()

    run(main())


def test_a_never_tool_cancelled_anyway_is_stopped_cooperatively(log: Path) -> None:
    # `never` is the caller's to honour (it shields the call); if a cancel reaches the
    # call regardless, the call still stops the ordinary way.
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)}, policies={"mcp:t/hang": {"preempt": "never"}})
        try:
            assert tools.policy("mcp__t__hang").preempt == "never"
            task, request = await started(tools, "mcp__t__hang", {"seconds": 60}, log)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert tools.last_fate == "cancelled"
            await logged(log, cancel_of(request["id"]))
        finally:
            await tools.aclose()

    run(main())


@pytest.mark.parametrize(
    ("server", "says"),
    [
        ({"command": ["/nonexistent/mcp-server"]}, "No such file or directory"),
        ({"command": [sys.executable, "-c", "pass"]}, "Connection closed (it exited with code 0)"),
        ({"command": ["sleep", "600"], "connect_timeout": 1}, "timed out"),
        ({"url": "http://127.0.0.1:9/mcp", "connect_timeout": 5}, "could not start"),
    ],
)
def test_a_server_that_cannot_start_is_a_one_line_error_and_leaves_no_process(
    server: dict[str, Any], says: str
) -> None:
    async def main() -> None:
        tools = McpTools({"s": server})
        try:
            result = await tools.call("mcp__s__echo", {"text": "x"})
            assert result.is_error and "\n" not in result.text
            assert result.text.startswith("mcp server 's' could not start: ")
            assert says in result.text
            assert tools.server_pids() == {}  # nothing half-started is kept (or left)
        finally:
            await tools.aclose()

    run(main())


PAUSED_CALLER = """
import asyncio, json, sys
import structlog
from tether.agents import McpTools, McpTimeout

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

async def main() -> None:
    server = json.loads(sys.argv[1])
    policies = {"mcp:t/progress": {"idle_timeout": 1.5, "max_duration": 6.0}}
    tools = McpTools({"t": server}, policies=policies)
    try:
        await tools.call("mcp__t__echo", {"text": "up"})
        print("ready", flush=True)
        result = await tools.call("mcp__t__progress", {"steps": 10, "every": 0.3})
        print(json.dumps({"text": result.text}), flush=True)
    except McpTimeout as exc:
        print(json.dumps({"timeout": exc.kind}), flush=True)
    finally:
        await tools.aclose()

asyncio.run(main())
"""


@pytest.mark.timeout(120)
def test_a_pause_of_the_caller_and_its_server_is_not_charged_to_the_calls_limits(
    log: Path,
) -> None:
    # The worker and its stdio server frozen together for longer than the call's idle
    # timeout (and, with the call's own running time, its max_duration) go on after the
    # resume as if nothing happened: a pause must not turn into a timeout.
    caller = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CALLER, json.dumps(stdio_server(log))],
        env={**os.environ, "PYTHONPATH": _env(log)["PYTHONPATH"]},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert caller.stdout is not None
        assert read_line(caller.stdout).strip() == "ready"
        run(logged(log, call_of("progress")))
        escapees = procs.freeze_tree(caller.pid)
        frozen = [caller.pid, *procs.descendant_pids([caller.pid])]
        deadline = time.monotonic() + WAIT
        while not all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in frozen):
            assert time.monotonic() < deadline, "the tree did not stop"
            time.sleep(0.01)
        time.sleep(5.0)  # the pause itself: longer than the idle timeout
        procs.thaw_tree(caller.pid, escapees)
        outcome = json.loads(read_line(caller.stdout))
        assert outcome == {"text": "10 steps"}
    finally:
        with contextlib.suppress(ProcessLookupError):  # the caller's group: its server too
            os.killpg(caller.pid, signal.SIGKILL)
        caller.wait(timeout=WAIT)
        if caller.stdout is not None:
            caller.stdout.close()


@pytest.mark.timeout(180)
def test_a_cancel_racing_a_calls_natural_end_never_returns_its_result(log: Path) -> None:
    # The cancel lands at every point of a short call's life (before the request is
    # written, while it is in flight, as its answer arrives): whenever the cancel was
    # accepted the call raises CancelledError, never its result, and the server stays
    # usable; whenever the call had already ended, its result is whole.
    async def main() -> None:
        tools = McpTools({"t": stdio_server(log)}, grace=10.0)
        try:
            await tools.call("mcp__t__echo", {"text": "warm"})
            pid = tools.server_pids()["t"]
            outcomes = {"cancelled": 0, "returned": 0}
            for i in range(300):
                tools.last_fate = None
                task = asyncio.create_task(tools.call("mcp__t__echo", {"text": f"n{i}"}))
                if i % 2:  # within the first few steps of the call
                    for _ in range(i % 40):
                        await asyncio.sleep(0)
                else:  # 0-19 ms: in flight, answering, or done (a round trip is ~4 ms)
                    await asyncio.sleep((i % 40) / 2000)
                accepted = task.cancel()
                try:
                    result = await task
                except asyncio.CancelledError:
                    assert accepted
                    # None: cancelled before the call began (asyncio never ran it)
                    assert tools.last_fate in ("cancelled", None)
                    outcomes["cancelled"] += tools.last_fate == "cancelled"
                else:
                    assert not accepted and result.text == f"n{i}"
                    outcomes["returned"] += 1
            assert outcomes["cancelled"] > 0 and outcomes["returned"] > 0, outcomes
            assert tools.server_pids() == {"t": pid}  # cooperative stops all along
            assert (await tools.call("mcp__t__echo", {"text": "end"})).text == "end"
        finally:
            await tools.aclose()

    run(main())


def test_a_cancel_of_a_call_whose_http_server_is_still_connecting_ends_at_once(
    log: Path, hung_http_url: str
) -> None:
    # A preempt or cancel of a call that is still opening its connection (the server
    # stuck in the handshake) must not wait for a handshake that will not end.
    async def main() -> None:
        tools = McpTools({"s": {"url": hung_http_url}}, grace=2.0)
        try:
            task = asyncio.create_task(tools.call("mcp__s__echo", {"text": "x"}))
            await logged(log, lambda r: r["event"] == "handshake_held")
            began = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - began < 1.0
        finally:
            await tools.aclose()

    run(main())
