"""What ``tether serve`` keeps in reserve: descriptors for the runtime, a cap on concurrent
event streams and bodies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from typing import Any, Final

import msgspec
import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

from tether.serve.refusals import http_error

__all__ = [
    "DEFAULT_FD_RESERVE",
    "NOFILE_TARGET",
    "Limits",
    "free_descriptors",
    "gated",
    "raise_descriptor_limit",
]

log = structlog.get_logger("tether.rpc")

# Descriptors kept free for the runtime (worker pipes and sockets, respawns, the store,
# tool subprocesses). A new request is refused (503) when fewer are free; a new event
# stream, which holds its descriptor for long, when fewer than twice as many are.
DEFAULT_FD_RESERVE: Final = 64
# ``serve`` raises the soft RLIMIT_NOFILE toward the hard limit, up to this.
NOFILE_TARGET: Final = 1 << 16


def free_descriptors() -> int | None:
    """File descriptors this process may still open (None: no limit, or not knowable)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd"))  # Linux; counts the listing's own fd too
    except FileNotFoundError:
        return None
    except OSError:  # EMFILE: not even the listing could be opened
        return 0
    return max(soft - used, 0)


def raise_descriptor_limit(target: int = NOFILE_TARGET) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE toward the hard limit (up to ``target``); the new
    (soft, hard). Never lowers it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class Limits:
    """Refuses, with 503 and a JSON body, what would take what the runtime needs.

    With R = ``fd_reserve``: a new ``GET /events`` stream is refused when fewer than 3R
    descriptors are free or ``max_streams`` are already open, any request when fewer
    than 2R are free. Refusals close their connection, so they hold nothing. New
    connections themselves are gated below 2R too (``gated``), and accepted in small
    batches, so a burst of them cannot take the last R.
    """

    _LOG_EVERY: Final = 5.0  # seconds between two refusal log lines

    def __init__(self, app: ASGIApp, *, max_streams: int, fd_reserve: int) -> None:
        self._app = app
        self._max_streams = max_streams
        self._reserve = fd_reserve
        self.streams = 0
        self._refused = 0
        self._logged = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        stream = scope["path"] == "/events"
        free = free_descriptors()
        if free is not None and free < self._reserve * (3 if stream else 2):
            why = f"server busy: {free} file descriptors free, {self._reserve} kept for the runtime"
            await self._refuse(why, scope, receive, send)
            return
        if not stream:
            await self._app(scope, receive, send)
            return
        if self.streams >= self._max_streams:
            why = f"too many event streams: {self.streams} open (--max-streams)"
            await self._refuse(why, scope, receive, send)
            return
        self.streams += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self.streams -= 1

    async def _refuse(self, why: str, scope: Scope, receive: Receive, send: Send) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._logged >= self._LOG_EVERY:
            log.warning("serve.refused", why=why, refused=self._refused, streams=self.streams)
            self._logged, self._refused = now, 0
        headers = {"Connection": "close", "Retry-After": "1"}
        await http_error(503, why, headers)(scope, receive, send)


def gated(protocol: Any, floor: int) -> Any:
    """uvicorn's HTTP protocol class, made to answer a bare 503 and close a connection
    that arrives while fewer than ``floor`` descriptors are free, before it reads a byte:
    a flood of connections that never send a request holds nothing for long."""
    body = msgspec.json.encode({"error": "server busy: too few file descriptors free"})
    busy = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nRetry-After: 1\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )

    class Gated(protocol):  # type: ignore[misc]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            free = free_descriptors()
            if free is not None and free < floor:
                transport.write(busy)
                transport.close()

    return Gated
