"""The event stream as the terminal UI follows it: one thread reading ``GET /events``,
reconnecting by itself.

A lost connection (the server restarted, the network dropped) is retried with a backoff
(0.25 s doubling to 5 s) and resumed with ``Last-Event-ID``: the server replays what
followed, or says ``gap`` when it no longer holds it (a restarted server never does), and
the screen then reads its state again. A drop for falling behind (``closed``,
``slow-consumer``) reconnects at once from the last event actually sent. Events are handed
over in batches: the reader appends to a queue and wakes the screen only when the queue
was empty, so a burst costs one wake-up, however many events it holds.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from tether.cli.client import Client, EventStream, RpcError

__all__ = ["Feed"]

_FIRST_BACKOFF: Final = 0.25
_MAX_BACKOFF: Final = 5.0


class Feed:
    """Follow ``/events`` of ``session``'s subtree (None: everything) on a thread.

    ``wake()`` is called (from the reader thread) when events wait in ``take()``;
    ``status(text)`` when the link changes (``live``, ``reconnecting: …``, ``server
    stopped``); ``resync()`` when the screen must read its state again: after a ``gap``,
    and after a reconnection that had no event id to resume from.
    """

    def __init__(
        self,
        client: Client,
        session: str | None,
        *,
        wake: Callable[[], object],
        status: Callable[[str], object],
        resync: Callable[[], object],
    ) -> None:
        self._client = client
        self._session = session
        self._wake = wake
        self._status = status
        self._resync = resync
        self._queue: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._stream: EventStream | None = None
        # 0: the server replays what it still holds (its last 4096 events) before the live
        # ones, so the tree shows the last markers of the recent past, as the console does.
        self.last_id: int | None = 0
        self.received = 0  # events handed over so far
        self._thread = threading.Thread(target=self._run, name="tether-tui-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the reader: its blocked read returns at once, and it tells nothing more.
        Not waited for (a connection under way ends by its own timeout): the screen's loop
        never blocks on it."""
        self._stopped.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()

    def take(self) -> list[dict[str, Any]]:
        """Every event received since the last take, in order."""
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def _tell(self, text: str) -> None:
        if not self._stopped.is_set():  # a stopped reader speaks for no screen
            self._status(text)

    def _again(self) -> None:
        if not self._stopped.is_set():
            self._resync()

    def _put(self, event: dict[str, Any]) -> None:
        with self._lock:
            was_empty = not self._queue
            self._queue.append(event)
            self.received += 1
        if was_empty and not self._stopped.is_set():
            self._wake()

    def _run(self) -> None:
        backoff = _FIRST_BACKOFF
        connected_before = False
        while not self._stopped.is_set():
            try:
                stream = self._client.stream(self._session, self.last_id)
            except RpcError as exc:
                self._tell(f"reconnecting: {exc.code}")
                if self._stopped.wait(backoff):
                    return
                backoff = min(backoff * 2, _MAX_BACKOFF)
                continue
            with self._lock:
                self._stream = stream
            if self._stopped.is_set():
                stream.close()
                return
            self._tell("live")
            backoff = _FIRST_BACKOFF
            if connected_before and not self.last_id:
                # No event to resume from (a replay from 0 reports no gap): what happened
                # meanwhile is not known, so the state is read again.
                self._again()
            connected_before = True
            reason = self._read(stream)
            with self._lock:
                self._stream = None
            if self._stopped.is_set():
                return
            if reason == "slow-consumer":
                self._tell("reconnecting: fell behind")
                continue
            self._tell("server stopped: reconnecting" if reason == "shutdown" else "reconnecting")
            if self._stopped.wait(backoff):
                return
            backoff = min(backoff * 2, _MAX_BACKOFF)

    def _read(self, stream: EventStream) -> str | None:
        """Deliver events until the stream ends: the reason of its ``closed`` event."""
        try:
            for ev in stream:
                if ev.id is not None:
                    self.last_id = ev.id
                if ev.event == "closed":
                    data = ev.data if isinstance(ev.data, dict) else {}
                    if isinstance(data.get("last_id"), int):
                        self.last_id = data["last_id"]
                    return str(data.get("reason") or "closed")
                if ev.event == "gap":
                    self._again()
                elif isinstance(ev.data, dict):
                    self._put(ev.data)
        except RpcError:
            return None
        return None
