"""``tether serve`` against hostile or slow clients, over real HTTP (issue 16, items 12, 15).

Each test starts a real server subprocess (``tests/tether_server.py``) and talks to it
with raw sockets where the headers must be malformed on purpose.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tether_server import running_server

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
def test_a_malformed_host_or_origin_header_is_refused_with_400_or_403_on_every_route(
    tmp_path: Path,
) -> None:
    with running_server(tmp_path) as server:
        port = server.port
        for method, path in ROUTES:
            for host in BAD_HOSTS:
                answer = raw_request(port, method, path, [("Host", host)])
                assert status_of(answer) == 400, (method, path, host, answer[:300])
            for origin in BAD_ORIGINS:
                headers = [("Host", f"127.0.0.1:{port}"), ("Origin", origin)]
                answer = raw_request(port, method, path, headers)
                assert status_of(answer) == 403, (method, path, origin, answer[:300])
        # a well-formed request still works, so the refusals above were about the headers
        ok = raw_request(port, "GET", "/health", [("Host", f"127.0.0.1:{port}")])
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
