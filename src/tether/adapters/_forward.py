"""A forwarder for the model requests of a CLI that has an HTTP client of its own.

Claude Code's CLI (a Node process) talks to the model itself; on a cancel it takes a
couple of milliseconds to act on its interrupt and drop the stream, and semantics §16.1 wants
the stream closed at once. So the CLI's ``ANTHROPIC_BASE_URL`` points here
(``127.0.0.1``, a free port, in the worker, with a per-turn secret as its path) and each
request is forwarded to the real endpoint, its reply streamed back chunk by chunk as it
comes (the bytes untouched, compressed or not).

:meth:`Forwarder.cut` may be called from any thread (the worker's reader thread calls it
the moment a cancel arrives, not waiting for the event loop): it shuts the write side of
every upstream connection in flight, so the model server sees the client gone now, and
lets what had already arrived reach the CLI (cancelling the pumps would drop bytes the
forwarder held but had not passed on: the cut reply would lose them). The upstream
connections are closed once they end, or after ``_DRAIN`` at the latest; the CLI's side
of each stays open and silent, so the CLI ends the turn through its interrupt (keeping
the cut reply), not through a network error it would retry. Nothing new is forwarded
after a cut.

The listening side is asyncio streams with ``h11`` (HTTP/1.1 framing, keep-alive); the
upstream side is ``httpx``. Headers pass through as they came, but for the key: the CLI
holds only a stand-in (``KEY_STAND_IN``), which the forwarder replaces with the session's
key, or drops for a server that wants none. No header is ever logged, nor is the secret
(logs carry the path after it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import secrets
import socket
import threading
from typing import Any

import h11
import httpx
import structlog

__all__ = ["ANTHROPIC", "KEY_STAND_IN", "Forwarder"]

log = structlog.get_logger("tether.adapters.forward")

ANTHROPIC = "https://api.anthropic.com"  # the CLI's own default endpoint
# The key the CLI is given: a key it must have, though not the session's (semantics §17.4)
KEY_STAND_IN = "tether-forwarder-holds-the-key"
_KEY_HEADER = b"x-api-key"
_READ = 65536
_DRAIN = 0.25  # seconds a cut upstream may take to end before it is closed outright
# Hop-by-hop headers (RFC 9110 §7.6.1), and those each side frames for itself: h11 on the
# CLI's side, httpx on the upstream side.
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_REQUEST_DROP = _HOP | {b"host", b"content-length", b"expect"}
# A streamed reply's content deltas, as the Anthropic wire names its SSE events
_DELTA = re.compile(rb"(?m)^event:[ \t]*content_block_delta[ \t]*\r?$")
_CARRY = 64  # bytes kept across chunks so a marker split between two is counted once


class Forwarder:
    """One turn's forwarder: :meth:`start` it, hand its :attr:`url` to the CLI,
    :meth:`cut` on a cancel, :meth:`aclose` at the turn's end."""

    def __init__(self, upstream: str, *, key: str | None = None, stand_in: str = "") -> None:
        self.upstream = upstream.rstrip("/")
        # the CLI's stand-in key header, and what replaces it upstream (None: nothing)
        self._stand_in = stand_in.encode()
        self._key = None if key is None else key.encode()
        self.url = ""
        # The per-turn secret, the path of the CLI's base URL: a request without it is
        # refused before its body is read (the listener is on loopback, open to every
        # local process for the turn's life; the key must reach only the CLI's upstream).
        self._prefix = ("/" + secrets.token_urlsafe(24)).encode("ascii")
        # No timeout on reads: a model stream may pause for long, and the CLI has its own
        # timeouts (when it gives up, it closes its side and the upstream goes with it).
        # No redirects followed: a redirect's target gets no key from here.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=60.0), follow_redirects=False
        )
        self._client.headers.clear()  # send the CLI's headers, not httpx's defaults
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # cut() runs in another thread: the flag and the upstream sockets are under a lock
        self._lock = threading.Lock()
        self._cut = False
        # asyncio's TransportSocket (not a socket.socket), which allows shutdown()
        self._sockets: dict[asyncio.Task[bool], Any] = {}
        self._pumps: set[asyncio.Task[bool]] = set()  # the requests in flight upstream
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # the CLI's
        # content deltas passed on to the CLI this turn; None once a reply could not be
        # counted (content-encoded): whether the CLI has shown all it was sent
        self.deltas: int | None = 0

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}{self._prefix.decode('ascii')}"
        return self.url

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> int:
        """Shut the write side of every upstream connection replying now (the server
        sees the disconnect before anything else runs), and forward nothing new; how
        many were shut. Thread-safe, idempotent; the rest happens on the loop."""
        with self._lock:
            if self._cut:
                return 0
            self._cut = True
            socks = list(self._sockets.values())
        for sock in socks:
            _shut(sock, socket.SHUT_WR)
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._after_cut)
        return len(socks)

    def _after_cut(self) -> None:
        """On the loop: a request with no reply yet has no socket to shut: cancelled (its
        connection closes as its task unwinds); the rest get ``_DRAIN`` to end."""
        with self._lock:
            replying = set(self._sockets)
        for pump in self._pumps - replying:
            pump.cancel()
        if self._pumps and self._loop is not None:
            self._loop.call_later(_DRAIN, self._close_upstream)

    def _close_upstream(self) -> None:
        with self._lock:
            socks = list(self._sockets.values())
        for sock in socks:
            _shut(sock, socket.SHUT_RDWR)
        for pump in list(self._pumps):
            pump.cancel()

    async def settled(self) -> None:
        """Wait until no request is in flight upstream (after a cut: until what had
        arrived was passed on to the CLI)."""
        while self._pumps:
            await asyncio.wait(list(self._pumps))

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        # Dropped, not cancelled: each connection's task sees its end and returns (a
        # cancelled one would be logged by asyncio's stream callback)
        for writer in list(self._conns.values()):
            writer.transport.abort()
        if self._conns:
            await asyncio.wait(list(self._conns))
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        await self._client.aclose()

    # ---- one connection from the CLI ----------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns[task] = writer
        conn = h11.Connection(h11.SERVER)
        try:
            while await self._exchange(conn, reader, writer):
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, OSError):
            pass  # the CLI's side broke: the upstream request went with it
        except Exception as exc:  # never a traceback that could carry a request's bytes
            log.warning("forward.failed", error=type(exc).__name__)
        finally:
            self._conns.pop(task, None)
            writer.close()

    def _path(self, target: bytes) -> str | None:
        """The request's path after the secret; None when it does not carry it."""
        n = len(self._prefix)
        if not hmac.compare_digest(target[:n], self._prefix) or target[n : n + 1] != b"/":
            return None
        return target[n:].decode("ascii")

    async def _exchange(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """One request and its reply; whether the connection serves another."""
        got = await self._request(conn, reader, writer)
        if got is None:
            return False
        if self._cut:  # after a cancel nothing reaches the model: silent till the CLI goes
            return await _silent(reader)
        request, path, body = got
        pump = asyncio.ensure_future(self._pump(conn, request, path, body, writer))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)  # settled() waits for the pumps alone
        watch: asyncio.Future[bytes] | None = None
        try:
            # While the reply streams, read the CLI's side too: if it lets go (its own
            # abort, its timeout), the upstream request is closed with it.
            while not pump.done():
                watch = watch or asyncio.ensure_future(reader.read(_READ))
                either: set[asyncio.Future[Any]] = {pump, watch}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if watch.done():
                    data = watch.result()
                    watch = None
                    if not data:
                        return False
                    conn.receive_data(data)  # a next request sent early: h11 keeps it
            if not pump.cancelled() and conn.our_state is h11.DONE:
                return pump.result()
            if not self._cut:
                return False  # the upstream broke mid-reply: the CLI sees its connection drop
            # Cut: the CLI's side stays open and silent until it lets go of it, which it
            # does when it acts on its interrupt.
            if watch is not None:
                if not await watch:
                    return False
                watch = None
            return await _silent(reader)
        finally:
            if watch is not None:
                watch.cancel()
            pump.cancel()
            await asyncio.wait({pump})  # its upstream connection closed before we go on

    async def _request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[h11.Request, str, bytes] | None:
        """The CLI's next request whole (its path after the secret, its body); None when
        the connection ends instead (a 404 first, to a request without the secret)."""
        request = await _next(conn, reader)
        if not isinstance(request, h11.Request):
            return None
        path = self._path(request.target)
        if path is None:
            log.warning("forward.refused")  # not the CLI: its target is not logged
            _error(conn, writer, 404, "not_found_error", "not found", close=True)
            await writer.drain()
            return None
        body = bytearray()
        while isinstance(event := await _next(conn, reader), h11.Data):
            body += event.data
        if not isinstance(event, h11.EndOfMessage):
            return None
        return request, path, bytes(body)

    def _with_key(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The CLI's headers with its stand-in key replaced by the session's (or dropped)."""
        out = [(k, v) for k, v in headers if not (k.lower() == _KEY_HEADER and v == self._stand_in)]
        if len(out) != len(headers) and self._key is not None:
            out.append((_KEY_HEADER, self._key))
        return out

    async def _pump(
        self,
        conn: h11.Connection,
        request: h11.Request,
        path: str,
        body: bytes,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Forward one request and stream its reply back; whether the connection can serve
        another. A cancel (a cut) closes the upstream connection on its way out."""
        method = request.method.decode("ascii")
        headers = [(k, v) for k, v in request.headers.raw_items() if k.lower() not in _REQUEST_DROP]
        if self._stand_in:
            headers = self._with_key(headers)
        upstream = self._client.build_request(
            method, self.upstream + path, headers=headers, content=body
        )
        try:
            response = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            # Nothing sent yet: the CLI sees a 502 (which it retries, as a network error)
            log.info("forward.upstream_failed", path=path, error=type(exc).__name__)
            _error(conn, writer, 502, "api_error", f"Tether could not reach the model: {exc}")
            return _reusable(conn)
        me = asyncio.current_task()
        assert me is not None
        self._hold(me, response)
        try:
            await self._relay(conn, response, writer)
        except httpx.HTTPError as exc:
            # The upstream broke mid-reply (or ended after a cut, which is no news)
            if not self._cut:
                log.info("forward.upstream_broke", path=path, error=type(exc).__name__)
            return False
        finally:
            with self._lock:
                self._sockets.pop(me, None)
            await response.aclose()  # before the reply's end: closes the connection
        return _reusable(conn)

    def _hold(self, me: asyncio.Task[Any], response: httpx.Response) -> None:
        """Keep the reply's upstream socket where a cut finds it (shut at once when the
        cut came while the reply's head was on its way)."""
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            return
        with self._lock:
            self._sockets[me] = sock
            late = self._cut
        if late:
            _shut(sock, socket.SHUT_WR)

    async def _relay(
        self, conn: h11.Connection, response: httpx.Response, writer: asyncio.StreamWriter
    ) -> None:
        """Pass the reply's head, bytes and end on to the CLI, counting its content deltas
        on the way."""
        counting = _is_stream(response)
        if counting and _encoded(response):
            counting, self.deltas = False, None  # not countable: the CLI is not waited for
        carry = b""
        # The bytes go through as they came (``aiter_raw``: still content-encoded),
        # so the upstream's Content-Length stays true; without one h11 chunks them.
        head = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP]
        reason = response.reason_phrase.encode("latin-1", "replace")
        writer.write(
            conn.send(h11.Response(status_code=response.status_code, headers=head, reason=reason))
            or b""
        )
        async for chunk in response.aiter_raw():
            writer.write(conn.send(h11.Data(data=chunk)) or b"")
            if counting and self.deltas is not None:
                found, carry = _deltas(carry, chunk)
                self.deltas += found
            await writer.drain()
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()


