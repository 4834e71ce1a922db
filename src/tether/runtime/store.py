"""The durable store: the session schema's reads and writes on SQLite in WAL mode, one
host per store; writes go through the group-commit engine (``group_commit``).

How writes are queued and committed, what a failed commit does, the WAL's bound and the
store's lock: docs/design.md, section 8; recovery at start: section 9. The tables, their
upgrades and the lock are ``_store_file``'s; recovery's transactions ``_recovery``'s.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import structlog

from tether.actors.budget import Spent
from tether.actors.ports import EndRecord, Keep, KeptTurn, ParentNotice
from tether.runtime import _recovery
from tether.runtime._approval_rows import ApprovalRows
from tether.runtime._store_file import create_tables, lock_host
from tether.runtime._store_file import dump as _dump
from tether.runtime._store_file import load as _load
from tether.runtime._store_file import message_of as _message
from tether.runtime.group_commit import (
    WAL_LIMIT,
    GroupCommit,
    Op,
    Statement,
    Ticket,
    configure,
)
from tether.wire.budget import Budget
from tether.wire.errors import StoreUnavailable
from tether.wire.frames import Steer
from tether.wire.records import (
    Entry,
    EntryKind,
    MarkerAction,
    Message,
    PendingMessage,
    SessionHeader,
    StopOrigin,
    StopReport,
    TurnRecord,
    UnknownCall,
    message_key,
)
from tether.wire.vocab import StallPolicy

__all__ = ["MAX_PAGE", "Store"]

log = structlog.get_logger("tether.store")

MAX_PAGE = 1000  # entries one read returns at most
_PREVIEW = 200
_USAGE_EVERY = 0.25  # seconds a running turn's reported usage may wait for its write

_enc = msgspec.json.Encoder()


class _UsageFlush:
    """The running turns' usage changed since the last write, taken from the governor
    (and encoded) when the batch runs (kept for a retry of the same batch)."""

    __slots__ = ("_rows", "_store")

    def __init__(self, store: Store) -> None:
        self._store = store
        self._rows: list[tuple[bytes | None, int]] | None = None

    def __call__(self, db: sqlite3.Connection) -> object:
        if self._rows is None:
            self._rows = self._store._usage_rows()
        return db.executemany("UPDATE turns SET usage=? WHERE seq=?", self._rows)


def _nothing(db: sqlite3.Connection) -> None:
    """``barrier``'s write: its place in the queue is all it is for."""


def _probe(db: sqlite3.Connection) -> None:
    """A write that changes nothing, on a page: the engine's ``probe``."""
    db.execute("UPDATE meta SET value = value WHERE key = 'boots'")


