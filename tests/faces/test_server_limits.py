"""Limits of ``tether serve`` against a hostile client (issue 10, findings 1-4).

Each test drives a real server subprocess over real sockets: streams are really held
open, the descriptor limit is really lowered in the server process, disposals really
wait on a turn that ignores its cancel.
"""

from __future__ import annotations

import http.client
import json
import resource
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from drivers import HANG, SCRIPTED
from tether_server import (
    EventReader,
    LiveServer,
    rpc_address,
    rpc_error,
    running_server,
    wait_until,
)

STUBBORN = {"steps": [{"op": "ignore_cancel"}, {"op": "hang"}]}


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    """A ``preexec_fn``: the server process starts with this descriptor limit."""

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return lower


class _RawStream:
    """``GET /events`` on a bare socket: the request is sent, the answer read later."""

    def __init__(self, server: LiveServer) -> None:
        port = server.port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(
            f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {server.token}\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        self.sock.setblocking(False)
        self.buf = b""
        self.eof = False

    @property
    def status(self) -> int | None:
        head, sep, _ = self.buf.partition(b"\r\n")
        return int(head.split()[1]) if sep else None

    @property
    def body(self) -> bytes:
        return self.buf.partition(b"\r\n\r\n")[2]

    @property
    def settled(self) -> bool:
        """A stream once its headers are in; a refusal once the server has closed it."""
        if self.status == 200:
            return b"\r\n\r\n" in self.buf
        return self.eof

    def close(self) -> None:
        self.sock.close()


def _settle(streams: list[_RawStream], *, timeout: float) -> list[_RawStream]:
    """Read until every stream is settled or the deadline passes; the unsettled ones."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for s in streams:
            sel.register(s.sock, selectors.EVENT_READ, s)
        while any(not s.settled for s in streams):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(min(left, 0.5)):
                s = key.data
                try:
                    chunk = s.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    s.buf += chunk
                else:
                    s.eof = True
                    sel.unregister(s.sock)
    return [s for s in streams if not s.settled]


def _hanging_child(server: LiveServer) -> tuple[str, str]:
    root = server.call("session.open", {"driver": SCRIPTED})["session"]
    child = server.call(
        "subagent.spawn", {"parent": root, "driver": SCRIPTED, "prompt": "work", "data": HANG}
    )["session"]
    server.wait_state(child, "running")
    return root, child


def _abort_converges_and_a_new_turn_runs(server: LiveServer, root: str, child: str) -> None:
    """An abort is accepted and converges; a respawned worker then runs the next turn."""
    answer = server.call(
        "subagent.interrupt", {"address": rpc_address(child, root), "kind": "abort", "reason": "x"}
    )
    assert answer["accepted"] is True and answer["turn"] is not None
    server.wait_state(child, "parked", timeout=20.0)  # a stopped turn parks (semantics §4)
    server.call("subagent.send", {"address": rpc_address(child, root), "content": "again"})

    def second_turn_done() -> bool:
        turns = server.call("subagent.turns", {"session": child})["turns"]
        return len(turns) == 2 and turns[1]["outcome"] == "completed"

    wait_until(second_turn_done, timeout=20.0, what="a turn on a respawned worker")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        pytest.param((), id="stream-cap"),
        pytest.param(("--max-streams", "1000"), id="descriptor-reserve"),
    ],
)
def test_held_event_streams_leave_descriptors_for_an_abort(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Finding 1: 400 held ``/events`` streams against a 384-descriptor server."""
    with running_server(tmp_path, *args, preexec_fn=_nofile(384, 384)) as server:
        root, child = _hanging_child(server)
        streams = [_RawStream(server) for _ in range(400)]
        try:
            unanswered = _settle(streams, timeout=15.0)
            assert not unanswered, f"{len(unanswered)} of 400 /events requests got no answer"
            held = [s for s in streams if s.status == 200]
            refused = [s for s in streams if s.status != 200]
            assert held and refused
            for s in refused:
                assert s.status == 503, s.buf[:200]
                assert "error" in json.loads(s.body), s.body
            if "--max-streams" not in args:
                assert len(held) == 64  # the default --max-streams
            # Held open, the streams leave the runtime what a kill and a respawn need.
            _abort_converges_and_a_new_turn_runs(server, root, child)
        finally:
            for s in streams:
                s.close()

        # And once the clients go, their slots come back.
        def stream_again() -> bool:
            s = _RawStream(server)
            try:
                _settle([s], timeout=5.0)
                return s.status == 200
            finally:
                s.close()

        wait_until(stream_again, timeout=15.0, what="a new stream after the clients left")
        # The reserve was never touched: not even the accept loop ran out.
        assert "Too many open files" not in server.log_text()


@pytest.mark.timeout(60)
def test_max_streams_refuses_one_stream_too_many_with_a_json_503(tmp_path: Path) -> None:
    with running_server(tmp_path, "--max-streams", "3") as server:
        readers = [EventReader(server) for _ in range(3)]
        try:
            assert [r.status for r in readers] == [200, 200, 200]
            extra = _RawStream(server)
            try:
                assert not _settle([extra], timeout=10.0)
                assert extra.status == 503
                assert b"max-streams" in extra.body or b"streams" in extra.body
                assert set(json.loads(extra.body)) == {"error"}
            finally:
                extra.close()
            readers.pop().close()

            def slot_free() -> bool:
                s = _RawStream(server)
                try:
                    _settle([s], timeout=5.0)
                    return s.status == 200
                finally:
                    s.close()

            wait_until(slot_free, timeout=10.0, what="the closed stream's slot")
        finally:
            for r in readers:
                r.close()


@pytest.mark.timeout(60)
def test_serve_raises_the_soft_descriptor_limit_to_the_hard_one(tmp_path: Path) -> None:
    with running_server(tmp_path, preexec_fn=_nofile(128, 1024)) as server:
        assert server.proc is not None
        limits = psutil.Process(server.proc.pid).rlimit(psutil.RLIMIT_NOFILE)
        assert limits == (1024, 1024)


def _page_latency(server: LiveServer, session: str, afters: list[int]) -> float:
    """The median time of a one-entry page, over ``afters``."""
    times = []
    for after in afters:
        start = time.perf_counter()
        page = server.call("subagent.transcript", {"session": session, "after": after, "limit": 1})
        times.append(time.perf_counter() - start)
        assert len(page["entries"]) == 1
    return statistics.median(times)


@pytest.mark.timeout(180)
def test_a_transcript_page_costs_the_same_at_200000_entries_as_at_10(tmp_path: Path) -> None:
    """Finding 2: a page is an index range scan with a SQL limit, not a whole read."""
    db = tmp_path / "state.db"
    with tether.Runtime(str(db), workers=1, grace=1.0) as rt:
        long = rt.open_session(SCRIPTED, slug="long")
        short = rt.open_session(SCRIPTED, slug="short")
        store = rt._store  # written through the store's own queued, grouped commits
        seqs = {long: [], short: []}  # type: dict[str, list[int]]
        for i in range(200_000):
            seqs[long].append(store.append_entry(long, "assistant", f"entry {i}").seq)
            if i < 10:
                seqs[short].append(store.append_entry(short, "assistant", f"entry {i}").seq)
        store.flush()
    with running_server(tmp_path) as server:
        n_long = seqs[long]
        # Pages from the start, the middle and the very end of the long transcript.
        afters_long = [0, *n_long[1000:-1:9973], n_long[-2]]
        afters_short = [0, *seqs[short][:-1]] * 4
        _page_latency(server, long, afters_long[:5])  # warm both paths up
        _page_latency(server, short, afters_short[:5])
        t_long = _page_latency(server, long, afters_long * 2)
        t_short = _page_latency(server, short, afters_short)
        assert t_long < 5 * t_short + 0.005, (t_long, t_short)
        last = server.call("subagent.transcript", {"session": long, "after": n_long[-2]})
        assert [e["text"] for e in last["entries"]] == ["entry 199999"]
        assert last["more"] is False


def _post_raw(server: LiveServer, body: bytes) -> tuple[int, bytes]:
    return server.request("POST", "/rpc", body)


def _nested(depth: int, leaf: str = "1") -> str:
    return '{"a":' * depth + leaf + "}" * depth


@pytest.mark.timeout(60)
def test_deeply_nested_json_gets_a_json_rpc_error_not_a_500(tmp_path: Path) -> None:
    """Finding 3: the whole body, or only the params, nested past the limit."""
    with running_server(tmp_path) as server:
        root = server.call("session.open", {"driver": SCRIPTED})["session"]
        deep_bodies = {
            "array body": b"[" * 100_000 + b"]" * 100_000,
            "object body": _nested(50_000).encode(),
        }
        for what, body in deep_bodies.items():
            status, answer = _post_raw(server, body)
            assert status == 200, (what, status, answer[:200])
            doc = json.loads(answer)
            assert rpc_error(doc) == (-32600, "invalid-params") and doc["id"] is None, what
        # Within the decoder's own guard the id is known and answered; past it (5,000)
        # the body cannot be decoded at all, so the id is null (as for a parse error).
        for depth, rid in ((100, 7), (500, 7), (5000, None)):
            call = (
                '{"jsonrpc":"2.0","id":7,"method":"session.prompt","params":'
                f'{{"session":"{root}","content":"hi","data":{_nested(depth)}}}}}'
            )
            status, answer = _post_raw(server, call.encode())
            assert status == 200, (depth, status, answer[:200])
            doc = json.loads(answer)
            assert rpc_error(doc) == (-32600, "invalid-params") and doc["id"] == rid, (depth, doc)
            batch = f'[{call}, {{"jsonrpc":"2.0","id":8,"method":"subagent.turns","params":'
            batch += f'{{"session":"{root}"}}}}]'
            status, answer = _post_raw(server, batch.encode())
            assert status == 200, (depth, status, answer[:200])
            doc = json.loads(answer)
            if rid is None:
                assert rpc_error(doc) == (-32600, "invalid-params") and doc["id"] is None
                continue
            first, second = doc
            assert rpc_error(first) == (-32600, "invalid-params") and first["id"] == 7
            assert second["id"] == 8 and second["result"]["turns"] == []
        # Nothing was recorded by the refused calls, and nesting within the limit is fine.
        assert server.call("subagent.turns", {"session": root})["turns"] == []
        shallow = json.loads(_nested(20))
        server.call("session.prompt", {"session": root, "content": "hi", "data": shallow})


def _dispose_in_thread(
    server: LiveServer, params: dict[str, Any], sent: threading.Semaphore, out: list[Any]
) -> threading.Thread:
    def run() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            doc = {"jsonrpc": "2.0", "id": 1, "method": "subagent.dispose", "params": params}
            conn.request("POST", "/rpc", json.dumps(doc).encode(), server.auth)
            sent.release()
            out.append(json.loads(conn.getresponse().read()))
        except OSError as exc:
            out.append(exc)
        finally:
            conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_interrupt_is_answered_at_once_while_disposals_wait(tmp_path: Path) -> None:
    """Finding 4: 48 disposals of a turn that ignores its cancel (grace 10 s) are in
    flight; an interrupt of another session is still answered at once."""
    with running_server(tmp_path, "--grace", "10") as server:
        root = server.call("session.open", {"driver": SCRIPTED})["session"]
        spawn = {"parent": root, "driver": SCRIPTED, "prompt": "work"}
        stubborn = server.call("subagent.spawn", {**spawn, "data": STUBBORN})["session"]
        other = server.call("subagent.spawn", {**spawn, "data": HANG})["session"]
        server.wait_state(stubborn, "running")
        server.wait_state(other, "running")
        with EventReader(server, session=root) as events:
            sent = threading.Semaphore(0)
            answers: list[Any] = []
            params = {"address": rpc_address(stubborn, root)}
            threads = [_dispose_in_thread(server, params, sent, answers) for _ in range(48)]
            for _ in threads:
                assert sent.acquire(timeout=30.0)
            events.wait_for(
                lambda e: (
                    e["event"] == "state"
                    and e["data"]["session"] == stubborn
                    and e["data"]["data"]["state"] == "disposing"
                ),
                what="the disposal under way",
            )
            start = time.monotonic()
            body = json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 2,
                    "method": "subagent.interrupt",
                    "params": {"address": rpc_address(other, root), "kind": "abort"},
                }
            ).encode()
            status, answer = server.request("POST", "/rpc", body, timeout=5.0)
            took = time.monotonic() - start
            assert status == 200 and json.loads(answer)["result"]["accepted"] is True
            assert took < 3.0, took
            server.wait_state(other, "parked", timeout=20.0)
            for t in threads:
                t.join(timeout=40.0)
            assert len(answers) == 48
            assert all(
                a == {"jsonrpc": "2.0", "id": 1, "result": {"accepted": True}} for a in answers
            ), answers[:3]
            server.wait_state(stubborn, "settled", timeout=30.0)


