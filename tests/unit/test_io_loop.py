"""The pool's one I/O loop (issue 17, item 2): every worker socket on one thread, frames
sent without blocking, what a full socket cannot take kept in order in a bounded outbox.

The loop is driven here over real socketpairs; the pool's own use of it is what every
runtime test exercises (``test_faults`` holds the stopped worker with a full socket).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from drivers import SCRIPTED, Recorder, runtime, steps
from tether import User
from tether.runtime.backends._io import Conn, IOLoop
from tether.wire.codec import FrameSplitter

pytestmark = pytest.mark.timeout(60)

_HEADER = struct.Struct(">I")


class _Peer:
    """The worker's end of a socketpair: reads frames when told to."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.split = FrameSplitter()

    def read_frames(self, n: int, timeout: float = 10.0) -> list[bytes]:
        out: list[bytes] = []
        self.sock.settimeout(timeout)
        while len(out) < n:
            data = self.sock.recv(1 << 20)
            assert data, "the stream ended early"
            got, bad = self.split.feed(data)
            assert bad is None
            out.extend(got)
        return out


class _Ends:
    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.ended: list[str | None] = []
        self.done = threading.Event()

    def frame(self, payload: bytes) -> str | None:
        self.frames.append(payload)
        return "bad frame" if payload == b"poison" else None

    def end(self, error: str | None) -> None:
        self.ended.append(error)
        self.done.set()


_peers: list[socket.socket] = []


@pytest.fixture
def loop() -> Iterator[IOLoop]:
    io = IOLoop("test-io")
    io.start()
    yield io
    io.close()
    assert not io._thread.is_alive()
    while _peers:
        _peers.pop().close()


def _pair(io: IOLoop) -> tuple[Conn, _Peer, _Ends]:
    host, worker = socket.socketpair()
    _peers.append(worker)
    ends = _Ends()
    conn = Conn(io, host, ends.frame, ends.end, pid=0)
    io.add(conn)
    return conn, _Peer(worker), ends


@pytest.mark.unit
def test_frames_posted_from_many_threads_arrive_whole_and_each_threads_in_order(
    loop: IOLoop,
) -> None:
    conn, peer, _ = _pair(loop)
    per_thread = 300
    big = os.urandom(300_000)  # far over a socket buffer: most sends are partial

    def poster(k: int) -> None:
        for i in range(per_thread):
            body = big if i % 50 == 0 else b"x" * (i % 7)
            conn.post((f"{k}:{i}:".encode() + body,))

    threads = [threading.Thread(target=poster, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    frames = peer.read_frames(4 * per_thread)
    for t in threads:
        t.join()
    seen: dict[int, int] = {}
    for f in frames:
        k, i, body = f.split(b":", 2)
        assert int(i) == seen.get(int(k), -1) + 1  # each thread's frames in order
        seen[int(k)] = int(i)
        assert body == (big if int(i) % 50 == 0 else b"x" * (int(i) % 7))  # whole
    assert seen == dict.fromkeys(range(4), per_thread - 1)


@pytest.mark.unit
def test_a_peer_that_stops_reading_never_blocks_a_poster_and_bounded_frames_are_capped(
    loop: IOLoop,
) -> None:
    """Posting never waits; counted (bounded) bytes over the cap are refused with what
    is held, and are counted again as free once the peer reads them."""
    conn, peer, _ = _pair(loop)
    chunk = b"s" * 100_000
    t0 = time.monotonic()
    for _ in range(40):  # 4 MB: the socket takes a fraction, the outbox the rest
        assert conn.post((chunk,)) is None
    assert time.monotonic() - t0 < 5.0
    cap = 250_000
    assert conn.post((chunk,), len(chunk), cap) is None
    assert conn.post((chunk,), len(chunk), cap) is None
    held = conn.post((chunk,), len(chunk), cap)
    assert held == 200_000  # the third would pass the cap: refused, nothing queued
    assert len(peer.read_frames(42)) == 42  # the peer drains all it was sent, in order

    def freed() -> bool:
        return conn._held == 0

    deadline = time.monotonic() + 10
    while not freed():
        assert time.monotonic() < deadline, "the outbox never drained"
        time.sleep(0.01)
    assert conn.post((chunk,), len(chunk), cap) is None  # room again


@pytest.mark.unit
def test_the_end_comes_once_after_the_last_frame_and_a_bad_frame_ends_the_stream(
    loop: IOLoop,
) -> None:
    _, peer, ends = _pair(loop)
    peer.sock.sendall(b"".join(_HEADER.pack(len(p)) + p for p in (b"a", b"b", b"poison", b"c")))
    assert ends.done.wait(10)
    assert ends.frames == [b"a", b"b", b"poison"]  # nothing after the bad one is handled
    assert ends.ended == ["bad frame"]

    _, peer2, ends2 = _pair(loop)
    peer2.sock.sendall(_HEADER.pack(10) + b"half")  # cut short by the peer's end
    peer2.sock.close()
    assert ends2.done.wait(10)
    assert ends2.ended == ["protocol error: frame cut short: 4 of 10 bytes"]

    _, peer3, ends3 = _pair(loop)
    peer3.sock.sendall(_HEADER.pack(1) + b"z" + _HEADER.pack(0xFFFFFFFF))
    assert ends3.done.wait(10)
    assert ends3.frames == [b"z"]  # the frame before the bad length is still handled
    assert ends3.ended and "over the" in (ends3.ended[0] or "")


@pytest.mark.unit
def test_a_connection_closed_by_the_host_is_ended_once(loop: IOLoop) -> None:
    conn, peer, ends = _pair(loop)
    conn.post((b"hello",))
    assert peer.read_frames(1) == [b"hello"]
    conn.close()
    assert ends.done.wait(10)
    assert ends.ended == [None]
    peer.sock.settimeout(10)
    assert peer.sock.recv(10) == b""  # the host's end is closed
    conn.close()  # twice: nothing more
    assert ends.ended == [None]


def test_the_pool_runs_no_thread_per_worker() -> None:
    """Eight workers and a spare are read by one loop; the host's threads do not grow
    with the pool (v2 had a reader and a sender per worker)."""

    def pool_threads(workers: int) -> list[str]:
        with runtime(workers=workers) as rt:
            root = rt.open_session(SCRIPTED)
            rec = Recorder(rt)
            kids = [rt.spawn(root, SCRIPTED) for _ in range(workers)]
            me = User(parent=root)
            for kid in kids:
                assert isinstance(kid, str)
                rt.send(kid, "hi", authority=me, data=steps({"op": "say", "text": "hi"}))
            for kid in kids:
                assert rec.turn_ended(str(kid), timeout=20.0)["outcome"] == "completed"
            return sorted(t.name for t in threading.enumerate() if t.name.startswith("tether-pool"))

    one, eight = pool_threads(1), pool_threads(8)
    assert "tether-pool-io" in one
    assert [n for n in eight if not n.startswith("tether-pool-tool")] == [
        n for n in one if not n.startswith("tether-pool-tool")
    ]
