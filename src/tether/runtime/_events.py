"""The runtime's event bus: events for subscribers, and state changes for ``wait()``.

The session hosts emit through it (it is their ``EventSink``); ``Runtime.subscribe``
adds a callback and ``Runtime.wait`` watches the state events' version counter.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from tether.wire.records import Event

__all__ = ["EventBus"]

log = structlog.get_logger("tether.runtime")  # the runtime's logger, shared by its modules

_WAIT_SLICE = 3600.0  # a wait longer than a lock's timeout can hold is taken in slices


class EventBus:
    """Events for subscribers, and state changes for ``wait()`` (the agents' EventSink)."""

    def __init__(self) -> None:
        self.subscribers: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._version = 0  # bumped by every state event while someone waits
        self._waiters = 0

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        with self._lock:
            self.subscribers = [*self.subscribers, callback]

        def unsubscribe() -> None:
            with self._lock:
                self.subscribers = [s for s in self.subscribers if s is not callback]

        return unsubscribe

    def wants(self, name: str) -> bool:
        return bool(self.subscribers) or (name == "state" and self._waiters > 0)

    def emit(self, name: str, session: str, lineage: tuple[str, ...], data: dict[str, Any]) -> None:
        subscribers = self.subscribers
        if subscribers:
            event = Event(name=name, session=session, lineage=lineage, data=data, ts=time.time())
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:  # an observer's bug must not break the agent that emitted
                    log.exception("events.subscriber_failed", event=name)
        if name == "state" and self._waiters:
            with self._changed:
                self._version += 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Count every state event while inside: enter before the first look at a
        session's state, so that no change can slip past unseen."""
        with self._changed:
            self._waiters += 1
        try:
            yield
        finally:
            with self._changed:
                self._waiters -= 1

    def seen(self) -> int:
        """The state events' version now: the mark ``changed_since`` waits past."""
        with self._changed:
            return self._version

    def changed_since(self, seen: int, deadline: float) -> bool:
        """Block until a state event comes after the mark ``seen``; False once the
        ``time.monotonic()`` deadline passes without one."""
        with self._changed:
            while self._version == seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, _WAIT_SLICE))
        return True
