"""The model server of semantics §15.4, driven by the official ``openai`` client over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import openai
import pytest

from tether.testing import ModelServer


def _client(server: ModelServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="sk-test", max_retries=0, timeout=10)


def test_a_streamed_reply_arrives_in_chunks_with_usage_and_the_request_is_recorded() -> None:
    with ModelServer([{"text": "Hello, streaming world", "chunk": 5}]) as server:
        stream = _client(server).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(parts) == "Hello, streaming world"
        assert parts[:2] == ["Hello", ", str"]  # five characters a chunk
        assert usage is not None and usage.completion_tokens > 0
        [request] = server.requests
        assert request.body["messages"] == [{"role": "user", "content": "hi"}]
        assert request.authorization == "Bearer sk-test"
        # the client has read the last chunk; the server marks the request done just
        # after writing it (a CI run read "open" in between)
        server.wait_for(lambda s: s.requests[0].outcome != "open", what="the request's end")
        assert server.requests[0].outcome == "done" and server.disconnects == []


def test_a_client_that_closes_right_after_done_is_not_a_disconnect() -> None:
    """The openai client closes a stream once it reads [DONE], without reading the HTTP
    terminating chunk; a CI run recorded that as a disconnect. A raw client closing at
    [DONE], many times over, so the close lands in every window of the server's end."""
    messages = [{"role": "user", "content": "hi"}]
    body = json.dumps({"model": "m", "stream": True, "messages": messages})
    with ModelServer([{"text": "ok", "count": 200}]) as server:
        host, port = server.url.split("//")[1].split("/")[0].split(":")
        for _ in range(200):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    + b"Content-Length: %d\r\n\r\n" % len(body)
                    + body.encode()
                )
                seen = b""
                while b"data: [DONE]" not in seen:
                    data = sock.recv(65536)
                    assert data, "the server closed before [DONE]"
                    seen += data
        server.wait_for(
            lambda s: len(s.requests) == 200 and all(r.outcome != "open" for r in s.requests),
            what="every request's end",
        )
        assert {r.outcome for r in server.requests} == {"done"}
        assert server.disconnects == []


def test_tool_calls_stream_and_plain_replies_work_unstreamed() -> None:
    script: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "run_command", "arguments": {"argv": ["echo", "hi"]}}]},
        {"text": "done"},
    ]
    with ModelServer(script) as server:
        client = _client(server)
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "go"}], stream=True
        )
        name, arguments, finish = "", "", None
        for chunk in stream:
            choice = chunk.choices[0]
            for call in choice.delta.tool_calls or []:
                name += (call.function and call.function.name) or ""
                arguments += (call.function and call.function.arguments) or ""
            finish = choice.finish_reason or finish
        assert (name, json.loads(arguments), finish) == (
            "run_command",
            {"argv": ["echo", "hi"]},
            "tool_calls",
        )
        reply = client.chat.completions.create(model="m", messages=[])
        assert reply.choices[0].message.content == "done"
        assert reply.usage is not None
        assert [m.id for m in client.models.list()] == ["default"]


def test_errors_are_answered_count_times_then_the_script_goes_on() -> None:
    script: list[dict[str, Any]] = [
        {"status": 429, "count": 2},
        {"status": 500},
        {"text": "finally"},
    ]
    with ModelServer(script) as server:
        client = _client(server)
        for status in (429, 429, 500):
            with pytest.raises(openai.APIStatusError) as exc:
                client.chat.completions.create(model="m", messages=[])
            assert exc.value.status_code == status
        reply = client.chat.completions.create(model="m", messages=[])
        assert reply.choices[0].message.content == "finally"
        assert [r.status for r in server.requests] == [429, 429, 500, 200]


def test_a_client_that_closes_a_hung_stream_is_recorded_as_a_disconnect() -> None:
    with ModelServer([{"text": "partial", "hang": True}]) as server:
        stream = _client(server).chat.completions.create(model="m", messages=[], stream=True)
        seen = ""
        for chunk in stream:
            seen += chunk.choices[0].delta.content or ""
            if seen == "partial":
                break
        closed = time.time()
        stream.close()
        [request] = server.wait_requests(1)
        gone = server.wait_disconnect(request.id)
        assert gone.time >= closed - 0.01
        assert server.requests[0].outcome == "disconnected"


def test_named_scripts_are_chosen_by_header_or_model_and_set_over_http() -> None:
    with ModelServer([{"text": "default"}]) as server:
        server.script("alpha", [{"text": "from alpha"}])
        body = json.dumps({"name": "beta", "replies": [{"text": "from beta"}]}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{server.url[:-3]}/_tether/script", body))
        client = _client(server)

        def ask(**kw: object) -> str | None:
            reply = client.chat.completions.create(messages=[], **kw)  # type: ignore[call-overload]
            return reply.choices[0].message.content  # type: ignore[no-any-return]

        assert ask(model="alpha") == "from alpha"
        assert ask(model="x", extra_headers={"X-Tether-Script": "beta"}) == "from beta"
        assert ask(model="unknown") == "default"
        with urllib.request.urlopen(f"{server.url[:-3]}/_tether/log") as f:
            log = json.load(f)
        assert [r["script"] for r in log["requests"]] == ["alpha", "beta", "unknown"]


def test_the_module_runs_as_a_program_and_prints_its_url() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.testing.model_server"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10)
        reply = client.chat.completions.create(model="m", messages=[])
        assert reply.choices[0].message.content
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_server_in_a_process_of_its_own_is_scripted_and_queried_over_http() -> None:
    with ModelServer([{"text": "from the process", "hang": True}], process=True) as server:
        server.script("named", [{"text": "named reply"}])
        client = _client(server)
        reply = client.chat.completions.create(model="named", messages=[])
        assert reply.choices[0].message.content == "named reply"
        stream = client.chat.completions.create(model="m", messages=[], stream=True)
        next(iter(stream))
        server.wait_for(lambda s: s.requests[-1].hanging, what="the hang")
        stream.close()
        gone = server.wait_disconnect(server.requests[-1].id)
        assert [r.script for r in server.requests] == ["named", "m"]
        assert server.requests[-1].outcome == "disconnected" and gone.time > 0


def _keys_read_by_the_handlers() -> set[str]:
    """Every ``reply.get("key")`` and ``reply["key"]`` in the server's code: the keys a
    script's reply can hold, found where they take effect."""
    import ast
    import inspect

    from tether.testing import model_server

    def is_reply(node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id == "reply"

    keys: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(model_server))):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "get" and is_reply(node.func.value) and node.args:
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_reply(node.value):
            key = node.slice
        if isinstance(key, ast.Constant):
            keys.add(str(key.value))
    return keys


@pytest.mark.timeout(60)
def test_help_lists_every_reply_key_the_server_reads_with_a_line_each() -> None:
    from drivers import ROOT
    from tether.testing.model_server import REPLY_KEYS

    read = _keys_read_by_the_handlers()
    assert {"text", "tool_calls", "chunk", "pace", "hang", "status", "usage"} <= read
    assert set(REPLY_KEYS) == read
    shown = subprocess.run(
        [sys.executable, "-m", "tether.testing.model_server", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    lines = shown.splitlines()
    for key in read:
        [line] = [x for x in lines if x.split()[:1] == [key]]
        assert REPLY_KEYS[key] in line, line
    page = (ROOT / "docs" / "model-server.md").read_text(encoding="utf-8")
    assert all(f"| `{key}` |" in page for key in read), "docs/model-server.md's reply table"
