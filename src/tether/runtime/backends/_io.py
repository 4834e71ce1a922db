"""One I/O loop for every worker socket of a pool.

No caller ever waits on a worker's socket: a post that would block leaves the rest in the
outbox for the loop. The rules, and the bound on what waits: docs/design.md, section 5.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence

import structlog

from tether.wire.codec import MAX_FRAME, FrameSplitter, framed

__all__ = ["Conn", "IOLoop"]

log = structlog.get_logger("tether.io")

_READ_CHUNK = 256 * 1024


class Conn:
    """One worker's socket on the loop: its outbox and its frame splitter.

    ``on_frame(payload)`` returns None to go on, or an error that ends the stream (a
    frame that does not decode: the worker is faulty). ``on_end(error)`` is called once,
    after the last frame: None at a clean end of stream.
    """

    def __init__(
        self,
        loop: IOLoop,
        sock: socket.socket,
        on_frame: Callable[[bytes], str | None],
        on_end: Callable[[str | None], None],
        pid: int = 0,
    ) -> None:
        sock.setblocking(False)
        self.pid = pid  # the peer's, for the logs
        self.loop = loop
        self.sock = sock
        self.on_frame = on_frame
        self.on_end = on_end
        self._lock = threading.Lock()
        self._out: deque[tuple[memoryview, int]] = deque()  # unsent bytes, counted bytes
        self._held = 0  # counted bytes in the outbox
        self._closed = False
        self.ended = False  # the loop is done with it (set on the loop thread)
        self._splitter = FrameSplitter(MAX_FRAME)

    def post(
        self, payloads: Sequence[bytes], counted: int = 0, cap: int | None = None
    ) -> int | None:
        """Send ``payloads`` (encoded frames, in order), never blocking. ``counted``
        bytes of them count against ``cap``: over it, nothing is sent and the bytes
        already held are returned (a refusal); None once they are taken. A closed or
        broken socket takes the frames and drops them: the loop sees the worker's end
        and reports it."""
        with self._lock:
            if self._closed:
                return None
            if cap is not None and counted and self._held + counted > cap:
                return self._held
            data = framed(payloads)
            if not self._out:
                try:
                    sent = self.sock.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return None  # the worker is gone: its end is read by the loop
                if sent == len(data):
                    return None
                data = data[sent:]
                self._out.append((memoryview(data), counted))
                self._held += counted
                self.loop._ask("write", self)
                return None
            self._out.append((memoryview(data), counted))
            self._held += counted
            return None

    def _flush(self) -> bool:
        """Write what the outbox holds (loop thread); True while some is left."""
        with self._lock:
            while self._out:
                data, counted = self._out[0]
                try:
                    sent = self.sock.send(data)
                except BlockingIOError:
                    return True
                except OSError:
                    self._drop_locked()
                    return False
                if sent < len(data):
                    self._out[0] = (data[sent:], counted)
                    return True
                self._out.popleft()
                self._held -= counted
            return False

    def _drop_locked(self) -> None:
        self._out.clear()
        self._held = 0

    def close(self) -> None:
        """Drop what is unsent and close the socket; before the loop ended the stream,
        it does so first (``on_end`` is still called, once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_locked()
        if not self.loop._ask("close", self):  # the loop is gone: nobody reads it
            with contextlib.suppress(OSError):
                self.sock.close()


class IOLoop:
    """The loop thread and its selector (see the module's docstring)."""

    def __init__(self, name: str = "tether-pool-io") -> None:
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._ops: deque[tuple[str, Conn]] = deque()
        self._ops_lock = threading.Lock()
        self._stopping = False
        self._done = False
        self._owned: set[Conn] = set()  # added and not yet closed (loop thread only)
        self._buf = bytearray(_READ_CHUNK)  # what one read takes (loop thread only)
        self._view = memoryview(self._buf)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add(self, conn: Conn) -> None:
        """Start reading ``conn``'s socket."""
        if not self._ask("add", conn):
            raise RuntimeError("the I/O loop is closed")

    def close(self, timeout: float = 5.0) -> None:
        """End the loop once every socket on it has been closed (or at once, ending
        those still open); close what it owns."""
        with self._ops_lock:
            self._stopping = True
        self._wake()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    # ---- other threads ---------------------------------------------------------------

    def _ask(self, op: str, conn: Conn) -> bool:
        """Queue ``op`` for the loop thread and wake it; False once the loop is done."""
        with self._ops_lock:
            if self._done:
                return False
            self._ops.append((op, conn))
        self._wake()
        return True

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake is pending
            self._wake_w.send(b"\0")

    # ---- the loop thread -------------------------------------------------------------

    def _run(self) -> None:
        conns: set[Conn] = set()  # read by the loop (registered)
        try:
            while True:
                # closing: no more blocking, until what was asked before is carried out
                for key, mask in self._sel.select(0.0 if self._stopping else None):
                    conn = key.data
                    if conn is None:
                        with contextlib.suppress(BlockingIOError, OSError):
                            self._wake_r.recv(4096)
                        continue
                    if mask & selectors.EVENT_READ and not conn.ended:
                        self._read(conn, conns)
                    if mask & selectors.EVENT_WRITE and not conn.ended and not conn._flush():
                        self._watch(conn, write=False)
                if self._apply_ops(conns):
                    return
        except Exception:  # a bug here would silence every worker: say so loudly
            log.exception("io.loop_failed")
            raise
        finally:
            for conn in list(conns):  # only after a bug: end what is left
                self._end(conn, conns, "the host's I/O loop failed")
            for conn in self._owned:
                with contextlib.suppress(OSError):
                    conn.sock.close()

    def _apply_ops(self, conns: set[Conn]) -> bool:
        """Carry out what other threads asked; True when the loop is to end."""
        with self._ops_lock:
            ops = list(self._ops)
            self._ops.clear()
            stopping = self._stopping
            if stopping and not ops:
                self._done = True
        for op, conn in ops:
            if op == "add":
                if not conn._closed:
                    self._sel.register(conn.sock, selectors.EVENT_READ, conn)
                    conns.add(conn)
                    self._owned.add(conn)
                else:
                    conn.ended = True
                    conn.on_end(None)
                    with contextlib.suppress(OSError):
                        conn.sock.close()
            elif op == "write":
                if conn in conns and conn._flush():
                    self._watch(conn, write=True)
            elif op == "close":
                if conn in conns:
                    self._end(conn, conns, None)
                self._owned.discard(conn)
                with contextlib.suppress(OSError):
                    conn.sock.close()
        if stopping and not ops:
            for conn in list(conns):
                self._end(conn, conns, None)
            return True  # the sockets still owned are closed on the way out
        return False

    def _watch(self, conn: Conn, *, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        self._sel.modify(conn.sock, events, conn)

    def _read(self, conn: Conn, conns: set[Conn]) -> None:
        # Into one buffer the loop keeps: a fresh 256 KiB ``recv`` would be allocated
        # (and, past malloc's mmap threshold, mapped and unmapped) for every frame.
        try:
            got = conn.sock.recv_into(self._buf)
        except BlockingIOError:
            return
        except OSError:
            got = 0  # reset by a worker that died: the end of its stream
        error: str | None = None
        if not got:
            cut = conn._splitter.end()
            if cut is not None:
                log.error("frame.rejected", pid=conn.pid, error=cut.message)
                error = f"protocol error: {cut.message}"
            self._end(conn, conns, error)
            return
        payloads, bad = conn._splitter.feed(self._view[:got])
        for payload in payloads:
            try:
                error = conn.on_frame(payload)
            except Exception:  # a bug handling one frame must not end the stream
                log.exception("frame.failed", pid=conn.pid)
            if error is not None:
                break
        if error is None and bad is not None:  # the stream can no longer be trusted
            log.error("frame.rejected", pid=conn.pid, error=bad.message)
            error = f"protocol error: {bad.message}"
        if error is not None:
            self._end(conn, conns, error)

    def _end(self, conn: Conn, conns: set[Conn], error: str | None) -> None:
        """Stop reading ``conn``, then tell its owner, once."""
        if conn.ended:
            return
        conn.ended = True
        conns.discard(conn)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        try:
            conn.on_end(error)
        except Exception:
            log.exception("io.end_failed")