class Store(ApprovalRows):
    """Catalog, inboxes with claim state, turn records, transcripts and approvals."""

    def __init__(
        self,
        path: str | None = None,
        *,
        durability: str = "normal",
        wal_limit: int = WAL_LIMIT,
        give_up: float | None = None,
    ) -> None:
        self.path = path
        self._lock_fd = None if path is None else lock_host(path)
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
        self._commits = GroupCommit(
            self._db,
            path,
            probe=_probe,
            wal_limit=wal_limit,
            give_up=give_up,
            on_due=self._queue_usage_locked,
        )
        self._lock = self._commits.lock  # the connection: one commit or one read at a time
        # The queue's lock: keys, seqs and rows are numbered under it, so they follow
        # queue order (and the usage bookkeeping below is guarded by it).
        self._mutex = self._commits.queue_mutex
        self._submit_locked = self._commits.submit_locked
        self._open: dict[str, tuple[str, int]] = {}  # turn -> (session, row) until it ends
        # Running turns' usage is the governor's (``take_usage``); the store is told when
        # it changed and takes it when it writes.
        self._take_usage: Callable[[], dict[str, dict[str, int]]] | None = None
        self._usage_held = False  # told of a change no write has been queued for
        self._usage_queued = False  # a _UsageFlush is queued: its take is still to come
        self._usage_due = False  # the engine will call for the held usage's write
        self._closing = False

    def _open_db(self, path: str | None, durability: str, wal_limit: int) -> None:
        configure(self._db, path, durability, wal_limit)
        create_tables(self._db)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor drops the flock
            self._lock_fd = None

    def _max(self, table: str, column: str) -> int:
        (n,) = self._db.execute(f"SELECT COALESCE(MAX({column}), 0) FROM {table}").fetchone()
        return int(n)

    # ---- committing (the engine: group_commit) ---------------------------------------

    @property
    def failed(self) -> bool:
        """True once a batch could not be committed for ``give_up`` seconds."""
        return self._commits.failed

    def check_writable(self) -> None:
        """Raise ``StoreUnavailable`` while the store is down or has failed: a caller
        about to change something durable is refused before anything changes."""
        self._commits.check_writable()

    def submit(self, op: Op, *, waited: bool = False, urgent: bool = False) -> Ticket:
        """Queue one write; the returned ticket is done once it is committed
        (``GroupCommit.submit``)."""
        return self._commits.submit(op, waited=waited, urgent=urgent)

    def _queue_op(self, op: Op) -> None:
        """Queue a write nobody waits for."""
        with self._mutex:
            self._submit_locked(op, None)

    def own_writes(self) -> None:
        """The calling thread commits its own writes (``GroupCommit.own_writes``)."""
        self._commits.own_writes()

    def commit_own(self) -> None:
        """Commit what this thread queued since its last call (``GroupCommit.commit_own``)."""
        self._commits.commit_own()

    def flush(self) -> None:
        """Commit everything queued so far, running turns' usage included (a reader sees
        every earlier write); ``StoreUnavailable`` if the store cannot."""
        with self._mutex:
            self._queue_usage_locked()
        self._commits.flush()

    def close(self) -> None:
        with self._mutex:
            self._queue_usage_locked()  # running turns' usage held: the last write
            self._closing = True
        self._commits.close()
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
        not finished: its host was killed meanwhile (``_recovery.finish_disposals``).
        Returns the sessions settled."""
        with self._lock, _readable():
            return _recovery.finish_disposals(self._db)

    def recover(
        self,
        notice: Callable[[str, str, str | None], ParentNotice | None] | None = None,
        keep: Callable[[str, int], Keep] | None = None,
    ) -> tuple[list[tuple[str, str, str | None]], list[KeptTurn]]:
        """Close every turn with no end record as ``crashed``, and write the parents'
        notices that ``notice(session, turn, last assistant text)`` composes, in one
        commit (``_recovery.close_open_turns``); a turn ``keep`` says ``"recover"``
        stays open, to recover (semantics §17.1).

        Returns (session, turn, last assistant text) for each turn closed, and those kept.
        """
        now = time.time()

        def new_key() -> int:
            with self._mutex:
                key = self._next_key
                self._next_key += 1
            return key

        with self._lock, _readable():
            closed, kept = _recovery.close_open_turns(self._db, notice, new_key, now, keep)
        for k in kept:  # open here now: its end is this host's to record
            self._open[k.turn] = (k.session, k.row)
        return closed, kept

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
            None if row.stall is None else _enc.encode(row.stall),
            _dump(row.limits),
            None if row.budget is None else _enc.encode(row.budget),
            row.on_crash,
            row.max_recoveries,
            row.recoverable,
            row.spawned_by,
        )
        return self.submit(
            Statement(
                "INSERT INTO sessions (id, parent, mode, slug, driver, config, permissions,"
                " created_at, stall, limits, budget, on_crash, max_recoveries, recoverable,"
                " spawned_by) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                params,
            ),
            waited=True,
        )

    def sessions(self) -> list[SessionHeader]:
        """Every session, in creation order."""
        rows = self._read(
            "SELECT id, parent, mode, slug, driver, config, permissions, created_at, settled,"
            " stall, limits, budget, on_crash, max_recoveries, recoverable, spawned_by"
            " FROM sessions ORDER BY seq"
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
                stall=None if r[9] is None else msgspec.json.decode(r[9], type=StallPolicy),
                limits=_load(r[10]),
                budget=None if r[11] is None else msgspec.json.decode(r[11], type=Budget),
                on_crash=r[12] or "recover",
                max_recoveries=3 if r[13] is None else r[13],
                recoverable=bool(r[14]),
                spawned_by=r[15],
            )
            for r in rows
        ]

    def set_budget(self, session: str, budget: Budget | None) -> Ticket:
        """Replace a session's stored budget (``rt.set_budget``)."""
        blob = None if budget is None else _enc.encode(budget)
        return self.submit(
            Statement("UPDATE sessions SET budget=? WHERE id=?", (blob, session)), waited=True
        )

    def take_usage_from(self, take: Callable[[], dict[str, dict[str, int]]]) -> None:
        """Where running turns' usage comes from: ``take`` returns each turn's usage so
        far that changed since its last call (the governor's ``take_usage``)."""
        self._take_usage = take

    def usage_changed(self, *, soon: bool = False) -> None:
        """Running turns' reported usage changed (semantics §16.2: a crashed turn's
        reported usage counts). Written with the turn's end, or ``_USAGE_EVERY``
        seconds after the first change held (however many follow), or, with ``soon``
        (a budget near its limit), in the store's next batch. Never waits: the governor
        calls it under its lock."""
        with self._mutex:
            if self._usage_queued or self._closing:
                return  # a queued write takes it (its take is still to come)
            self._usage_held = True
            if soon:
                self._queue_usage_locked()
            elif not self._usage_due:
                self._usage_due = True
                self._commits.due_locked(time.monotonic() + _USAGE_EVERY)

    def _queue_usage_locked(self) -> None:
        """Queue one write of the usage held so far, with the store's next batch."""
        self._usage_due = False
        if self._usage_held and not self._usage_queued:
            self._usage_held = False
            self._usage_queued = True
            self._submit_locked(_UsageFlush(self), None)

    def _usage_rows(self) -> list[tuple[bytes | None, int]]:
        """Take the running turns' usage changed so far (``_UsageFlush``). A change told
        from here on is held for a write of its own: the take below may miss it."""
        with self._mutex:
            self._usage_queued = False
        taken = self._take_usage() if self._take_usage is not None else {}
        with self._mutex:
            # a turn whose end was queued meanwhile is gone: its end writes its usage
            rows = [
                (usage, opened[1])
                for turn, usage in taken.items()
                if (opened := self._open.get(turn))
            ]
        return [(_dump(usage), row) for usage, row in rows]

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
        ticket = Ticket(self._commits, refusable=refusable)
        with self._mutex:
            key = self._next_key
            self._next_key += 1
            params = (key, session, content, blob, kind, sender, now, trace)
            self._submit_locked(
                Statement(
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
        with self._mutex:
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
            Statement("UPDATE messages SET state='closed' WHERE id=? AND state='pending'", (key,))
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
        with self._mutex:
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

            ticket = Ticket(self._commits)
            self._submit_locked(op, ticket, urgent=True)
        return ticket

    def end_turn(self, turn: str, record: EndRecord) -> Message | None:
        """Record a turn's end (and its final text as an assistant entry); with a
        notice, the parent's notice message in the same commit. Returns that message
        (None without a notice, or for a turn not open here)."""
        now = time.time()
        o, final, notice = record.outcome, record.final, record.notice
        with self._mutex:
            opened = self._open.pop(turn, None)
            if opened is None:
                return None
            session, row = opened
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
                        o.outcome,
                        o.cause,
                        o.by,
                        o.forced,
                        o.escalated,
                        o.reason,
                        o.error,
                        _dump(record.usage),
                        _dump(record.resources),
                        row,
                    ),
                )

            self._submit_locked(op, None)
        return msg

    def turns(self, session: str) -> list[TurnRecord]:
        rows = self._read(
            "SELECT id, session, message_id, outcome, cause, by, forced, escalated, reason,"
            " error, started_at, ended_at, usage, resources, woken_by, recoveries FROM turns"
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
                recoveries=r[15],
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

    def put_steer(self, turn: str, steer: Steer) -> None:
        """Queue a steer accepted for ``turn``: delivered after a crash if no boundary
        took it before (semantics §17.1)."""
        sql = "INSERT INTO steers (turn, origin, by, text) VALUES (?,?,?,?)"
        self._queue_op(Statement(sql, (turn, steer.origin, steer.by, steer.text)))

    def barrier(self) -> Ticket:
        """A ticket done once every write queued before it is committed; refused, as a
        send is, when its commit fails: a control's answer waits for it."""
        return self._commits.submit(_nothing, refusable=True)

    def stop_report(self, turn: str) -> StopReport | None:
        rows = self._read("SELECT report FROM stop_reports WHERE turn=?", (turn,))
        return msgspec.json.decode(rows[0][0], type=StopReport) if rows else None

    # ---- transcripts --------------------------------------------------------------

    def append_entry(
        self,
        session: str,
        kind: EntryKind,
        text: str,
        *,
        turn: str | None = None,
        action: MarkerAction | None = None,
        origin: StopOrigin | None = None,
        by: str | None = None,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> Entry:
        """Queue a transcript entry; its ``seq`` is known at once."""
        now = time.time()
        blob = _dump(data)
        with self._mutex:
            seq = next(self._entry_seqs)
            params = (seq, session, turn, kind, text, action, origin, by, reason, blob, now)
            self._submit_locked(
                Statement(
                    "INSERT INTO entries (seq, session, turn, kind, text, action, origin, by,"
                    " reason, data, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    params,
                ),
                None,
            )
        return Entry(
            seq=seq,
            session=session,
            kind=kind,
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

    # ---- tool calls' write-ahead (semantics §17.1) ---------------------------------

    def begin_call(
        self,
        key: str,
        session: str,
        turn: str,
        name: str,
        arguments: str,
        tool_call_id: str | None,
    ) -> Ticket:
        """Queue a tool call's start after every write queued before it (its reply's
        entry among them); the ticket is done once it is durable."""
        params = (key, session, turn, name, arguments, tool_call_id, time.time())
        with self._mutex:
            ticket = Ticket(self._commits)
            self._submit_locked(
                Statement(
                    "INSERT INTO calls (key, session, turn, name, arguments, tool_call_id,"
                    " started_at) VALUES (?,?,?,?,?,?,?)",
                    params,
                ),
                ticket,
                urgent=True,
            )
        return ticket

    def recovered(self, turn: str, recoveries: int) -> Ticket:
        """Count a recovery of ``turn``; the ticket is done once it is durable (the
        recovered turn is dispatched then)."""
        with self._mutex:
            ticket = Ticket(self._commits)
            self._submit_locked(
                Statement("UPDATE turns SET recoveries=? WHERE id=?", (recoveries, turn)),
                ticket,
                urgent=True,
            )
        return ticket

    def turn_steps(self, session: str, turn: str) -> int:
        """How many durable steps ``turn`` has: its replies and its tools' results."""
        rows = self._read(
            "SELECT COUNT(*) FROM entries WHERE session=? AND turn=?"
            " AND kind IN ('assistant', 'tool')",
            (session, turn),
        )
        return int(rows[0][0])

    def unknown_calls(self, session: str, turn: str) -> list[UnknownCall]:
        """The calls of ``turn`` whose start is durable and whose result (a ``tool`` entry
        naming its key) is not: each may or may not have run."""
        self.flush()  # its tools' results queued before it count
        with self._lock, _readable():
            return _recovery.unknown_calls(self._db, session, turn)

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
