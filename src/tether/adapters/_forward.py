"""A forwarder for the model requests of a CLI that has an HTTP client of its own.

Claude Code's CLI (a Node process) talks to the model itself; on a cancel it takes a
couple of milliseconds to act on its interrupt and drop the stream, and SPEC §16.1 wants
the stream closed at once. So the CLI's ``ANTHROPIC_BASE_URL`` points here
(``127.0.0.1``, a free port, in the worker) and each request is forwarded to the real
endpoint, its reply streamed back chunk by chunk as it comes (the bytes untouched,
compressed or not). :meth:`Forwarder.cut` closes the upstream connection of every
request in flight, so the model server sees the disconnect now, and keeps the CLI's side
of each open and silent: the CLI ends the turn through its interrupt (keeping the cut
reply), not through a network error it would retry.

The listening side is asyncio streams with ``h11`` (HTTP/1.1 framing, keep-alive); the
upstream side is ``httpx``. Headers pass through as they came, the key among them; none
is ever logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

import h11
import httpx
import structlog

__all__ = ["ANTHROPIC", "Forwarder"]

log = structlog.get_logger("tether.adapters.forward")

ANTHROPIC = "https://api.anthropic.com"  # the CLI's own default endpoint
_READ = 65536
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


class Forwarder:
    """One turn's forwarder: :meth:`start` it, hand its :attr:`url` to the CLI,
    :meth:`cut` on a cancel, :meth:`aclose` at the turn's end."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.url = ""
        # No timeout on reads: a model stream may pause for long, and the CLI has its own
        # timeouts (when it gives up, it closes its side and the upstream goes with it).
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0))
        self._client.headers.clear()  # send the CLI's headers, not httpx's defaults
        self._server: asyncio.Server | None = None
        # the requests in flight upstream, with their connection's socket once replying
        self._pumps: dict[asyncio.Task[bool], socket.socket | None] = {}
        self._conns: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # the CLI's

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def cut(self) -> int:
        """Close the upstream connection of every request in flight; how many there were.
        A reply's socket is shut down here and now (the server sees the disconnect before
        anything else runs); the pumps' tasks, cancelled, then close it as they unwind."""
        pumps = list(self._pumps.items())
        for pump, sock in pumps:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            pump.cancel()
        return len(pumps)

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
        finally:
            self._conns.pop(task, None)
            writer.close()

    async def _exchange(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """One request and its reply; whether the connection serves another."""
        request = await _next(conn, reader)
        if not isinstance(request, h11.Request):
            return False
        body = bytearray()
        while isinstance(event := await _next(conn, reader), h11.Data):
            body += event.data
        if not isinstance(event, h11.EndOfMessage):
            return False
        pump = asyncio.ensure_future(self._pump(conn, request, bytes(body), writer))
        self._pumps[pump] = None
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
            if not pump.cancelled():
                return pump.result()
            # Cut: the CLI's side stays open and silent until it lets go of it, which it
            # does when it acts on its interrupt.
            while True:
                watch = watch or asyncio.ensure_future(reader.read(_READ))
                if not await watch:
                    return False
                watch = None
        finally:
            self._pumps.pop(pump, None)
            if watch is not None:
                watch.cancel()
            pump.cancel()
            await asyncio.wait({pump})  # its upstream connection closed before we go on

    async def _pump(
        self, conn: h11.Connection, request: h11.Request, body: bytes, writer: asyncio.StreamWriter
    ) -> bool:
        """Forward one request and stream its reply back; whether the connection can serve
        another. A cancel (a cut) closes the upstream connection on its way out."""
        method = request.method.decode("ascii")
        target = request.target.decode("ascii")
        headers = [(k, v) for k, v in request.headers.raw_items() if k.lower() not in _REQUEST_DROP]
        upstream = self._client.build_request(
            method, self.upstream + target, headers=headers, content=body
        )
        try:
            response = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            # Nothing sent yet: the CLI sees a 502 (which it retries, as a network error)
            log.info("forward.upstream_failed", path=target, error=type(exc).__name__)
            _error(conn, writer, f"Tether could not reach the model endpoint: {exc}")
            return _reusable(conn)
        me = asyncio.current_task()
        stream = response.extensions.get("network_stream")
        if me in self._pumps and stream is not None:
            self._pumps[me] = stream.get_extra_info("socket")
        try:
            # The bytes go through as they came (``aiter_raw``: still content-encoded),
            # so the upstream's Content-Length stays true; without one h11 chunks them.
            head = [(k, v) for k, v in response.headers.raw if k.lower() not in _HOP]
            reason = response.reason_phrase.encode("latin-1", "replace")
            writer.write(
                conn.send(
                    h11.Response(status_code=response.status_code, headers=head, reason=reason)
                )
                or b""
            )
            async for chunk in response.aiter_raw():
                writer.write(conn.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
        except httpx.HTTPError as exc:
            # The upstream broke mid-reply: the CLI sees its connection drop, as it would
            log.info("forward.upstream_broke", path=target, error=type(exc).__name__)
            return False
        finally:
            await response.aclose()  # before the reply's end: closes the connection
        return _reusable(conn)


async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    """The next h11 event of the CLI's side, reading as needed."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(_READ))


def _reusable(conn: h11.Connection) -> bool:
    return conn.our_state is h11.DONE and conn.their_state is h11.DONE


def _error(conn: h11.Connection, writer: asyncio.StreamWriter, message: str) -> None:
    """A 502 in the Anthropic wire's error shape."""
    body = json.dumps(
        {"type": "error", "error": {"type": "api_error", "message": message}}
    ).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    writer.write(conn.send(h11.Response(status_code=502, headers=head)) or b"")
    writer.write(conn.send(h11.Data(data=body)) or b"")
    writer.write(conn.send(h11.EndOfMessage()) or b"")
