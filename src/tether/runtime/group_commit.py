"""The group-commit engine: writes queued by many threads, committed in batches, in
queue order, by one committer at a time (the writer thread or a waiting caller).

Its contract, in short: ops commit in submission order; every ticket is settled once
(committed, or refused with ``StoreUnavailable``), its ``then`` callbacks after the
commit; a failed batch is rolled back and retried first in line, its sends refused at
once and never committed, the rest refused only once the engine has failed. The whole
of it, and the threads and locks: docs/design.md, section 8.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from tether.wire.errors import StoreUnavailable

__all__ = ["WAL_LIMIT", "GroupCommit", "Op", "Statement", "Ticket", "configure"]

log = structlog.get_logger("tether.store")

WAL_LIMIT = 64 * 1024 * 1024  # bytes: past this the writer truncates the WAL
_CHECKPOINT_EVERY = 0.5  # seconds between background passive WAL checkpoints
_WAL_CHECK_EVERY = 0.25  # seconds between looks at the WAL's size ...
_WAL_CHECK_OPS = 64  # ... or writes, whichever comes first
_LINGER = 0.0005  # seconds the writer thread waits before committing what it was woken for
_RETRY_FIRST = 0.05  # seconds before the first retry of a failed batch ...
_RETRY_MAX = 2.0  # ... doubling up to this
_GIVE_UP = 60.0  # seconds a batch may keep failing before the store fails for good
_BUSY_MS = 5000  # how long a (patient) committer waits for another connection's lock

Op = Callable[[sqlite3.Connection], object]


class Statement:
    """A write that is one SQL statement: alone in its batch, it needs no BEGIN/COMMIT
    (SQLite commits a lone statement by itself), which saves two round trips through
    SQLite, and two hand-backs of the GIL, on a lone durable send."""

    __slots__ = ("params", "sql")

    def __init__(self, sql: str, params: tuple[Any, ...]) -> None:
        self.sql = sql
        self.params = params

    def __call__(self, db: sqlite3.Connection) -> object:
        return db.execute(self.sql, self.params)


def configure(db: sqlite3.Connection, path: str | None, durability: str, wal_limit: int) -> None:
    """Set the connection up for this engine (before the schema is written)."""
    if path is not None:
        # Small pages: a commit appends every page it touched to the WAL, and a turn
        # boundary touches a few pages to write a few hundred bytes.
        db.execute("PRAGMA page_size=1024")
        db.execute("PRAGMA journal_mode=WAL")
        # Checkpoints move off the committers to a connection of their own, except
        # the truncating one that bounds the WAL (see _maybe_truncate).
        db.execute("PRAGMA wal_autocheckpoint=0")
        db.execute(f"PRAGMA journal_size_limit={wal_limit}")
        db.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
    sync = "FULL" if durability == "full" else "NORMAL"
    db.execute(f"PRAGMA synchronous={sync}")


def _busy(error: BaseException) -> bool:
    """``error`` is SQLite's: another connection holds the lock."""
    return isinstance(error, sqlite3.OperationalError) and error.sqlite_errorcode in (
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
    )


class Ticket:
    """One write (or a few written together): done once committed, or once refused.

    ``refusable``: the write is a send's message, which nothing else depends on until
    the send returns; while the store is down it is withdrawn and its caller refused,
    rather than kept for a retry the caller would never hear about.
    """

    __slots__ = ("_callbacks", "_done", "_engine", "_waiter", "error", "refusable", "withdrawn")

    def __init__(self, engine: GroupCommit, *, refusable: bool = False) -> None:
        self._engine = engine
        # Done: set once, under the engine's ``_tickets`` lock, after ``error``. The
        # event is made only for a caller that must block (another thread commits its
        # write); most callers commit their own write and never need one.
        self._done = False
        self._waiter: threading.Event | None = None
        self._callbacks: list[Callable[[BaseException | None], None]] | None = None
        self.error: BaseException | None = None
        self.refusable = refusable
        self.withdrawn = False

    def set(self, error: BaseException | None = None) -> None:
        with self._engine._tickets:
            if self._done:
                return
            self.error = error
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
            waiter = self._waiter
        if waiter is not None:
            waiter.set()
        for fn in callbacks or ():
            try:
                fn(error)
            except Exception:  # a callback's bug must not stop the committer
                log.exception("store.callback_failed")

    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` once the ticket is done (at once if it is), on the thread
        that finished it; ``error`` is None once the write is committed."""
        with self._engine._tickets:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self.error)

    @property
    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> None:
        """Return once the write is durable (committing it here if nobody is); raise
        ``StoreUnavailable`` if it was refused."""
        if not self._done:
            self._engine.commit(self)
        if not self._done:
            with self._engine._tickets:
                if not self._done and self._waiter is None:
                    self._waiter = threading.Event()
                waiter = None if self._done else self._waiter
            if waiter is not None and not waiter.wait(timeout):
                raise TimeoutError("the store did not commit in time")
        if self.error is not None:
            raise self.error


class _Entry:
    __slots__ = ("op", "ticket")

    def __init__(self, op: Op, ticket: Ticket | None) -> None:
        self.op = op
        self.ticket = ticket


class GroupCommit:
    """The write queue of one connection, its writer thread and (for a file) its WAL's
    checkpoints. ``probe``: a write that changes nothing, committed to learn whether the
    store can commit again after a fault whose batch was all withdrawn sends (it should
    touch a page, so that a full disk shows)."""

    def __init__(
        self,
        db: sqlite3.Connection,
        path: str | None,
        *,
        probe: Op,
        wal_limit: int = WAL_LIMIT,
        give_up: float | None = None,
        on_due: Callable[[], None] | None = None,
    ) -> None:
        self._db = db
        # Called under ``queue_lock`` on the writer thread once the time ``due_locked``
        # set has come: the owner queues what it held back until then.
        self._on_due = on_due
        self._due: float | None = None
        self._path = path
        self._probe = probe
        self._wal_limit = wal_limit
        self._give_up = _GIVE_UP if give_up is None else give_up
        self.lock = threading.Lock()  # the connection: one commit or one read at a time
        # The queue; a caller numbering its writes (keys, seqs) does so under it, with
        # ``submit_locked``, so that the numbers follow queue order.
        self.queue_mutex = threading.Lock()
        # Its condition, for the writer's waits and wake-ups; a holder that neither waits
        # nor notifies takes ``queue_mutex`` itself (a Condition's ``with`` is two more
        # Python calls, on every write of every turn).
        self.queue_lock = threading.Condition(self.queue_mutex)
        self._commit_lock = threading.Lock()  # committers take turns: batches stay in order
        self._tickets = threading.Lock()  # tickets' done flags and callbacks
        self._queue: list[_Entry] = []
        self._backlog: list[_Entry] = []  # a failed batch, first in line for the retry
        self._down: float | None = None  # when the current fault began (monotonic)
        self._fault = ""  # what the last failed commit said
        self._failed = False  # a batch failed for longer than give_up: no more sends
        self._retry_at = 0.0
        self._backoff = _RETRY_FIRST
        self._stopping = False
        self._wake_pending = False  # the writer thread was told of writes nobody waits for
        self._urgent = False  # a turn waits for what is queued: commit without lingering
        self._wal_checked = 0.0
        self._unchecked = 0
        # Threads that commit their own writes (``own_writes``): a write they queue sets
        # their ``dirty`` instead of waking the writer thread.
        self._own = threading.local()
        self._handoff = False  # an owning thread left its writes to the current committer
        self._writer = threading.Thread(target=self._write_loop, name="tether-store", daemon=True)
        self._writer.start()
        self._stop_checkpoints = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if path is not None:
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop, args=(path,), name="tether-checkpoint", daemon=True
            )
            self._checkpointer.start()

    @property
    def failed(self) -> bool:
        """True once a batch could not be committed for ``give_up`` seconds."""
        return self._failed

    @property
    def down(self) -> bool:
        """True while the last batch tried failed (the writer retries it)."""
        return self._down is not None

    def check_writable(self) -> None:
        """Raise ``StoreUnavailable`` while the store is down or has failed: a caller
        about to change something durable is refused before anything changes."""
        if self._down is not None or self._failed:
            raise self._unavailable()

    def _unavailable(self) -> StoreUnavailable:
        if self._failed:
            return StoreUnavailable(f"the store has failed and takes no more work: {self._fault}")
        return StoreUnavailable(f"the store cannot commit now: {self._fault}")

    def submit(
        self, op: Op, *, refusable: bool = False, waited: bool = False, urgent: bool = False
    ) -> Ticket:
        """Queue one write; the returned ticket is done once it is committed.

        ``waited``: the caller will wait on the ticket (and so commit it), so the writer
        thread need not be woken for it. ``urgent``: something waits for it (a turn's
        dispatch), so the writer does not linger.
        """
        t = Ticket(self, refusable=refusable)
        with self.queue_mutex:
            self.submit_locked(op, t, waited, urgent)
        return t

    def submit_locked(
        self, op: Op, ticket: Ticket | None, waited: bool = False, urgent: bool = False
    ) -> None:
        """``submit`` for a caller that holds ``queue_lock`` (``ticket`` None: a write
        nobody waits for)."""
        if self._stopping:
            raise RuntimeError("the store is closed")
        self._queue.append(_Entry(op, ticket))
        if urgent:
            self._urgent = True
        if not waited and not self._wake_pending:
            own = self._own
            if getattr(own, "on", False):
                own.dirty = True  # committed by ``commit_own`` on this thread
                return
            self._wake_pending = True  # one wake-up for however many writes queue meanwhile
            self.queue_lock.notify()

    def own_writes(self) -> None:
        """From now on, the calling thread commits the writes it queues itself, when it
        calls ``commit_own``, instead of waking the writer thread for them. For an actor
        that queues a few writes per message: it commits once its mailbox runs dry,
        without the wake-up of another thread (and the hand-over of the GIL) per write.
        """
        self._own.on = True
        self._own.dirty = False

    def commit_own(self) -> None:
        """Commit what this thread queued since its last call, here. When another
        commit is under way, its committer takes these writes too before it lets go
        (no thread is woken for them); while the store is down, the writer's retry
        does."""
        own = self._own
        if not getattr(own, "dirty", False) or self._stopping:
            return  # nothing queued, or ``close`` commits it
        own.dirty = False
        if self._down is not None:
            return  # the writer thread's retry takes the backlog and the queue
        if not self._commit_lock.acquire(blocking=False):
            self._handoff = True
            # The committer may have let go before it saw the flag: try once more.
            if not self._commit_lock.acquire(blocking=False):
                return  # it, or whoever holds the lock now, sees the flag
        try:
            self._attempt(patient=False)  # a failure is kept for the writer's retry
        finally:
            self._release(patient=False)

    def _release(self, *, patient: bool = True) -> None:
        """Let go of the commit lock, first committing what a thread handed over
        meanwhile (``commit_own``)."""
        while self._handoff and self._down is None:
            self._handoff = False
            self._attempt(patient=patient)
        self._commit_lock.release()

    def due_locked(self, when: float) -> None:
        """Call ``on_due`` at ``when`` (monotonic) or soon after, unless an earlier time
        is set already (under ``queue_lock``)."""
        if self._due is None or when < self._due:
            self._due = when
            self.queue_lock.notify()  # the writer's wait takes the deadline

    def flush(self) -> None:
        """Commit everything queued so far (a reader sees every earlier write);
        ``StoreUnavailable`` if the store cannot."""
        self.commit(None)

    def commit(self, ticket: Ticket | None) -> None:
        """Commit the queue in this thread, unless ``ticket`` is done meanwhile.

        While the store is down no caller tries again (the writer thread retries, with
        backoff): a refusable ticket is withdrawn and refused, any other waits for the
        retry, and a flush raises ``StoreUnavailable``.
        """
        self._commit_lock.acquire()
        try:
            if ticket is not None and ticket.done:
                return  # another committer took it while we waited for our turn
            if self._down is not None:
                if ticket is None:
                    raise self._unavailable()
                if ticket.refusable:
                    ticket.withdrawn = True  # skipped by every later batch
                    ticket.set(self._unavailable())
                elif self._failed:
                    ticket.set(self._unavailable())
                return
            error = self._attempt()
        finally:
            self._release()
        if error is not None and ticket is None:
            raise error

    def _attempt(self, *, patient: bool = True) -> StoreUnavailable | None:
        """Commit the backlog and the queue as one batch (the caller holds the commit
        lock); on failure keep it, in order, for the writer's retry.

        Not ``patient`` (a host's own commit): it never waits for another connection's
        write lock; a batch that finds it held goes back, first in line, to the writer
        thread, which waits for the lock as every other committer does."""
        with self.queue_mutex:
            entries = self._backlog + self._queue if self._backlog else self._queue
            self._backlog = []
            self._queue = []
            self._wake_pending = False
            self._urgent = False
        batch = [e for e in entries if e.ticket is None or not e.ticket.withdrawn]
        if not batch and self._down is None:
            return None
        ops = [e.op for e in batch] or [self._probe]
        error = self._commit(ops, patient)
        if error is not None:
            if not patient and _busy(error):
                self._hand_back(batch)
                return None
            return self._failed_batch(batch, error)
        if self._down is not None:
            log.warning(
                "store.recovered", after=round(time.monotonic() - self._down, 3), ops=len(batch)
            )
            self._down = None
            self._backoff = _RETRY_FIRST
        for e in batch:
            if e.ticket is not None:
                e.ticket.set()
        self._maybe_truncate(len(batch), patient)
        return None

    def _hand_back(self, batch: list[_Entry]) -> None:
        """An impatient commit found the store locked: its batch, first in line (no
        other committer ran meanwhile: this one holds the commit lock), to the writer."""
        with self.queue_lock:
            self._backlog = batch
            self._urgent = True  # it may hold a claim a turn waits for
            self._wake_pending = True
            self.queue_lock.notify()

    def _failed_batch(self, batch: list[_Entry], error: BaseException) -> StoreUnavailable:
        now = time.monotonic()
        first = self._down is None
        since = now if self._down is None else self._down
        if first:
            self._down = now
            self._backoff = _RETRY_FIRST
        self._fault = str(error) or type(error).__name__
        refused = self._unavailable()
        keep: list[_Entry] = []
        for e in batch:
            t = e.ticket
            if t is not None and t.refusable:
                t.withdrawn = True  # a send: refused now, so never committed later
                t.set(refused)
            else:
                keep.append(e)
        with self.queue_lock:
            self._backlog = keep  # older than anything queued meanwhile: first in line
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, _RETRY_MAX)
            self.queue_lock.notify()
        level = log.error if first else log.warning
        level("store.commit_failed", ops=len(batch), kept=len(keep), error=self._fault)
        if not self._failed and now - since >= self._give_up:
            self._fail()
        return refused

    def _fail(self) -> None:
        self._failed = True
        with self.queue_lock:
            waiting = [e.ticket for e in self._backlog + self._queue if e.ticket is not None]
            ops = len(self._backlog) + len(self._queue)
        log.error(
            "store.failed",
            error=self._fault,
            ops=ops,
            why=f"no commit for {self._give_up:g} s: every later send is refused",
        )
        refused = self._unavailable()
        for t in waiting:
            t.set(refused)

    def _write_loop(self) -> None:
        """Commit what nobody waits for, woken once for however many such writes queue
        before a commit takes them; retry a failed batch when its backoff is over."""
        while True:
            with self.queue_lock:
                while not self._stopping:
                    if self._down is not None:
                        left = self._retry_at - time.monotonic()
                        if left <= 0:
                            break
                        self.queue_lock.wait(left)
                    elif self._wake_pending:
                        break
                    elif self._due is not None and self._on_due is not None:
                        left = self._due - time.monotonic()
                        if left <= 0:
                            self._due = None
                            self._on_due()  # it queues with submit_locked: loop again
                        else:
                            self.queue_lock.wait(left)
                    else:
                        self.queue_lock.wait()
                if self._stopping:
                    return
                linger = self._down is None and not self._urgent
            # Linger: writes queued together (a turn's end and its notice) share a
            # commit, and a caller about to wait commits its own write without a hop.
            if linger:
                time.sleep(_LINGER)
            self._commit_lock.acquire()
            try:
                self._attempt()
            finally:
                self._release()

    def _commit(self, batch: list[Op], patient: bool = True) -> BaseException | None:
        with self.lock:
            if patient or self._path is None:  # the usual commit: no context manager
                return self._transaction(batch)
            with self._waiting(patient):
                return self._transaction(batch)

    def _transaction(self, batch: list[Op]) -> BaseException | None:
        """Run ``batch`` as one transaction (under ``lock``); its error, rolled back."""
        try:
            if len(batch) == 1 and isinstance(batch[0], Statement):
                batch[0](self._db)  # autocommit: one statement is its own transaction
                return None
            self._db.execute("BEGIN")
            for op in batch:
                op(self._db)
            self._db.execute("COMMIT")
            return None
        except BaseException as exc:  # a failed batch is kept for a retry
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            return exc

    @contextlib.contextmanager
    def _waiting(self, patient: bool) -> Iterator[None]:
        """SQLite's busy wait, off for an impatient committer (under ``lock``)."""
        if patient or self._path is None:
            yield
            return
        self._db.execute("PRAGMA busy_timeout=0")
        try:
            yield
        finally:
            self._db.execute(f"PRAGMA busy_timeout={_BUSY_MS}")

    def _maybe_truncate(self, ops: int, patient: bool = True) -> None:
        """Look at the WAL's size every so many writes (or so often): cheap, and soon
        enough that it never runs far past the limit."""
        self._unchecked += ops
        now = time.monotonic()
        if self._path is None or (
            self._unchecked < _WAL_CHECK_OPS and now - self._wal_checked < _WAL_CHECK_EVERY
        ):
            return
        self._wal_checked = now
        self._unchecked = 0
        try:
            size = os.path.getsize(self._path + "-wal")
        except OSError:
            return
        if size > self._wal_limit:
            with self.lock, self._waiting(patient), contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                log.info("store.wal_truncated", bytes=size)

    def _checkpoint_loop(self, path: str) -> None:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            while not self._stop_checkpoints.wait(_CHECKPOINT_EVERY):
                with contextlib.suppress(sqlite3.Error):
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            db.close()

    def _stop_checkpointer(self) -> None:
        self._stop_checkpoints.set()
        if self._checkpointer is not None:
            self._checkpointer.join()

    def close(self) -> None:
        """Stop the writer, commit what was accepted (the last try, down or not), and
        close the connection (a file's WAL truncated)."""
        with self.queue_lock:
            self._stopping = True
            self.queue_lock.notify()
        self._writer.join()
        with self._commit_lock:
            error = self._attempt()  # the last try, down or not
        if error is not None:
            # Nothing more can be done in this process: say loudly what is lost.
            log.error("store.closed_unsaved", ops=len(self._backlog), error=self._fault)
        self._stop_checkpointer()
        with self.lock:
            if self._path is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
