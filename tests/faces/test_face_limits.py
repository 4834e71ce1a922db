"""The request limits of ``/rpc`` (1 MiB body, 64 levels of nesting), kept by the protocol
faces of ``tether serve`` (``/a2a``, ``/mcp``), against a real server over real sockets."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from tether_server import LiveServer

pytestmark = pytest.mark.timeout(90)

MIB = 1 << 20
FACES = ["/a2a", "/mcp"]
# What each face's SDK needs to take a request at all (its version, the streams it reads).
HEADERS = {
    "/a2a": {"A2A-Version": "1.0"},
    "/mcp": {"Accept": "application/json, text/event-stream"},
}
# Phrases of the exceptions these bodies raised inside the SDKs, which reached the caller.
EXCEPTION_TEXT = ("Traceback", "Error(", "recursion", "Exceeds the limit", "codec can't")


def _head(server: LiveServer, path: str, extra: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{server.port}"]
    headers = {"Content-Type": "application/json", **server.auth, **HEADERS[path], **extra}
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and the body of the response on ``sock`` (its length is declared)."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed with no response: {got[:200]!r}"
        got += chunk
    head, body = got.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), lines
    fields = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(fields["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed inside the body: {body[:200]!r}"
        body += chunk
    return int(lines[0].split()[1]), body


def _peak_reset(pid: int) -> None:
    """Start the process's peak resident size (VmHWM) again from its current size."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _peak(pid: int) -> int:
    """The process's peak resident size since the last reset, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("path", FACES)
def test_a_face_refuses_a_declared_length_over_the_limit_at_once(
    server: LiveServer, path: str
) -> None:
    """A declared 300 MiB body is refused before a byte of it is sent."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(_head(server, path, {"Content-Length": str(300 * MIB)}))
        status, got = _response(sock)  # nothing of the body was sent: only a refusal answers
    assert status == 413, got[:300]
    assert json.loads(got) == {"error": "request body over 1048576 bytes"}


@pytest.mark.parametrize("path", FACES)
def test_a_face_refuses_a_streamed_body_over_the_limit_without_holding_it(
    server: LiveServer, path: str
) -> None:
    """50 MiB, chunked with no length declared: refused with 413 long before its end,
    and the server's memory does not grow with it."""
    assert server.proc is not None
    pid = server.proc.pid
    rss = psutil.Process(pid).memory_info().rss
    _peak_reset(pid)
    total = 50 * MIB
    sent = [0]
    chunk = b"4000\r\n" + b" " * 0x4000 + b"\r\n"  # 16 KiB of whitespace per chunk
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(server, path, {"Transfer-Encoding": "chunked"}))

        def upload() -> None:
            try:
                while sent[0] < total:
                    sock.sendall(chunk)
                    sent[0] += 0x4000
                sock.sendall(b"0\r\n\r\n")
            except OSError:  # the server may hang up once it has answered
                pass

        writer = threading.Thread(target=upload, daemon=True)
        writer.start()
        status, got = _response(sock)
        at_answer = sent[0]
        writer.join(timeout=30)
    assert status == 413, got[:300]
    assert not writer.is_alive()
    # Answered while the client was still sending: the server did not wait for the end.
    assert at_answer < total, "the server answered only once the whole body was in"
    grown = _peak(pid) - rss
    assert grown < 8 * MIB, f"the server's peak memory grew by {grown / MIB:.1f} MiB"


@pytest.mark.parametrize("path", FACES)
def test_a_face_answers_413_to_a_client_that_writes_its_whole_body_first(
    server: LiveServer, path: str
) -> None:
    status, body = server.request("POST", path, b"[" + b" " * (2 * MIB) + b"]", HEADERS[path])
    assert status == 413, body[:300]
    assert json.loads(body) == {"error": "request body over 1048576 bytes"}


def _nested(depth: int, leaf: str = "1") -> str:
    return '{"a":' * depth + leaf + "}" * depth


def _message(data: str) -> str:
    part = '{"data":' + data + "}"
    message = '{"messageId":"m1","role":"ROLE_USER","parts":[{"text":"hi"},' + part + "]}"
    return '{"jsonrpc":"2.0","id":7,"method":"SendMessage","params":{"message":' + message + "}}"


@pytest.mark.parametrize("path", FACES)
def test_a_face_refuses_json_nested_past_64_levels_without_an_exception_text(
    server: LiveServer, path: str
) -> None:
    bodies: list[tuple[bytes, int, Any]] = [
        # (body, JSON-RPC code, id): within the decoder's guard the id is known.
        (_message(_nested(60)).encode(), -32600, 7),
        (_message(_nested(500)).encode(), -32600, 7),
        (_message(_nested(5000)).encode(), -32600, None),
        (b"[" * 100_000 + b"]" * 100_000, -32600, None),
        (_message('{"n":' + "9" * 5000 + "}").encode(), -32700, None),
        (_message('{"n":' + "9" * 25 + "}").encode(), -32602, 7),
        (b'{"jsonrpc":"2.0","id":7,"method":"\xff"}', -32700, None),
    ]
    for body, code, rid in bodies:
        status, answer = server.request("POST", path, body, HEADERS[path])
        assert status == 400, (body[:80], status, answer[:300])
        doc = json.loads(answer)
        assert (doc["error"]["code"], doc["id"]) == (code, rid), (body[:80], doc)
        for text in EXCEPTION_TEXT:
            assert text not in answer.decode(), (body[:80], answer[:300])


def test_a2a_takes_data_nested_within_the_limit(server: LiveServer) -> None:
    status, answer = server.request("POST", "/a2a", _message(_nested(20)).encode(), HEADERS["/a2a"])
    assert status == 200, answer[:300]
    task = json.loads(answer)["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