@pytest.mark.timeout(60)
def test_dispose_over_rpc_returns_once_accepted(tmp_path: Path) -> None:
    with running_server(tmp_path, "--grace", "3") as server:
        root = server.call("session.open", {"driver": SCRIPTED})["session"]
        child = server.call(
            "subagent.spawn",
            {"parent": root, "driver": SCRIPTED, "prompt": "work", "data": STUBBORN},
        )["session"]
        server.wait_state(child, "running")
        wrong = server.rpc("subagent.dispose", {"address": rpc_address(child, "s_nobody")})
        assert rpc_error(wrong) == (-32000, "subagent-unauthorized")
        missing = server.rpc("subagent.dispose", {"address": rpc_address("s_nobody", root)})
        assert rpc_error(missing) == (-32000, "not-found")
        start = time.monotonic()
        answer = server.call("subagent.dispose", {"address": rpc_address(child, root)})
        assert answer == {"accepted": True}
        assert time.monotonic() - start < 2.0
        # Accepted, not finished: the cancel waits out its grace, then escalates.
        assert server.call("subagent.status", {"session": child})["state"] == "disposing"
        server.wait_state(child, "settled", timeout=20.0)
        # A second disposal of a settled session is accepted too (nothing left to do).
        assert server.call("subagent.dispose", {"address": rpc_address(child, root)}) == {
            "accepted": True
        }
