"""The store's file: its tables, the upgrade of a file an older version wrote, how its
JSON columns and message rows read back, and the host lock that keeps one host per store
(docs/design.md, section 8).

``Store`` (``store.py``) opens it with these, then reads and writes its rows.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
import time
from typing import Any

import msgspec

from tether.wire.errors import StoreLocked, StoreUnavailable
from tether.wire.records import Message

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(dict[str, Any])


def dump(value: dict[str, Any] | None) -> bytes | None:
    """A JSON column's bytes (None stays NULL)."""
    return None if value is None else _enc.encode(value)


def load(blob: bytes | None) -> dict[str, Any] | None:
    """A JSON column's value (NULL is None)."""
    return None if blob is None else _dec.decode(blob)


def message_of(r: tuple[Any, ...]) -> Message:
    """A ``messages`` row (id, session, content, data, kind, sender, created_at[, trace])."""
    return Message(
        id=f"m_{r[0]}",
        session=r[1],
        content=r[2],
        data=load(r[3]),
        kind=r[4],
        sender=r[5],
        created_at=r[6],
        trace=r[7] if len(r) > 7 else None,
    )


__all__ = ["create_tables", "dump", "load", "lock_host", "message_of"]

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
    budget      BLOB,                        -- the session's own budget (semantics §16.2)
    on_crash    TEXT,                        -- recover | park (semantics §17.1)
    max_recoveries INTEGER,
    recoverable INTEGER NOT NULL DEFAULT 0,  -- its driver continues a crashed turn
    spawned_by  TEXT                         -- the spawn_agent call that made it (§17.1)
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
    woken_by    INTEGER,           -- the key of the message whose waking send started it
    recoveries  INTEGER NOT NULL DEFAULT 0  -- times a crash interrupted it and it recovered
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
CREATE TABLE IF NOT EXISTS calls (   -- each tool call's start, before it runs (§17.1)
    key          TEXT PRIMARY KEY,      -- Tether's call key: TETHER_CALL_ID
    session      TEXT NOT NULL,
    turn         TEXT NOT NULL,
    name         TEXT NOT NULL,
    arguments    TEXT NOT NULL,
    tool_call_id TEXT,                  -- the model's own id for the call
    started_at   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_turn ON calls (turn);
CREATE TABLE IF NOT EXISTS steers (  -- a user's or parent's steer, as accepted (§17.1)
    seq         INTEGER PRIMARY KEY,
    turn        TEXT NOT NULL,
    origin      TEXT NOT NULL,
    by          TEXT NOT NULL,
    text        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS steers_turn ON steers (turn);
CREATE TABLE IF NOT EXISTS approvals (   -- tool calls that wait for a decision (§17.2)
    id          TEXT PRIMARY KEY,      -- a_…
    session     TEXT NOT NULL,
    turn        TEXT NOT NULL,
    state       TEXT NOT NULL,         -- pending | approved | denied | cancelled | expired
    record      BLOB NOT NULL          -- the Approval, JSON
);
CREATE INDEX IF NOT EXISTS approvals_pending ON approvals (session) WHERE state='pending';
CREATE TABLE IF NOT EXISTS stop_reports (
    turn        TEXT PRIMARY KEY,
    session     TEXT NOT NULL,
    report      BLOB NOT NULL    -- a StopReport, JSON
);
"""


def create_tables(db: sqlite3.Connection) -> None:
    """The tables, made where missing; a file an older version wrote gets the columns
    added since (its rows are kept as they are)."""
    db.executescript(_SCHEMA)
    columns = {r[1] for r in db.execute("PRAGMA table_info(sessions)")}
    if "stall" not in columns:  # a store written before the stall watchdog
        db.execute("ALTER TABLE sessions ADD COLUMN stall BLOB")
    if "limits" not in columns:  # a store written before v3's limits
        db.execute("ALTER TABLE sessions ADD COLUMN limits BLOB")
    if "disposing" not in columns:  # a store written before round 4
        db.execute("ALTER TABLE sessions ADD COLUMN disposing INTEGER NOT NULL DEFAULT 0")
    if "budget" not in columns:  # a store written before v4's budgets
        db.execute("ALTER TABLE sessions ADD COLUMN budget BLOB")
    if "on_crash" not in columns:  # a store written before v5's durable turns
        db.execute("ALTER TABLE sessions ADD COLUMN on_crash TEXT")
        db.execute("ALTER TABLE sessions ADD COLUMN max_recoveries INTEGER")
        db.execute("ALTER TABLE sessions ADD COLUMN recoverable INTEGER NOT NULL DEFAULT 0")
    if "spawned_by" not in columns:  # a store written before idempotent spawns
        db.execute("ALTER TABLE sessions ADD COLUMN spawned_by TEXT")
    columns = {r[1] for r in db.execute("PRAGMA table_info(messages)")}
    if "trace" not in columns:  # a store written before telemetry
        db.execute("ALTER TABLE messages ADD COLUMN trace TEXT")
    columns = {r[1] for r in db.execute("PRAGMA table_info(turns)")}
    for column, kind in (
        ("usage", "BLOB"),
        ("resources", "BLOB"),
        ("woken_by", "INTEGER"),
        ("recoveries", "INTEGER NOT NULL DEFAULT 0"),
    ):
        if column not in columns:  # a store written before v3 (v5: recoveries)
            db.execute(f"ALTER TABLE turns ADD COLUMN {column} {kind}")


def lock_host(path: str) -> int:
    """Take the store's host lock, ``<path>.lock``, holding this process's pid: one host
    per store (``StoreLocked`` naming the live holder's pid). The open descriptor holds
    it (closing its last copy drops it)."""
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
