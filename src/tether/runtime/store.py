"""The durable store: SQLite in WAL mode, with group commit, one host per store.

How writes are queued and committed, what a failed commit does, the WAL's bound and the
store's lock: docs/design.md, section 8; recovery at start: section 9.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import structlog

from tether.actors.budget import Spent
from tether.actors.ports import ParentNotice
from tether.wire.budget import Budget
from tether.wire.errors import StoreLocked, StoreUnavailable
from tether.wire.records import (
    Entry,
    Message,
    PendingMessage,
    SessionHeader,
    StopReport,
    TurnRecord,
    message_key,
)

__all__ = ["MAX_PAGE", "Store", "Ticket"]

log = structlog.get_logger("tether.store")

# Rows are never deleted, so plain INTEGER PRIMARY KEYs only grow (AUTOINCREMENT would
# cost an extra write per insert for a guarantee we do not need).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key         TEXT PRIMARY KEY,
    value       INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS sessions (
    seq         INTEGER PRIMARY KEY,
    id          TEXT NOT NULL UNIQUE,
    parent      TEXT,
    mode        TEXT NOT NULL,
    slug        TEXT,
    driver      TEXT NOT NULL,
    config      BLOB,
    permissions BLOB,
    created_at  REAL NOT NULL,
    settled     INTEGER NOT NULL DEFAULT 0,
    stall       BLOB,
    limits      BLOB,
    disposing   INTEGER NOT NULL DEFAULT 0,  -- a disposal was accepted (see finish_disposals)
    budget      BLOB                         -- the session's own budget (semantics §16.2)
);
CREATE TABLE IF NOT EXISTS messages (
    id          INTEGER PRIMARY KEY,
    session     TEXT NOT NULL,
    content     TEXT NOT NULL,
    data        BLOB,
    kind        TEXT NOT NULL,
    sender      TEXT,
    created_at  REAL NOT NULL,
    state       TEXT NOT NULL DEFAULT 'pending',   -- pending | claimed | closed
    turn        TEXT,
    trace       TEXT               -- the sending span's traceparent (telemetry on)
);
CREATE INDEX IF NOT EXISTS messages_pending ON messages (session, id) WHERE state='pending';
CREATE TABLE IF NOT EXISTS turns (
    seq         INTEGER PRIMARY KEY,
    id          TEXT NOT NULL,   -- random and never looked up alone: no index to maintain
    session     TEXT NOT NULL,
    message_id  INTEGER NOT NULL,
    started_at  REAL NOT NULL,
    ended_at    REAL,
    outcome     TEXT,
    cause       TEXT,
    by          TEXT,
    forced      INTEGER NOT NULL DEFAULT 0,
    escalated   INTEGER NOT NULL DEFAULT 0,
    reason      TEXT,
    error       TEXT,
    usage       BLOB,
    resources   BLOB,
    woken_by    INTEGER            -- the key of the message whose waking send started it
);
CREATE INDEX IF NOT EXISTS turns_session ON turns (session, seq);
CREATE TABLE IF NOT EXISTS entries (
    seq         INTEGER PRIMARY KEY,
    session     TEXT NOT NULL,
    turn        TEXT,
    kind        TEXT NOT NULL,
    text        TEXT NOT NULL,
    action      TEXT,
    origin      TEXT,
    by          TEXT,
    reason      TEXT,
    data        BLOB,
    created_at  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_session ON entries (session, seq);
CREATE TABLE IF NOT EXISTS stop_reports (
    turn        TEXT PRIMARY KEY,
    session     TEXT NOT NULL,
    report      BLOB NOT NULL    -- a StopReport, JSON
);
"""

MAX_PAGE = 1000  # entries one read returns at most
_CHECKPOINT_EVERY = 0.5  # seconds between background passive WAL checkpoints
_WAL_LIMIT = 64 * 1024 * 1024  # bytes: past this the writer truncates the WAL
_PREVIEW = 200
_WAL_CHECK_EVERY = 0.25  # seconds between looks at the WAL's size ...
_WAL_CHECK_OPS = 64  # ... or writes, whichever comes first
_LINGER = 0.0005  # seconds the writer thread waits before committing what it was woken for
_USAGE_EVERY = 1.0  # seconds a running turn's reported usage may wait for its write
_RETRY_FIRST = 0.05  # seconds before the first retry of a failed batch ...
_RETRY_MAX = 2.0  # ... doubling up to this
_GIVE_UP = 60.0  # seconds a batch may keep failing before the store fails for good

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(dict[str, Any])