def _deltas(carry: bytes, chunk: bytes) -> tuple[int, bytes]:
    """The content deltas ``chunk`` completes, and the carry for the next chunk."""
    seen = carry + chunk
    # a marker wholly inside the carry was counted with the last chunk
    return len(_DELTA.findall(seen)) - len(_DELTA.findall(carry)), seen[-_CARRY:]


async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    """The next h11 event of the CLI's side, reading as needed."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(_READ))


async def _silent(reader: asyncio.StreamReader) -> bool:
    """Say nothing until the CLI closes its side (when it acts on its interrupt)."""
    while await reader.read(_READ):
        pass
    return False


def _shut(sock: Any, how: int) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(how)


def _is_stream(response: httpx.Response) -> bool:
    kind: str = response.headers.get("content-type", "")
    return kind.lower().startswith("text/event-stream")


def _encoded(response: httpx.Response) -> bool:
    """Compressed: its content deltas cannot be counted as the bytes pass."""
    return response.headers.get("content-encoding", "identity").strip().lower() not in (
        "",
        "identity",
    )


def _reusable(conn: h11.Connection) -> bool:
    return conn.our_state is h11.DONE and conn.their_state is h11.DONE


def _error(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    status: int,
    kind: str,
    message: str,
    *,
    close: bool = False,
) -> None:
    """An error reply in the Anthropic wire's shape."""
    body = json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        head.append((b"connection", b"close"))
    writer.write(conn.send(h11.Response(status_code=status, headers=head)) or b"")
    writer.write(conn.send(h11.Data(data=body)) or b"")
    writer.write(conn.send(h11.EndOfMessage()) or b"")
