"""A turn reaches a worker only once its claim is durable.

A session claims a message by queueing ``start_turn`` with the store, which commits it
a moment later (group commit). If that commit fails (a full disk, the write lock held
by another process) and the host then dies, the message is still ``pending`` in the
store and a restart runs it again: work that ran twice. ``ClaimGate`` wraps the backend
and holds each turn until the store says its claim is committed, so that can never
happen: a claim the store cannot commit leaves a turn that never ran.

While a turn is held here it is "waiting for a worker", exactly as one queued in the
backend: signals are kept in ``job.pending`` (they ride in its start frame), a freeze
holds it back, a kill ends it at once (there is no process to kill), and
``dispatched`` is False.
"""

from __future__ import annotations

import threading

import structlog

from tether.actors.ports import TurnJob
from tether.runtime.backend import Backend
from tether.runtime.store import Store
from tether.wire.errors import TetherError
from tether.wire.frames import HostFrame

__all__ = ["ClaimGate"]

log = structlog.get_logger("tether.claims")


class ClaimGate:
    """The sessions' executor: the backend, behind the durability of each claim."""

    def __init__(self, backend: Backend, store: Store) -> None:
        self._backend = backend
        self._store = store
        # Held turns, and the hand-over to the backend: under one lock, so a kill or a
        # frame reaches the turn either here or in the backend, never neither.
        self._lock = threading.Lock()
        self._held: dict[str, TurnJob] = {}

    def submit(self, job: TurnJob) -> None:
        claim = job.claim
        if claim is None:
            self._backend.submit(job)
            return
        with self._lock:
            self._held[job.turn] = job
        claim.then(lambda error: self._claimed(job.turn, error))

    def _claimed(self, turn: str, error: BaseException | None) -> None:
        """The claim's commit is settled (on the committing thread)."""
        with self._lock:
            job = self._held.get(turn)
            if job is None:
                return  # killed while its claim was on its way
            if error is not None:
                # Never durable: the turn must not run (a restart would run its message
                # again). It stays held, as a turn waiting for a worker, until stopped.
                log.error("turn.held", session=job.session, turn=turn, why=str(error))
                return
            del self._held[turn]
            try:
                self._backend.submit(job)  # under the lock: see __init__
                return
            except TetherError as exc:  # closed meanwhile
                why = exc.message
        job.sink.ended(turn, None, why)

    def signal(self, turn: str, frame: HostFrame) -> None:
        with self._lock:
            job = self._held.get(turn)
            if job is None:
                self._backend.signal(turn, frame)
            else:
                job.hold(frame)  # bounded as in the backend: a held turn waits as one

    def kill(self, turn: str) -> None:
        with self._lock:
            job = self._held.pop(turn, None)
            if job is None:
                self._backend.kill(turn)
                return
        job.sink.ended(turn, None, "killed before a worker took it")

    def freeze(self, turn: str) -> None:
        with self._lock:
            job = self._held.get(turn)
            if job is None:
                self._backend.freeze(turn)
            else:
                job.frozen = True

    def thaw(self, turn: str) -> None:
        with self._lock:
            job = self._held.get(turn)
            if job is None:
                self._backend.thaw(turn)
            else:
                job.frozen = False

    def accepting(self) -> bool:
        """No new claims once the runtime drains, or once the store has failed."""
        return self._backend.accepting() and not self._store.failed

    def dispatched(self, turn: str) -> bool:
        return turn not in self._held and self._backend.dispatched(turn)

    def disposed(self, sessions: list[str]) -> None:
        self._backend.disposed(sessions)
