"""The event hub behind ``GET /events``: numbering, a replay ring, per-client queues.

Everything here runs on the server's asyncio loop; the runtime's subscriber callback
only hands each event over with ``loop.call_soon_threadsafe`` (see server.py), so the
runtime never waits for a client. Each client has a queue bounded in events and in bytes:
one that falls behind is dropped with a final ``closed`` event (reason
``slow-consumer``) rather than buffered without bound, and it can resume from its last
id while the ring still holds it. The ring too is bounded in events and in bytes (an
event can carry a megabyte of text): what it no longer holds, a resuming client learns
of with a ``gap`` event.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import msgspec

__all__ = ["CLIENT_BYTES", "CLIENT_LIMIT", "HISTORY", "HISTORY_BYTES", "EventHub", "Subscriber"]

HEARTBEAT: Final = 15.0  # seconds of silence before a comment line, so dead peers surface
HISTORY: Final = 4096  # events kept for Last-Event-ID replay ...
HISTORY_BYTES: Final = 32 << 20  # ... and at most this many bytes of them
CLIENT_LIMIT: Final = 1024  # events queued for one client before it is dropped ...
CLIENT_BYTES: Final = 8 << 20  # ... or this many bytes


class _Item(msgspec.Struct, frozen=True):
    id: int
    session: str
    lineage: tuple[str, ...]
    frame: bytes


def _frame(event: str, payload: dict[str, Any], event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\n".encode() + b"data: " + msgspec.json.encode(payload) + b"\n\n"


class Subscriber:
    """One ``/events`` client: the events it has not been sent yet, and why it stopped."""

    def __init__(
        self, session: str | None, limit: int, position: int, byte_limit: int = CLIENT_BYTES
    ) -> None:
        self.session = session
        self.limit = limit
        self.byte_limit = byte_limit
        self.position = position  # the id of the last event this client has (or skipped)
        self.pending: deque[tuple[int | None, bytes]] = deque()
        self.pending_bytes = 0
        self.closed: str | None = None
        self._wake = asyncio.Event()

    def wants(self, item: _Item) -> bool:
        return self.session is None or self.session == item.session or self.session in item.lineage

    def offer(self, item: _Item) -> bool:
        """Queue one event; False (and closed) if the client has fallen too far behind
        (in events, or in bytes: one event alone is always taken)."""
        size = len(item.frame)
        if len(self.pending) >= self.limit or (
            self.pending and self.pending_bytes + size > self.byte_limit
        ):
            self.close("slow-consumer")
            return False
        self.pending.append((item.id, item.frame))
        self.pending_bytes += size
        self._wake.set()
        return True

    def close(self, reason: str) -> None:
        if self.closed is None:
            self.closed = reason
            self._wake.set()

    async def stream(self) -> AsyncIterator[bytes]:
        """The response body: queued frames, heartbeats, then one final ``closed`` event."""
        yield b": tether events\n\n"  # flushes the headers at once, so the client sees 200
        while True:
            if not self.pending and self.closed is None:
                try:
                    await asyncio.wait_for(self._wake.wait(), HEARTBEAT)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
            self._wake.clear()
            # Once dropped for falling behind, what is still queued is not sent: the
            # client resumes from the last id it actually received, which the final
            # event names.
            while self.pending and self.closed != "slow-consumer":
                event_id, frame = self.pending.popleft()
                self.pending_bytes -= len(frame)
                self.position = event_id or self.position
                yield frame
            if self.closed is not None:
                yield _frame("closed", {"reason": self.closed, "last_id": self.position})
                return


class EventHub:
    """Numbers runtime events, keeps the last ``history`` (at most ``history_bytes``)
    for replay, fans them out."""

    def __init__(
        self,
        *,
        history: int = HISTORY,
        client_limit: int = CLIENT_LIMIT,
        history_bytes: int = HISTORY_BYTES,
        client_bytes: int = CLIENT_BYTES,
    ) -> None:
        self._ring: deque[_Item] = deque()
        self._history = history
        self._history_bytes = history_bytes
        self._ring_bytes = 0
        self._client_bytes = client_bytes
        self._lost = 0  # the newest id no longer (or never) in the ring
        # Ids start from the boot time in microseconds, so they keep increasing across
        # server restarts and a client resuming from an earlier server sees the gap.
        self._next_id = time.time_ns() // 1000
        self._client_limit = client_limit
        self._subscribers: set[Subscriber] = set()
        self._closed: str | None = None

    @property
    def last_id(self) -> int:
        return self._next_id - 1

    def publish(
        self,
        name: str,
        session: str,
        lineage: Sequence[str],
        data: Any,
        ts: float,
    ) -> None:
        event_id = self._next_id
        self._next_id += 1
        payload = {
            "id": event_id,
            "event": name,
            "session": session,
            "lineage": list(lineage),
            "data": data,
            "ts": ts,
        }
        item = _Item(event_id, session, tuple(lineage), _frame(name, payload, event_id))
        self._keep(item)
        for sub in [s for s in self._subscribers if s.wants(item)]:
            if not sub.offer(item):
                self._subscribers.discard(sub)

    def _keep(self, item: _Item) -> None:
        """Add ``item`` to the ring, dropping the oldest past either bound; an event
        bigger than the whole byte bound is sent live but not kept."""
        ring = self._ring
        size = len(item.frame)
        if size > self._history_bytes:
            self._lost = item.id
            return
        ring.append(item)
        self._ring_bytes += size
        while len(ring) > self._history or self._ring_bytes > self._history_bytes:
            old = ring.popleft()
            self._ring_bytes -= len(old.frame)
            self._lost = max(self._lost, old.id)

    def subscribe(self, session: str | None, last_id: int | None) -> Subscriber:
        """A new client, with every retained event after ``last_id`` already queued.

        ``last_id=0`` asks for everything retained. A client whose next event has
        already left the ring (or was never in this server's) first gets a ``gap``
        event, then everything retained.
        """
        replay: list[_Item] = []
        gap = False
        if last_id is None:
            last_id = self.last_id
        else:
            if last_id > self.last_id:  # not an id of ours: a clock went back
                last_id, gap = 0, True
            oldest = self._ring[0].id if self._ring else self._next_id
            gap = gap or 0 < last_id < oldest - 1 or 0 < last_id < self._lost
            replay = [i for i in self._ring if i.id > last_id]
        sub = Subscriber(session, self._client_limit, last_id, self._client_bytes)
        if gap:
            sub.pending.append((None, _frame("gap", {"reason": "events before this were lost"})))
        sub.pending.extend((i.id, i.frame) for i in replay if sub.wants(i))
        # The replay does not count against the client (it is bounded by the ring).
        sub.pending_bytes = sum(len(frame) for _, frame in sub.pending)
        sub.limit += len(sub.pending)
        sub.byte_limit += sub.pending_bytes
        if self._closed is not None:
            sub.close(self._closed)
        else:
            self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subscribers.discard(sub)

    def close(self, reason: str = "shutdown") -> None:
        """End every stream (server shutdown): each gets its final ``closed`` event."""
        self._closed = reason
        for sub in self._subscribers:
            sub.close(reason)
        self._subscribers.clear()