class _Statement:
    """A write that is one SQL statement: alone in its batch, it needs no BEGIN/COMMIT
    (SQLite commits a lone statement by itself), which saves two round trips through
    SQLite, and two hand-backs of the GIL, on a lone durable send."""

    __slots__ = ("params", "sql")

    def __init__(self, sql: str, params: tuple[Any, ...]) -> None:
        self.sql = sql
        self.params = params

    def __call__(self, db: sqlite3.Connection) -> object:
        return db.execute(self.sql, self.params)


Op = Callable[[sqlite3.Connection], object]


def _dump(value: dict[str, Any] | None) -> bytes | None:
    return None if value is None else _enc.encode(value)


def _load(blob: bytes | None) -> dict[str, Any] | None:
    return None if blob is None else _dec.decode(blob)


class _UsageFlush:
    """The running turns' usage writes held so far, taken (and encoded) when the batch
    runs (kept for a retry of the same batch)."""

    __slots__ = ("_rows", "_store")

    def __init__(self, store: Store) -> None:
        self._store = store
        self._rows: list[tuple[bytes | None, int]] | None = None

    def __call__(self, db: sqlite3.Connection) -> object:
        if self._rows is None:
            self._rows = self._store._usage_rows()
        return db.executemany("UPDATE turns SET usage=? WHERE seq=?", self._rows)


class Ticket:
    """One write (or a few written together): done once committed, or once refused.

    ``refusable``: the write is a send's message, which nothing else depends on until
    the send returns; while the store is down it is withdrawn and its caller refused,
    rather than kept for a retry the caller would never hear about.
    """

    __slots__ = ("_callbacks", "_done", "_store", "_waiter", "error", "refusable", "withdrawn")

    def __init__(self, store: Store, *, refusable: bool = False) -> None:
        self._store = store
        # Done: set once, under the store's ``_tickets`` lock, after ``error``. The
        # event is made only for a caller that must block (another thread commits its
        # write); most callers commit their own write and never need one.
        self._done = False
        self._waiter: threading.Event | None = None
        self._callbacks: list[Callable[[BaseException | None], None]] | None = None
        self.error: BaseException | None = None
        self.refusable = refusable
        self.withdrawn = False

    def set(self, error: BaseException | None = None) -> None:
        with self._store._tickets:
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
        with self._store._tickets:
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
            self._store.commit(self)
        if not self._done:
            with self._store._tickets:
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


def _probe(db: sqlite3.Connection) -> None:
    """A write that changes nothing: whether the store can commit again after a fault
    whose batch was all withdrawn sends (it touches a page, so a full disk shows)."""
    db.execute("UPDATE meta SET value = value WHERE key = 'boots'")


