"""The durable store: SQLite in WAL mode.

One connection, shared by the host's threads behind a lock: every write is one short
transaction, committed before the call returns, so an accepted send survives a host
crash (WAL with ``synchronous=NORMAL`` is durable against a process crash; a power cut
may lose the last transactions, which ``durability="full"`` prevents at a cost).
``path=None`` is an in-memory store with the same schema and the same code paths.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

import msgspec

from tether.wire.records import Entry, Message, SessionHeader, TurnRecord

__all__ = ["Store"]

# Rows are never deleted, so plain INTEGER PRIMARY KEYs only grow (AUTOINCREMENT would
# cost an extra write per insert for a guarantee we do not need).
_SCHEMA = """
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
    settled     INTEGER NOT NULL DEFAULT 0
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
    turn        TEXT
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
    error       TEXT
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
"""

_CHECKPOINT_EVERY = 0.5  # seconds between background WAL checkpoints

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(dict[str, Any])


def _dump(value: dict[str, Any] | None) -> bytes | None:
    return None if value is None else _enc.encode(value)


def _load(blob: bytes | None) -> dict[str, Any] | None:
    return None if blob is None else _dec.decode(blob)


class _Tx:
    """``with store._tx() as db``: the lock, BEGIN, and COMMIT or ROLLBACK."""

    __slots__ = ("_db", "_lock")

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self._db = db
        self._lock = lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._db.execute("BEGIN")  # one connection, behind our lock: no upgrade race
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self._lock.release()


class Store:
    """Catalog, inboxes with claim state, turn records and transcripts."""

    def __init__(self, path: str | None = None, *, durability: str = "normal") -> None:
        self.path = path
        self._db = sqlite3.connect(
            path or ":memory:", check_same_thread=False, isolation_level=None
        )
        self._lock = threading.Lock()
        self._open: dict[str, tuple[str, int]] = {}  # turn id -> (session, rowid) until it ends
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if path is not None:
            # Small pages: a commit appends every page it touched to the WAL, and a turn
            # boundary touches six (rows and indexes of three tables) to write a few
            # hundred bytes. Takes effect when the file is created.
            self._db.execute("PRAGMA page_size=1024")
            self._db.execute("PRAGMA journal_mode=WAL")
            # Checkpoints move off the committing threads (where SQLite runs them by
            # default, stalling whichever commit crosses the threshold) to one of our own.
            self._db.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop, args=(path,), name="tether-checkpoint", daemon=True
            )
            self._checkpointer.start()
        sync = "FULL" if durability == "full" else "NORMAL"
        self._db.execute(f"PRAGMA synchronous={sync}")
        self._db.executescript(_SCHEMA)

    def _tx(self) -> _Tx:
        return _Tx(self._db, self._lock)

    def _checkpoint_loop(self, path: str) -> None:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            while not self._stop.wait(_CHECKPOINT_EVERY):
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            db.close()

    def close(self) -> None:
        self._stop.set()
        if self._checkpointer is not None:
            self._checkpointer.join()
        with self._lock:
            if self._checkpointer is not None:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()

    # ---- catalog ------------------------------------------------------------------

    def create_session(self, row: SessionHeader) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO sessions (id, parent, mode, slug, driver, config, permissions,"
                " created_at) VALUES (?,?,?,?,?,?,?,?)",
                (
                    row.id,
                    row.parent,
                    row.mode,
                    row.slug,
                    row.driver,
                    _dump(row.config),
                    _dump(row.permissions),
                    row.created_at,
                ),
            )

    def sessions(self) -> list[SessionHeader]:
        """Every session, in creation order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, parent, mode, slug, driver, config, permissions, created_at, settled"
                " FROM sessions ORDER BY seq"
            ).fetchall()
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
            )
            for r in rows
        ]

    def settle(self, session: str) -> None:
        """Close the inbox (pending messages are kept, marked closed) and mark settled."""
        with self._tx() as db:
            db.execute(
                "UPDATE messages SET state='closed' WHERE session=? AND state='pending'",
                (session,),
            )
            db.execute("UPDATE sessions SET settled=1 WHERE id=?", (session,))

    # ---- inboxes ------------------------------------------------------------------

    def append_message(
        self,
        session: str,
        content: str,
        *,
        data: dict[str, Any] | None = None,
        kind: str = "user",
        sender: str | None = None,
    ) -> Message:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (session, content, data, kind, sender, created_at)"
                " VALUES (?,?,?,?,?,?)",
                (session, content, _dump(data), kind, sender, now),
            )
        assert cur.lastrowid is not None
        return Message(
            id=cur.lastrowid,
            session=session,
            content=content,
            data=data,
            kind=kind,  # type: ignore[arg-type]
            sender=sender,
            created_at=now,
        )

    def pending_count(self, session: str) -> int:
        with self._lock:
            (n,) = self._db.execute(
                "SELECT COUNT(*) FROM messages WHERE session=? AND state='pending'", (session,)
            ).fetchone()
        return int(n)

    def claim_next(self, session: str, turn: str) -> Message | None:
        """Claim the oldest pending message for a new turn and record the turn's start."""
        with self._tx() as db:
            return self._claim(db, session, turn)

    # ---- turns --------------------------------------------------------------------

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
        next_turn: str | None = None,
    ) -> Message | None:
        """Record a turn's end (and its final text), and claim the next message for
        ``next_turn`` if given: one transaction, so a turn boundary costs one commit."""
        now = time.time()
        with self._tx() as db:
            opened = self._open.pop(turn, None)
            if opened is None:
                return None
            session, rowid = opened
            if final is not None:
                db.execute(
                    "INSERT INTO entries (session, turn, kind, text, created_at)"
                    " VALUES (?,?,'assistant',?,?)",
                    (session, turn, final, now),
                )
            db.execute(
                "UPDATE turns SET ended_at=?, outcome=?, cause=?, by=?, forced=?, escalated=?,"
                " reason=?, error=? WHERE seq=?",
                (now, outcome, cause, by, forced, escalated, reason, error, rowid),
            )
            return None if next_turn is None else self._claim(db, session, next_turn)

    def _claim(self, db: sqlite3.Connection, session: str, turn: str) -> Message | None:
        now = time.time()
        row = db.execute(
            "SELECT id, session, content, data, kind, sender, created_at FROM messages"
            " WHERE session=? AND state='pending' ORDER BY id LIMIT 1",
            (session,),
        ).fetchone()
        if row is None:
            return None
        db.execute("UPDATE messages SET state='claimed', turn=? WHERE id=?", (turn, row[0]))
        cur = db.execute(
            "INSERT INTO turns (id, session, message_id, started_at) VALUES (?,?,?,?)",
            (turn, session, row[0], now),
        )
        db.execute(
            "INSERT INTO entries (session, turn, kind, text, data, created_at)"
            " VALUES (?,?,?,?,?,?)",
            (session, turn, row[4], row[2], row[3], now),
        )
        self._open[turn] = (session, cur.lastrowid or 0)
        return _message(row)

    def turns(self, session: str) -> list[TurnRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, session, message_id, outcome, cause, by, forced, escalated, reason,"
                " error, started_at, ended_at FROM turns WHERE session=? ORDER BY seq",
                (session,),
            ).fetchall()
        return [
            TurnRecord(
                id=r[0],
                session=r[1],
                message_id=r[2],
                outcome=r[3],
                cause=r[4],
                by=r[5],
                forced=bool(r[6]),
                escalated=bool(r[7]),
                reason=r[8],
                error=r[9],
                started_at=r[10],
                ended_at=r[11],
            )
            for r in rows
        ]

    def recover(self) -> list[str]:
        """Close every turn with no end record as ``crashed``; return their sessions."""
        with self._tx() as db:
            rows = db.execute("SELECT DISTINCT session FROM turns WHERE outcome IS NULL").fetchall()
            db.execute(
                "UPDATE turns SET outcome='crashed', cause='system', ended_at=?,"
                " error='the host stopped while the turn ran' WHERE outcome IS NULL",
                (time.time(),),
            )
        return [r[0] for r in rows]

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
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO entries (session, turn, kind, text, action, origin, by, reason,"
                " data, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (session, turn, kind, text, action, origin, by, reason, _dump(data), now),
            )
        assert cur.lastrowid is not None
        return Entry(
            seq=cur.lastrowid,
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

    def entries(self, session: str, *, after: int = 0) -> list[Entry]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, session, kind, text, turn, action, origin, by, reason, data,"
                " created_at FROM entries WHERE session=? AND seq>? ORDER BY seq",
                (session, after),
            ).fetchall()
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
        with self._lock:
            row = self._db.execute(
                "SELECT text FROM entries WHERE session=? AND turn=? AND kind='assistant'"
                " ORDER BY seq DESC LIMIT 1",
                (session, turn),
            ).fetchone()
        return None if row is None else str(row[0])


def _message(r: tuple[Any, ...]) -> Message:
    return Message(
        id=r[0],
        session=r[1],
        content=r[2],
        data=_load(r[3]),
        kind=r[4],
        sender=r[5],
        created_at=r[6],
    )
