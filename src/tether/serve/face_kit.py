"""What every protocol face takes (``FaceOptions``) and the few runtime reads the faces make
while they wait for a turn: they poll the store's pages (``after``/``limit``), never a
whole transcript at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from tether import Entry, Runtime, TurnRecord

__all__ = [
    "DEFAULT_DRIVER",
    "FaceOptions",
    "last_seq",
    "turn_entries",
    "turn_of_message",
    "turn_record",
]

DEFAULT_DRIVER: Final = "tether:Scripted"
_PAGE: Final = 500


@dataclass(frozen=True)
class FaceOptions:
    """The driver and config of the root sessions that MCP and A2A clients open, the
    roots every MCP client holds from the start (``--root``), and the deadline after
    which an A2A ``CancelTask`` that reached no boundary escalates to an abort."""

    driver: str = DEFAULT_DRIVER
    config: dict[str, Any] | None = None
    roots: tuple[str, ...] = ()
    cancel_deadline: float | None = 30.0
    bearer: bool = False  # the server asks for a bearer token (the Agent Card says so)


def last_seq(rt: Runtime, session: str) -> int:
    """The seq of the session's last transcript entry (0 for none), page by page."""
    after = 0
    while True:
        page = rt.transcript(session, after=after, limit=_PAGE)
        if not page:
            return after
        after = page[-1].seq
        if len(page) < _PAGE:
            return after


def turn_entries(
    rt: Runtime, session: str, turn: str, after: int, limit: int = _PAGE
) -> tuple[list[Entry], int]:
    """Entries of ``turn`` past seq ``after`` (one page), and the cursor to go on from."""
    page = rt.transcript(session, after=after, limit=limit)
    cursor = page[-1].seq if page else after
    return [e for e in page if e.turn == turn], cursor


def turn_of_message(rt: Runtime, session: str, message: str) -> TurnRecord | None:
    """The turn that claimed ``message``, once one has."""
    return next((t for t in reversed(rt.turns(session)) if t.message == message), None)


def turn_record(rt: Runtime, session: str, turn: str) -> TurnRecord | None:
    return next((t for t in reversed(rt.turns(session)) if t.id == turn), None)
