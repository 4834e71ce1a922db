"""What a dead host left in its store, settled at start before anything reads it
(docs/design.md, section 9): the disposals it had accepted and not finished, then the
turns it left open, each in one transaction on the store's connection, which the caller
(``Store``) holds.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator

import msgspec

from tether.actors.ports import Keep, KeptTurn, ParentNotice
from tether.runtime._approval_rows import cancel_left_pending
from tether.runtime._store_file import dump, load, message_of
from tether.wire.frames import Steer
from tether.wire.records import StopOrigin, StopReport, UnknownCall

__all__ = ["close_open_turns", "finish_disposals", "unknown_calls"]

_report = msgspec.json.Decoder(StopReport)


def finish_disposals(db: sqlite3.Connection) -> list[str]:
    """Settle every session whose disposal was accepted but not finished. What the dead
    host had not done yet is what a finished disposal leaves: the inbox closed (its
    pending messages kept, marked closed), the session settled. A disposal marks the
    whole subtree in one commit, so its descendants are among these. Runs before the
    catalog is read and before ``close_open_turns``, which then closes their open turns
    as crashed (their parents told, unless settled). Returns the sessions settled."""
    with _transaction(db):
        rows = db.execute(
            "SELECT id FROM sessions WHERE disposing=1 AND settled=0 ORDER BY seq"
        ).fetchall()
        if rows:
            db.execute(
                "UPDATE messages SET state='closed' WHERE state='pending' AND session"
                " IN (SELECT id FROM sessions WHERE disposing=1 AND settled=0)"
            )
            db.execute("UPDATE sessions SET settled=1 WHERE disposing=1")
    return [str(r[0]) for r in rows]


def close_open_turns(
    db: sqlite3.Connection,
    notice: Callable[[str, str, str | None], ParentNotice | None] | None,
    new_key: Callable[[], int],
    now: float,
    keep: Callable[[str, int], Keep] | None = None,
) -> tuple[list[tuple[str, str, str | None]], list[KeptTurn]]:
    """Close every turn with no end record as ``crashed``, and write the parents' notices
    that ``notice(session, turn, last assistant text)`` composes (each keyed by
    ``new_key``), in one commit: a host killed during recovery leaves either both or
    neither, so no crashed turn is ever closed with its parent untold. A turn that
    ``keep(session, recoveries)`` says ``"recover"`` stays open, to recover (semantics
    §17.1); ``"exhausted"``: closed saying it crashed too often.

    Returns (session, turn, last assistant text) for each turn closed, and those kept.
    """
    with _transaction(db):
        cancel_left_pending(db)  # its turns end or recover here: none waits any more
        rows = db.execute(
            "SELECT id, session, recoveries, seq, message_id FROM turns"
            " WHERE outcome IS NULL ORDER BY seq"
        ).fetchall()
        out = []
        kept: list[KeptTurn] = []
        for turn, session, recoveries, row, message_id in rows:
            verdict = "end" if keep is None else keep(str(session), int(recoveries))
            if verdict == "recover":
                kept.append(_kept(db, str(session), str(turn), int(recoveries), row, message_id))
                continue
            if verdict == "exhausted":
                db.execute(
                    "UPDATE turns SET outcome='crashed', cause='system', ended_at=?, error=?"
                    " WHERE seq=?",
                    (now, f"crashed {recoveries + 1} times; not recovered again", row),
                )
            last = db.execute(
                "SELECT text FROM entries WHERE session=? AND turn=?"
                " AND kind='assistant' ORDER BY seq DESC LIMIT 1",
                (session, turn),
            ).fetchone()
            out.append((str(session), str(turn), None if last is None else str(last[0])))
        for session, turn, partial in out:
            told = None if notice is None else notice(session, turn, partial)
            if told is None:
                continue
            data = dump(told.data)
            db.execute(
                "INSERT INTO messages (id, session, content, data, kind, sender,"
                " created_at) VALUES (?,?,?,?,'notice',?,?)",
                (new_key(), told.parent, told.content, data, told.sender, now),
            )
        # the rest (the kept ones stay open, to recover)
        db.execute(
            "UPDATE turns SET outcome='crashed', cause='system', ended_at=?,"
            " error='the host stopped while the turn ran' WHERE outcome IS NULL"
            f" AND seq NOT IN ({','.join(str(k.row) for k in kept)})",
            (now,),
        )
        # a notice committed into an inbox already settled (the child's end and the
        # parent's settle crossed, and the host died before the notice's close): closed,
        # as the live host would have
        db.execute(
            "UPDATE messages SET state='closed' WHERE state='pending' AND session IN"
            " (SELECT id FROM sessions WHERE settled=1)"
        )
    return out, kept


def unknown_calls(db: sqlite3.Connection, session: str, turn: str) -> list[UnknownCall]:
    """The calls of ``turn`` whose start is durable and whose result (a ``tool`` entry
    naming its key) is not."""
    calls = db.execute(
        "SELECT key, name, arguments, tool_call_id FROM calls WHERE turn=? ORDER BY rowid",
        (turn,),
    ).fetchall()
    if not calls:
        return []
    rows = db.execute(
        "SELECT data FROM entries WHERE session=? AND turn=? AND kind='tool'", (session, turn)
    ).fetchall()
    ended = {(load(r[0]) or {}).get("call") for r in rows}
    return [
        UnknownCall(key=r[0], name=r[1], arguments=r[2], tool_call_id=r[3])
        for r in calls
        if r[0] not in ended
    ]


def _kept(
    db: sqlite3.Connection, session: str, turn: str, recoveries: int, row: int, message_id: int
) -> KeptTurn:
    r = db.execute(
        "SELECT id, session, content, data, kind, sender, created_at, trace FROM messages"
        " WHERE id=?",
        (message_id,),
    ).fetchone()
    stop, paused, steers = _controls(db, session, turn)
    return KeptTurn(session, turn, message_of(r), recoveries, row, stop, paused, steers)


def _controls(
    db: sqlite3.Connection, session: str, turn: str
) -> tuple[StopReport | None, tuple[StopOrigin, str, str] | None, tuple[Steer, ...]]:
    """The controls the dead host accepted for ``turn`` (semantics §17.1): the cancel or
    abort that stands (its report, written at acceptance, not completed), the pause in
    force (the last of the turn's pause and resume markers), the steers accepted and
    not delivered (a ``steered`` marker is written for each steer a boundary took, in
    the order they were accepted)."""
    stop = None
    r = db.execute("SELECT report FROM stop_reports WHERE turn=?", (turn,)).fetchone()
    if r is not None:
        report = _report.decode(r[0])
        if report.kind in ("cancel", "abort") and report.outcome is None:
            stop = report
    paused = None
    r = db.execute(
        "SELECT action, origin, by, reason FROM entries WHERE session=? AND turn=?"
        " AND kind='marker' AND action IN ('paused', 'resumed') ORDER BY seq DESC LIMIT 1",
        (session, turn),
    ).fetchone()
    if r is not None and r[0] == "paused":
        paused = (r[1], str(r[2]), str(r[3] or ""))
    taken = db.execute(
        "SELECT COUNT(*) FROM entries WHERE session=? AND turn=? AND kind='marker'"
        " AND action='steered' AND origin IN ('user', 'parent')",
        (session, turn),
    ).fetchone()[0]
    rows = db.execute(
        "SELECT origin, by, text FROM steers WHERE turn=? ORDER BY seq", (turn,)
    ).fetchall()
    steers = tuple(Steer(text, origin, by) for origin, by, text in rows[int(taken) :])
    return stop, paused, steers


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, taken at once (``BEGIN IMMEDIATE``), rolled back whole on
    any failure."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise
