"""``tether serve`` against hostile or slow clients, over real HTTP (issue 16, items 12, 15).

Each test starts a real server subprocess (``tests/tether_server.py``) and talks to it
with raw sockets where the headers must be malformed on purpose.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tether_server import TETHER, EventReader, running_server

ROUTES = [
    ("POST", "/rpc"),
    ("GET", "/events"),
    ("GET", "/health"),
    ("GET", "/"),
    ("GET", "/console/app.js"),
    ("GET", "/no-such-route"),
]
BAD_HOSTS = ["[::1", "[zz]", "http://[evil]", "[::1]]:7777", "[evil"]
BAD_ORIGINS = ["http://[evil]", "http://[::1", "http://[zz]:80", "[::1"]


def raw_request(port: int, method: str, path: str, headers: list[tuple[str, str]]) -> bytes:
    """One HTTP/1.1 request with exactly these headers (no Host added); the raw answer,
    read until the server closes or sends the whole head and body we need."""
    body = b'{"jsonrpc":"2.0","id":1,"method":"subagent.list","params":{"root":"s_x"}}'
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers)]
    lines += ["Connection: close"]
    if method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode() + (body if method == "POST" else b"")
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.sendall(data)
        out = b""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            # an accepted /events stream never ends: its status line is all we need
            if b"\r\n\r\n" in out and path == "/events" and b" 200 " in out.split(b"\r\n")[0]:
                break
    return out


def status_of(answer: bytes) -> int:
    line = answer.split(b"\r\n", 1)[0].decode()
    assert line.startswith("HTTP/1.1 "), answer[:200]
    return int(line.split()[1])


@pytest.mark.timeout(120)
def test_a_malformed_host_is_refused_with_400_and_a_malformed_origin_is_no_fault_on_any_route(
    tmp_path: Path,
) -> None:
    with running_server(tmp_path) as server:
        port = server.port
        auth = ("Authorization", f"Bearer {server.token}")
        for method, path in ROUTES:
            for host in BAD_HOSTS:
                answer = raw_request(port, method, path, [("Host", host)])
                assert status_of(answer) == 400, (method, path, host, answer[:300])
            for origin in BAD_ORIGINS:
                # the token decides, not the Origin: a malformed one is never a fault
                headers = [("Host", f"127.0.0.1:{port}"), ("Origin", origin)]
                answer = raw_request(port, method, path, headers)
                assert status_of(answer) in (200, 401, 404), (method, path, origin, answer[:300])
                answer = raw_request(port, method, path, [*headers, auth])
                assert status_of(answer) in (200, 404), (method, path, origin, answer[:300])
        # a well-formed request still works, so the refusals above were about the headers
        ok = raw_request(port, "GET", "/health", [("Host", f"127.0.0.1:{port}"), auth])
        assert status_of(ok) == 200
        log = server.log_text()
    assert "Traceback" not in log, log
    assert "Exception in ASGI application" not in log, log


@pytest.mark.timeout(120)
def test_a_malformed_host_header_is_400_with_a_token_too(tmp_path: Path) -> None:
    token = "t0ken-for-tests"
    with running_server(tmp_path, "--token", token) as server:
        port = server.port
        for method, path in ROUTES:
            for host in BAD_HOSTS:
                headers = [("Host", host), ("Authorization", f"Bearer {token}")]
                answer = raw_request(port, method, path, headers)
                assert status_of(answer) == 400, (method, path, host, answer[:300])
        log = server.log_text()
    assert "Traceback" not in log, log


# ---- item 12: the replay ring and each client's queue are bounded in bytes ---------------

BIG = 900_000  # characters a turn says (sent as its script): under the 1 MiB body cap
TURNS = 48  # about 43 MB of `entry` events: more than the ring's 32 MiB


def _say(server: Any, root: str, text: str) -> None:
    steps = {"steps": [{"op": "say", "text": text}]}
    server.call("session.prompt", {"session": root, "content": "say it", "data": steps})


def _say_big(server: Any, root: str, i: int) -> None:
    _say(server, root, f"{i:03d} " + "x" * BIG)
    server.wait_state(root, "idle", timeout=60.0)


def _sse_events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n"):
        event: dict[str, Any] = {}
        for line in block.split(b"\n"):
            field, _, value = line.decode(errors="replace").partition(": ")
            if field in ("id", "event", "data"):
                event[field] = value
        if "data" in event:
            event["data"] = json.loads(event["data"])
            out.append(event)
    return out


@pytest.mark.timeout(300)
def test_a_client_that_falls_behind_is_dropped_and_told_of_the_gap_and_replay_is_bounded(
    tmp_path: Path,
) -> None:
    with running_server(tmp_path) as server:
        root = server.call("session.open", {"driver": "tether:Scripted", "slug": "loud"})["session"]
        # A client that reads nothing: its queue fills in bytes long before 1024 events.
        slow_sock = socket.socket()
        slow_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow_sock.connect(("127.0.0.1", server.port))
        slow = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        slow.sock = slow_sock
        slow.request("GET", "/events", headers=server.auth)
        slow_response = slow.getresponse()
        assert slow_response.status == 200
        with EventReader(server) as live:
            _say_big(server, root, 0)
            first = live.wait_for(lambda e: e["event"] == "message.accepted", what="a send")
            first_id = int(first["id"])
            for i in range(1, TURNS):
                _say_big(server, root, i)
            live.nth("entry", TURNS, timeout=60.0)  # a reading client misses nothing
        # The slow client now reads: what was in flight, then `closed`, naming the last
        # event it was actually sent.
        body = b""
        while b"event: closed" not in body:
            chunk = slow_response.read1(1 << 20)
            assert chunk, body[-500:]
            body += chunk
        slow.close()
        closed = [e for e in _sse_events(body) if e["event"] == "closed"]
        assert closed and closed[0]["data"]["reason"] == "slow-consumer", closed
        last_id = int(closed[0]["data"]["last_id"])
        assert last_id < first_id + 40  # dropped early, not after buffering everything
        # It resumes from there; those events left the ring long ago: `gap` comes first,
        # then what is kept.
        with EventReader(server, last_id=last_id) as resumed:
            resumed.nth("entry", 1, timeout=30.0)
            assert resumed.events[0]["event"] == "gap", resumed.events[:2]
            kept = [e for e in resumed.events if e["event"] == "entry"]
            assert kept and int(kept[0]["id"]) > last_id
        # Everything kept, replayed from the start: at most the ring's 32 MiB of it.
        with EventReader(server, last_id=0) as everything:
            _say(server, root, "fin")
            everything.wait_for(
                lambda e: e["event"] == "entry" and e["data"]["data"]["entry"]["text"] == "fin",
                timeout=60.0,
                what="the last entry",
            )
            big = [e for e in everything.events if e["event"] == "entry" and len(str(e)) > BIG]
            assert 0 < len(big) <= (32 << 20) // BIG, len(big)
            assert big[-1]["data"]["data"]["entry"]["text"].startswith(f"{TURNS - 1:03d} ")


# ---- item 2 over RPC and the CLI: durations are bounded at every entry point -------------


@pytest.mark.timeout(180)
def test_absurd_durations_are_invalid_params_over_rpc_and_a_usage_error_in_the_cli(
    tmp_path: Path,
) -> None:
    with running_server(tmp_path) as server:
        root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
        kid = server.call("subagent.spawn", {"parent": root, "driver": "tether:Scripted"})
        address = {"session": kid["session"], "parent": root}
        bad_numbers = [1e10, 2592001, 0, -1, "1e400"]  # "1e400": JSON's way to say inf
        for field in ("deadline", "grace", "stall.after", "stall.every"):
            for value in bad_numbers:
                if field == "grace" and value == 0:
                    continue  # a grace of 0 is valid (break at delivery)
                number = value if isinstance(value, int | float) else 1e400
                if field.startswith("stall."):
                    stall = {"after": 1, field[6:]: number}
                    body = {"parent": root, "driver": "tether:Scripted", "stall": stall}
                    method = "subagent.spawn"
                else:
                    body = {"address": address, "kind": "cancel", field: number}
                    method = "subagent.interrupt"
                text = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": body})
                if value == "1e400":
                    text = text.replace("Infinity", "1e400")
                status, raw = server.request("POST", "/rpc", text.encode())
                answer = json.loads(raw)
                assert status == 200 and answer["error"]["data"]["code"] == "invalid-params", (
                    field,
                    value,
                    answer,
                )
        assert len(server.call("subagent.list", {"root": root})["agents"]) == 1
        assert "timer" not in server.log_text()
    for argv in (
        ["cancel", "s_x", "--parent", "s_y", "--deadline", "1e10"],
        ["cancel", "s_x", "--parent", "s_y", "--grace", "inf"],
        ["cancel", "s_x", "--parent", "s_y", "--deadline", "nan"],
        ["open", "--stall", "after=1e10"],
        ["serve", "--grace", "1e10"],
    ):
        done = subprocess.run(
            [TETHER, *argv, "--url", "http://127.0.0.1:9"]
            if argv[0] != "serve"
            else [TETHER, *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and "30 days" in done.stderr, (argv, done.stderr)
