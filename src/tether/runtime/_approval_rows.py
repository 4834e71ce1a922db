"""The store's approvals (semantics §17.2): each one's record, written when it is asked for
and again when it is decided, and the reads that list and find them.

A mixin of ``Store`` (``store.py``): it queues its writes on the store's group commit and
reads through its connection, as the store's own methods do.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import msgspec

from tether.runtime.group_commit import Statement, Ticket
from tether.wire.approval import Approval

__all__ = ["ApprovalRows", "cancel_left_pending"]

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Approval)
_LEFT = "the host stopped while it waited; the call is asked for again if its turn recovers"


class ApprovalRows:
    """``Store``'s approvals: ``put_approval``, ``approval``, ``pending_approvals``."""

    def submit(self, op: Any, *, waited: bool = False, urgent: bool = False) -> Ticket:
        raise NotImplementedError  # the store's

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError  # the store's

    def put_approval(self, a: Approval) -> Ticket:
        """Queue ``a``'s record (new, or its decision over its pending one); the ticket
        is done once it is durable."""
        return self.submit(
            Statement(
                "INSERT OR REPLACE INTO approvals (id, session, turn, state, record)"
                " VALUES (?,?,?,?,?)",
                (a.id, a.session, a.turn, a.state, _enc.encode(a)),
            ),
            urgent=True,
        )

    def approval(self, approval_id: str) -> Approval | None:
        rows = self._read("SELECT record FROM approvals WHERE id=?", (approval_id,))
        return _dec.decode(rows[0][0]) if rows else None

    def pending_approvals(self, sessions: list[str]) -> list[Approval]:
        """The pending approvals of ``sessions``, oldest first."""
        out: list[Approval] = []
        for at in range(0, len(sessions), 500):  # SQLite's bound on parameters
            some = sessions[at : at + 500]
            marks = ",".join("?" * len(some))
            rows = self._read(
                f"SELECT record FROM approvals WHERE state='pending' AND session IN ({marks})",
                tuple(some),
            )
            out.extend(_dec.decode(r[0]) for r in rows)
        out.sort(key=lambda a: (a.requested_at, a.id))
        return out


def cancel_left_pending(db: sqlite3.Connection) -> int:
    """At a start on a store: the approvals a dead host left pending are cancelled (its
    turns are closed or recovered, and a recovered turn asks again). In the caller's
    transaction; how many."""
    rows = db.execute("SELECT record FROM approvals WHERE state='pending'").fetchall()
    now = time.time()
    for (blob,) in rows:
        a = msgspec.structs.replace(
            _dec.decode(blob),
            state="cancelled",
            decided_by="system",
            origin="system",
            reason=_LEFT,
            decided_at=now,
        )
        db.execute(
            "UPDATE approvals SET state=?, record=? WHERE id=?", (a.state, _enc.encode(a), a.id)
        )
    return len(rows)