def _lock(path: str) -> int:
    """Take the store's host lock (see the module doc); the open descriptor holds it."""
    lock_path = path + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = b""
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            # The holder writes its pid just after it locks: give it a moment.
            for _ in range(50):
                holder = os.pread(fd, 32, 0).strip()
                if holder:
                    break
                time.sleep(0.002)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StoreUnavailable(f"cannot lock the store {path}: {exc.strerror}") from None
        pid = holder.decode(errors="replace") or "unknown"
        raise StoreLocked(
            f"the store {path} is in use by a live host (pid {pid}); one host at a time"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class Store:
    """Catalog, inboxes with claim state, turn records and transcripts."""

    def __init__(
        self,
        path: str | None = None,
        *,
        durability: str = "normal",
        wal_limit: int = _WAL_LIMIT,
        give_up: float | None = None,
    ) -> None:
        self.path = path
        self._wal_limit = wal_limit
        self._give_up = _GIVE_UP if give_up is None else give_up
        self._lock_fd = None if path is None else _lock(path)
        try:
            self._db = sqlite3.connect(
                path or ":memory:", check_same_thread=False, isolation_level=None
            )
            self._open_db(path, durability, wal_limit)
            self._next_key = self._max("messages", "id") + 1  # the next message's key
            self._entry_seqs = itertools.count(self._max("entries", "seq") + 1)
            # Turns up to here are earlier hosts' (all ended once recovered): see spent_before
            self._first_turn = self._max("turns", "seq") + 1
            self._turn_seqs = itertools.count(self._first_turn)
        except sqlite3.Error as exc:
            self._unlock()
            raise StoreUnavailable(f"cannot open the store: {exc}") from None
        except BaseException:
            self._unlock()
            raise
        self._lock = threading.Lock()  # the connection: one commit or one read at a time
        self._commit_lock = threading.Lock()  # committers take turns: batches stay in order
        self._cond = threading.Condition(threading.Lock())  # the queue
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
        self._open: dict[str, tuple[str, int]] = {}  # turn -> (session, row) until it ends
        self._usage: dict[int, dict[str, int]] = {}  # row -> a running turn's usage so far
        self._usage_queued = False  # a _UsageFlush is queued: it takes what is held
        self._usage_due: float | None = None  # when held usage must be queued (monotonic)
        self._writer = threading.Thread(target=self._write_loop, name="tether-store", daemon=True)
        self._writer.start()
        self._stop_checkpoints = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if path is not None:
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop, args=(path,), name="tether-checkpoint", daemon=True
            )
            self._checkpointer.start()

    def _open_db(self, path: str | None, durability: str, wal_limit: int) -> None:
        if path is not None:
            # Small pages: a commit appends every page it touched to the WAL, and a turn
            # boundary touches a few pages to write a few hundred bytes.
            self._db.execute("PRAGMA page_size=1024")
            self._db.execute("PRAGMA journal_mode=WAL")
            # Checkpoints move off the committers to a connection of their own, except
            # the truncating one that bounds the WAL (see _maybe_truncate).
            self._db.execute("PRAGMA wal_autocheckpoint=0")
            self._db.execute(f"PRAGMA journal_size_limit={wal_limit}")
            self._db.execute("PRAGMA busy_timeout=5000")
        sync = "FULL" if durability == "full" else "NORMAL"
        self._db.execute(f"PRAGMA synchronous={sync}")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(sessions)")}
        if "stall" not in columns:  # a store written before the stall watchdog
            self._db.execute("ALTER TABLE sessions ADD COLUMN stall BLOB")
        if "limits" not in columns:  # a store written before v3's limits
            self._db.execute("ALTER TABLE sessions ADD COLUMN limits BLOB")
        if "disposing" not in columns:  # a store written before round 4
            self._db.execute("ALTER TABLE sessions ADD COLUMN disposing INTEGER NOT NULL DEFAULT 0")
        if "budget" not in columns:  # a store written before v4's budgets
            self._db.execute("ALTER TABLE sessions ADD COLUMN budget BLOB")
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(messages)")}
        if "trace" not in columns:  # a store written before telemetry
            self._db.execute("ALTER TABLE messages ADD COLUMN trace TEXT")
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(turns)")}
        for column, kind in (("usage", "BLOB"), ("resources", "BLOB"), ("woken_by", "INTEGER")):
            if column not in columns:  # a store written before v3
                self._db.execute(f"ALTER TABLE turns ADD COLUMN {column} {kind}")

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor drops the flock
            self._lock_fd = None

    def _max(self, table: str, column: str) -> int:
        (n,) = self._db.execute(f"SELECT COALESCE(MAX({column}), 0) FROM {table}").fetchone()
        return int(n)

    # ---- committing -----------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """True once a batch could not be committed for ``give_up`` seconds."""
        return self._failed

    def check_writable(self) -> None:
        """Raise ``StoreUnavailable`` while the store is down or has failed: a caller
        about to change something durable is refused before anything changes."""
        if self._down is not None or self._failed:
            raise self._unavailable()

    def _unavailable(self) -> StoreUnavailable:
        if self._failed:
            return StoreUnavailable(f"the store has failed and takes no more work: {self._fault}")
        return StoreUnavailable(f"the store cannot commit now: {self._fault}")

    def submit(self, op: Op, *, waited: bool = False, urgent: bool = False) -> Ticket:
        """Queue one write; the returned ticket is done once it is committed.

        ``waited``: the caller will wait on the ticket (and so commit it), so the writer
        thread need not be woken for it. ``urgent``: something waits for it (a turn's
        dispatch), so the writer does not linger.
        """
        t = Ticket(self)
        with self._cond:
            self._submit_locked(op, t, waited, urgent)
        return t

    def _queue_op(self, op: Op) -> None:
        """Queue a write nobody waits for."""
        with self._cond:
            self._submit_locked(op, None)

    def _submit_locked(
        self, op: Op, ticket: Ticket | None, waited: bool = False, urgent: bool = False
    ) -> None:
        if self._stopping:
            raise RuntimeError("the store is closed")
        self._queue.append(_Entry(op, ticket))
        if urgent:
            self._urgent = True
        if not waited and not self._wake_pending:
            self._wake_pending = True  # one wake-up for however many writes queue meanwhile
            self._cond.notify()

    def flush(self) -> None:
        """Commit everything queued so far, running turns' usage included (a reader sees
        every earlier write); ``StoreUnavailable`` if the store cannot."""
        with self._cond:
            self._queue_usage_locked()
        self.commit(None)

    def commit(self, ticket: Ticket | None) -> None:
        """Commit the queue in this thread, unless ``ticket`` is done meanwhile.

        While the store is down no caller tries again (the writer thread retries, with
        backoff): a refusable ticket is withdrawn and refused, any other waits for the
        retry, and a flush raises ``StoreUnavailable``.
        """
        with self._commit_lock:
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
        if error is not None and ticket is None:
            raise error

    def _attempt(self) -> StoreUnavailable | None:
        """Commit the backlog and the queue as one batch (the caller holds the commit
        lock); on failure keep it, in order, for the writer's retry."""
        with self._cond:
            entries = self._backlog + self._queue if self._backlog else self._queue
            self._backlog = []
            self._queue = []
            self._wake_pending = False
            self._urgent = False
        batch = [e for e in entries if e.ticket is None or not e.ticket.withdrawn]
        if not batch and self._down is None:
            return None
        ops = [e.op for e in batch] or [_probe]
        error = self._commit(ops)
        if error is not None:
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
        self._maybe_truncate(len(batch))
        return None

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
        with self._cond:
            self._backlog = keep  # older than anything queued meanwhile: first in line
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, _RETRY_MAX)
            self._cond.notify()
        level = log.error if first else log.warning
        level("store.commit_failed", ops=len(batch), kept=len(keep), error=self._fault)
        if not self._failed and now - since >= self._give_up:
            self._fail()
        return refused

    def _fail(self) -> None:
        self._failed = True
        with self._cond:
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
            with self._cond:
                while not self._stopping:
                    if self._down is not None:
                        left = self._retry_at - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    elif self._wake_pending:
                        break
                    elif self._usage_due is not None:
                        left = self._usage_due - time.monotonic()
                        if left <= 0:
                            self._queue_usage_locked()  # wakes no one: this is the writer
                            continue
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
                if self._stopping:
                    return
                linger = self._down is None and not self._urgent
            # Linger: writes queued together (a turn's end and its notice) share a
            # commit, and a caller about to wait commits its own write without a hop.
            if linger:
                time.sleep(_LINGER)
            with self._commit_lock:
                self._attempt()

    def _commit(self, batch: list[Op]) -> BaseException | None:
        with self._lock:
            try:
                if len(batch) == 1 and isinstance(batch[0], _Statement):
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

    def _maybe_truncate(self, ops: int) -> None:
        """Look at the WAL's size every so many writes (or so often): cheap, and soon
        enough that it never runs far past the limit."""
        self._unchecked += ops
        now = time.monotonic()
        if self.path is None or (
            self._unchecked < _WAL_CHECK_OPS and now - self._wal_checked < _WAL_CHECK_EVERY
        ):
            return
        self._wal_checked = now
        self._unchecked = 0
        try:
            size = os.path.getsize(self.path + "-wal")
        except OSError:
            return
        if size > self._wal_limit:
            with self._lock, contextlib.suppress(sqlite3.Error):
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

    def close(self) -> None:
        with self._cond:
            if not self._stopping:
                self._queue_usage_locked()  # running turns' usage held: the last write
            self._stopping = True
            self._cond.notify()
        self._writer.join()
        with self._commit_lock:
            error = self._attempt()  # the last try, down or not
        if error is not None:
            # Nothing more can be done in this process: say loudly what is lost.
            log.error("store.closed_unsaved", ops=len(self._backlog), error=self._fault)
        self._stop_checkpoints.set()
        if self._checkpointer is not None:
            self._checkpointer.join()
        with self._lock:
            if self.path is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
        self._unlock()

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        self.flush()
        with self._lock, _readable():
            return self._db.execute(sql, params).fetchall()

    # ---- boot and recovery ------------------------------------------------------------

    def boot(self) -> int:
        """Count this host process's start; epochs are built on it so they never repeat."""
        with self._lock, _readable():
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES ('boots', 1)"
                " ON CONFLICT(key) DO UPDATE SET value = value + 1"
            )
            (n,) = self._db.execute("SELECT value FROM meta WHERE key='boots'").fetchone()
        return int(n)

    def finish_disposals(self) -> list[str]:
        """Settle every session whose disposal was accepted (``dispose_accepted``) but
        not finished: its host was killed meanwhile. What the dead host had not done yet
        is what a finished disposal leaves: the inbox closed (its pending messages kept,
        marked closed), the session settled. A disposal marks the whole subtree in one
        commit, so its descendants are among these. Runs before the catalog is read and
        before ``recover``, which then closes their open turns as crashed (their parents
        told, unless settled). Returns the sessions settled."""
        with self._lock, _readable():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    "SELECT id FROM sessions WHERE disposing=1 AND settled=0 ORDER BY seq"
                ).fetchall()
                if rows:
                    self._db.execute(
                        "UPDATE messages SET state='closed' WHERE state='pending' AND session"
                        " IN (SELECT id FROM sessions WHERE disposing=1 AND settled=0)"
                    )
                    self._db.execute("UPDATE sessions SET settled=1 WHERE disposing=1")
                self._db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
        return [str(r[0]) for r in rows]

    def recover(
        self, notice: Callable[[str, str, str | None], ParentNotice | None] | None = None
    ) -> list[tuple[str, str, str | None]]:
        """Close every turn with no end record as ``crashed``, and write the parents'
        notices that ``notice(session, turn, last assistant text)`` composes, in one
        commit: a host killed during recovery leaves either both or neither, so no
        crashed turn is ever closed with its parent untold.

        Returns (session, turn, last assistant text) for each turn closed.
        """
        now = time.time()
        with self._lock, _readable():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute(
                    "SELECT id, session FROM turns WHERE outcome IS NULL ORDER BY seq"
                ).fetchall()
                out = []
                for turn, session in rows:
                    last = self._db.execute(
                        "SELECT text FROM entries WHERE session=? AND turn=?"
                        " AND kind='assistant' ORDER BY seq DESC LIMIT 1",
                        (session, turn),
                    ).fetchone()
                    out.append((str(session), str(turn), None if last is None else str(last[0])))
                for session, turn, partial in out:
                    told = None if notice is None else notice(session, turn, partial)
                    if told is None:
                        continue
                    with self._cond:
                        key = self._next_key
                        self._next_key += 1
                    self._db.execute(
                        "INSERT INTO messages (id, session, content, data, kind, sender,"
                        " created_at) VALUES (?,?,?,?,'notice',?,?)",
                        (key, told.parent, told.content, _dump(told.data), told.sender, now),
                    )
                self._db.execute(
                    "UPDATE turns SET outcome='crashed', cause='system', ended_at=?,"
                    " error='the host stopped while the turn ran' WHERE outcome IS NULL",
                    (now,),
                )
                # a notice committed into an inbox already settled (the child's end and
                # the parent's settle crossed, and the host died before the notice's
                # close): closed, as the live host would have
                self._db.execute(
                    "UPDATE messages SET state='closed' WHERE state='pending' AND session IN"
                    " (SELECT id FROM sessions WHERE settled=1)"
                )
                self._db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
        return out

    # ---- catalog ------------------------------------------------------------------

    def create_session(self, row: SessionHeader) -> Ticket:
        params = (
            row.id,
            row.parent,
            row.mode,
            row.slug,
            row.driver,
            _dump(row.config),
            _dump(row.permissions),
            row.created_at,
            _dump(row.stall),
            _dump(row.limits),
            None if row.budget is None else _enc.encode(row.budget),
        )
        return self.submit(
            _Statement(
                "INSERT INTO sessions (id, parent, mode, slug, driver, config, permissions,"
                " created_at, stall, limits, budget) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                params,
            ),
            waited=True,
        )

    def sessions(self) -> list[SessionHeader]:
        """Every session, in creation order."""
        rows = self._read(
            "SELECT id, parent, mode, slug, driver, config, permissions, created_at, settled,"
            " stall, limits, budget FROM sessions ORDER BY seq"
        )
        return [
            SessionHeader(
                id=r[0],
                parent=r[1],
                mode=r[2],
                slug=r[3],
                driver=r[4],
                config=_load(r[5]),
                permissions=_load(r[6]),
                created_at=r[7],
                settled=bool(r[8]),
                stall=_load(r[9]),
                limits=_load(r[10]),
                budget=None if r[11] is None else msgspec.json.decode(r[11], type=Budget),
            )
            for r in rows
        ]

    def set_budget(self, session: str, budget: Budget | None) -> Ticket:
        """Replace a session's stored budget (``rt.set_budget``)."""
        blob = None if budget is None else _enc.encode(budget)
        return self.submit(
            _Statement("UPDATE sessions SET budget=? WHERE id=?", (blob, session)), waited=True
        )

    def turn_usage(self, turn: str, usage: dict[str, int], *, soon: bool = False) -> None:
        """The running turn's usage so far (the store keeps this dict: pass a fresh one).
        Held in memory and written with the turn's end, or ``_USAGE_EVERY`` seconds after
        the first report held (a crashed turn's reported usage then counts at recovery,
        semantics §16.2), or, with ``soon`` (a budget near its limit), in the store's next
        batch. Reports between two writes share one write per turn; a short turn's cost
        none of their own, its end writes them."""
        with self._cond:
            opened = self._open.get(turn)
            if opened is None or self._stopping:
                return  # its end overtook it (and wrote it), or the store is closed
            self._usage[opened[1]] = usage
            if self._usage_queued:
                return  # a queued write takes this report too
            if soon:
                self._queue_usage_locked()
            elif self._usage_due is None:
                self._usage_due = time.monotonic() + _USAGE_EVERY
                self._cond.notify()  # the writer's wait gets a deadline (once per write)

    def _queue_usage_locked(self) -> None:
        """Queue one write of the usage held so far, with the store's next batch."""
        self._usage_due = None
        if self._usage and not self._usage_queued:
            self._usage_queued = True
            self._submit_locked(_UsageFlush(self), None)

    def _usage_rows(self) -> list[tuple[bytes | None, int]]:
        """Take the running turns' usage held so far (``_UsageFlush``)."""
        with self._cond:
            held, self._usage = self._usage, {}
            self._usage_queued = False
        return [(_dump(usage), row) for row, usage in held.items()]

    def spent_before(self) -> dict[str, Spent]:
        """What each session's turns of earlier hosts on this store spent: tokens, cost,
        seconds, turns (this host's own are counted as they happen)."""
        out: dict[str, Spent] = {}
        first = (self._first_turn,)
        for session, n, seconds in self._read(
            "SELECT session, COUNT(*), SUM(COALESCE(ended_at, started_at) - started_at)"
            " FROM turns WHERE seq < ? GROUP BY session",
            first,
        ):
            out[str(session)] = Spent(turns=int(n), seconds=float(seconds or 0.0))
        for session, blob in self._read(
            "SELECT session, usage FROM turns WHERE seq < ? AND usage IS NOT NULL", first
        ):
            usage = _load(blob) or {}
            spent = out.setdefault(str(session), Spent())
            spent.tokens += _int(usage.get("prompt_tokens")) + _int(usage.get("completion_tokens"))
            spent.cost += _int(usage.get("cost_microusd"))
        return out

    def dispose_accepted(self, sessions: list[str]) -> Ticket:
        """A disposal of ``sessions`` (a whole subtree) is accepted: one commit, so a
        host killed before their settles leaves the next host to finish it
        (``finish_disposals``)."""

        def op(db: sqlite3.Connection) -> None:
            db.executemany("UPDATE sessions SET disposing=1 WHERE id=?", [(s,) for s in sessions])

        return self.submit(op, waited=True)

    def settle(self, session: str) -> Ticket:
        """Close the inbox (pending messages are kept, marked closed) and mark settled."""

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE messages SET state='closed' WHERE session=? AND state='pending'",
                (session,),
            )
            db.execute("UPDATE sessions SET settled=1 WHERE id=?", (session,))

        return self.submit(op)

    # ---- inboxes ------------------------------------------------------------------

    def append_message(
        self,
        session: str,
        content: str,
        *,
        data: dict[str, Any] | None = None,
        kind: str = "user",
        sender: str | None = None,
        refusable: bool = False,
        trace: str | None = None,
    ) -> tuple[Message, Ticket]:
        """Queue a new inbox message; it is durable once the ticket is set.

        ``refusable``: a send, refused (``StoreUnavailable``) rather than kept while the
        store cannot commit; nothing may depend on the message until its ticket is done.
        """
        if refusable:
            self.check_writable()
        now = time.time()
        blob = _dump(data)
        ticket = Ticket(self, refusable=refusable)
        with self._cond:
            key = self._next_key
            self._next_key += 1
            params = (key, session, content, blob, kind, sender, now, trace)
            self._submit_locked(
                _Statement(
                    "INSERT INTO messages (id, session, content, data, kind, sender, created_at,"
                    " trace) VALUES (?,?,?,?,?,?,?,?)",
                    params,
                ),
                ticket,
                waited=kind == "user",
            )
        msg = Message(
            id=f"m_{key}",
            session=session,
            content=content,
            data=data,
            kind=kind,  # type: ignore[arg-type]
            sender=sender,
            created_at=now,
            trace=trace,
        )
        return msg, ticket

    def pending(self, session: str) -> tuple[list[Message], int]:
        """The session's unclaimed messages, oldest first, and the horizon they cover.

        Every message with a key up to the horizon is committed, so it is either in the
        list or no longer pending; one above it may still be on its way (see
        ``Session.enqueue``). A materialization loads its inbox with this.
        """
        with self._cond:
            horizon = self._next_key - 1
        self.flush()
        with self._lock, _readable():
            rows = self._db.execute(
                "SELECT id, session, content, data, kind, sender, created_at, trace FROM messages"
                " WHERE session=? AND state='pending' AND id<=? ORDER BY id",
                (session, horizon),
            ).fetchall()
        return [_message(r) for r in rows], horizon

    def close_message(self, message_id: str) -> None:
        """A message accepted just as its inbox closed goes the way of the inbox."""
        key = message_key(message_id)
        self._queue_op(
            _Statement("UPDATE messages SET state='closed' WHERE id=? AND state='pending'", (key,))
        )

    def pending_count(self, session: str) -> int:
        (row,) = self._read(
            "SELECT COUNT(*) FROM messages WHERE session=? AND state='pending'", (session,)
        )
        return int(row[0])

    def inbox(self, session: str) -> list[PendingMessage]:
        rows = self._read(
            "SELECT id, kind, sender, created_at, substr(content, 1, ?) FROM messages"
            " WHERE session=? AND state='pending' ORDER BY id",
            (_PREVIEW, session),
        )
        return [
            PendingMessage(id=f"m_{r[0]}", kind=r[1], sender=r[2], created_at=r[3], preview=r[4])
            for r in rows
        ]

    # ---- turns --------------------------------------------------------------------

    def start_turn(self, turn: str, message: Message, woken_by: str | None = None) -> Ticket:
        """Record that ``turn`` claimed ``message`` (and the message's transcript entry);
        the ticket is done once the claim is durable (the turn may be dispatched then).
        ``woken_by``: the message whose waking send started it (see TurnRecord)."""
        now = time.time()
        key = message_key(message.id)
        woke = None if woken_by is None else message_key(woken_by)
        session = message.session
        blob = _dump(message.data)
        with self._cond:
            row = next(self._turn_seqs)
            seq = next(self._entry_seqs)
            self._open[turn] = (session, row)

            def op(db: sqlite3.Connection) -> None:
                db.execute("UPDATE messages SET state='claimed', turn=? WHERE id=?", (turn, key))
                db.execute(
                    "INSERT INTO turns (seq, id, session, message_id, started_at, woken_by)"
                    " VALUES (?,?,?,?,?,?)",
                    (row, turn, session, key, now, woke),
                )
                db.execute(
                    "INSERT INTO entries (seq, session, turn, kind, text, data, created_at)"
                    " VALUES (?,?,?,?,?,?,?)",
                    (seq, session, turn, message.kind, message.content, blob, now),
                )

            ticket = Ticket(self)
            self._submit_locked(op, ticket, urgent=True)
        return ticket

    def end_turn(
        self,
        turn: str,
        *,
        outcome: str,
        cause: str | None = None,
        by: str | None = None,
        forced: bool = False,
        escalated: bool = False,
        reason: str | None = None,
        error: str | None = None,
        final: str | None = None,
        usage: dict[str, int] | None = None,
        resources: dict[str, float] | None = None,
        notice: ParentNotice | None = None,
    ) -> Message | None:
        """Record a turn's end (and its final text as an assistant entry); with
        ``notice``, the parent's notice message in the same commit. Returns that
        message (None without a notice, or for a turn not open here)."""
        now = time.time()
        with self._cond:
            opened = self._open.pop(turn, None)
            if opened is None:
                return None
            session, row = opened
            self._usage.pop(row, None)  # the end writes the turn's usage itself
            seq = next(self._entry_seqs) if final is not None else None
            msg: Message | None = None
            if notice is not None:
                key = self._next_key
                self._next_key += 1
                blob = _dump(notice.data)
                msg = Message(
                    id=f"m_{key}",
                    session=notice.parent,
                    content=notice.content,
                    data=notice.data,
                    kind="notice",
                    sender=notice.sender,
                    created_at=now,
                    trace=notice.trace,
                )

            def op(db: sqlite3.Connection) -> None:
                if msg is not None:
                    db.execute(
                        "INSERT INTO messages"
                        " (id, session, content, data, kind, sender, created_at, trace)"
                        " VALUES (?,?,?,?,'notice',?,?,?)",
                        (key, msg.session, msg.content, blob, msg.sender, now, msg.trace),
                    )
                if seq is not None:
                    db.execute(
                        "INSERT INTO entries (seq, session, turn, kind, text, created_at)"
                        " VALUES (?,?,?,'assistant',?,?)",
                        (seq, session, turn, final, now),
                    )
                db.execute(
                    "UPDATE turns SET ended_at=?, outcome=?, cause=?, by=?, forced=?,"
                    " escalated=?, reason=?, error=?, usage=?, resources=? WHERE seq=?",
                    (
                        now,
                        outcome,
                        cause,
                        by,
                        forced,
                        escalated,
                        reason,
                        error,
                        _dump(usage),
                        _dump(resources),
                        row,
                    ),
                )

            self._submit_locked(op, None)
        return msg

    def turns(self, session: str) -> list[TurnRecord]:
        rows = self._read(
            "SELECT id, session, message_id, outcome, cause, by, forced, escalated, reason,"
            " error, started_at, ended_at, usage, resources, woken_by FROM turns"
            " WHERE session=?"
            " ORDER BY seq",
            (session,),
        )
        return [
            TurnRecord(
                id=r[0],
                session=r[1],
                message_id=r[2],
                message=f"m_{r[2]}",
                outcome=r[3],
                cause=r[4],
                by=r[5],
                forced=bool(r[6]),
                escalated=bool(r[7]),
                reason=r[8],
                error=r[9],
                started_at=r[10],
                ended_at=r[11],
                usage=_load(r[12]),
                resources=_load(r[13]),
                woken_by=None if r[14] is None else f"m_{r[14]}",
            )
            for r in rows
        ]

    # ---- stop reports (semantics §15.6) --------------------------------------------------

    def put_stop_report(self, report: StopReport) -> None:
        """Record (or replace: a report is completed once the turn has ended) a turn's
        stop report; queued like the turn's own records."""
        blob = _enc.encode(report)

        def op(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR REPLACE INTO stop_reports (turn, session, report) VALUES (?,?,?)",
                (report.turn, report.session, blob),
            )

        self._queue_op(op)

    def stop_report(self, turn: str) -> StopReport | None:
        rows = self._read("SELECT report FROM stop_reports WHERE turn=?", (turn,))
        return msgspec.json.decode(rows[0][0], type=StopReport) if rows else None

    # ---- transcripts --------------------------------------------------------------

    def append_entry(
        self,
        session: str,
        kind: str,
        text: str,
        *,
        turn: str | None = None,
        action: str | None = None,
        origin: str | None = None,
        by: str | None = None,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> Entry:
        """Queue a transcript entry; its ``seq`` is known at once."""
        now = time.time()
        blob = _dump(data)
        with self._cond:
            seq = next(self._entry_seqs)
            params = (seq, session, turn, kind, text, action, origin, by, reason, blob, now)
            self._submit_locked(
                _Statement(
                    "INSERT INTO entries (seq, session, turn, kind, text, action, origin, by,"
                    " reason, data, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    params,
                ),
                None,
            )
        return Entry(
            seq=seq,
            session=session,
            kind=kind,  # type: ignore[arg-type]
            text=text,
            turn=turn,
            action=action,
            origin=origin,
            by=by,
            reason=reason,
            data=data,
            created_at=now,
        )

    def entries(self, session: str, *, after: int = 0, limit: int | None = None) -> list[Entry]:
        """Entries past ``after``, oldest first; at most ``limit`` (an index range scan, so
        a page costs the same however long the transcript is)."""
        rows = self._read(
            "SELECT seq, session, kind, text, turn, action, origin, by, reason, data,"
            " created_at FROM entries WHERE session=? AND seq>? ORDER BY seq LIMIT ?",
            (session, after, -1 if limit is None else limit),
        )
        return [
            Entry(
                seq=r[0],
                session=r[1],
                kind=r[2],
                text=r[3],
                turn=r[4],
                action=r[5],
                origin=r[6],
                by=r[7],
                reason=r[8],
                data=_load(r[9]),
                created_at=r[10],
            )
            for r in rows
        ]

    def last_assistant_text(self, session: str, turn: str) -> str | None:
        # newest first through (session, seq): a turn's entries are its session's latest
        rows = self._read(
            "SELECT text FROM entries WHERE session=? AND turn=? AND kind='assistant'"
            " ORDER BY seq DESC LIMIT 1",
            (session, turn),
        )
        return None if not rows else str(rows[0][0])


@contextlib.contextmanager
def _readable() -> Iterator[None]:
    """No raw sqlite3 error leaves the store: a read that fails is StoreUnavailable."""
    try:
        yield
    except sqlite3.Error as exc:
        raise StoreUnavailable(f"the store cannot be read: {exc}") from None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _message(r: tuple[Any, ...]) -> Message:
    return Message(
        id=f"m_{r[0]}",
        session=r[1],
        content=r[2],
        data=_load(r[3]),
        kind=r[4],
        sender=r[5],
        created_at=r[6],
        trace=r[7] if len(r) > 7 else None,
    )
