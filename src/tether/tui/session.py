"""The selected session's pane: its facts, then one of its panes: the transcript
(following live), its turns, or its pending inbox.

The panes are named and switched by key (``t``, ``i``; the same key again goes back to the
transcript), so another pane (a session's pending approvals, once they exist) is one more
name here and one more key in the app.
"""

from __future__ import annotations

from typing import Any, Final

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ContentSwitcher, RichLog, Static

from tether.tui.model import Model, Row
from tether.tui.text import STOPS, entry_text, facts_text, inbox_text, turn_text

__all__ = ["PANES", "SessionPane", "StopMarker"]

PANES: Final = ("transcript", "turns", "inbox")
_KEEP: Final = 5000  # transcript lines kept on screen (the store keeps them all)

StopMarker = tuple[int, str, dict[str, Any]]  # (seq, turn, the marker entry)


class SessionPane(Vertical):
    """Facts, then the transcript, turns or inbox of one session."""

    def __init__(self, model: Model, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._model = model
        self.session: str | None = None
        self.last_seq = 0  # the transcript's last entry shown
        self.pane = "transcript"
        self.lines: list[str] = []  # what the transcript shows, as plain text
        self.turns: list[dict[str, Any]] = []
        self.inbox: list[dict[str, Any]] = []
        self.stops: list[StopMarker] = []  # the stop markers shown: `r` reads their reports
        # Held, not queried: an answer may arrive while the pane is being taken down.
        self._facts = Static(Text("Select a session in the tree."), id="facts")
        self._switcher = ContentSwitcher(initial="transcript", id="panes")
        # Lines wrap at the pane's width (min_width: no wider, so no sideways scroll).
        self._logs = {
            "transcript": RichLog(
                id="transcript", wrap=True, min_width=20, max_lines=_KEEP, auto_scroll=True
            ),
            "turns": RichLog(id="turns", wrap=True, min_width=20),
            "inbox": RichLog(id="inbox", wrap=True, min_width=20),
        }

    def compose(self) -> ComposeResult:
        yield self._facts
        with self._switcher:
            yield from self._logs.values()

    def open(self, sid: str) -> None:
        """Show ``sid`` from the start (its transcript is read again)."""
        self.session = sid
        self.last_seq = 0
        self.lines = []
        self.turns = []
        self.inbox = []
        self.stops = []
        for log in self._logs.values():
            log.clear()
        self.show_facts()

    def switch(self, name: str) -> str:
        """Show pane ``name``; the pane already shown gives way to the transcript."""
        self.pane = "transcript" if name == self.pane else name
        self._switcher.current = self.pane
        return self.pane

    def show_facts(self) -> None:
        if self.session is None:
            return
        row: Row = self._model.row(self.session)
        self._facts.update(facts_text(row, self._model))

    def append(self, entries: list[dict[str, Any]]) -> None:
        log = self._logs["transcript"]
        for entry in entries:
            seq = int(entry.get("seq") or 0)
            if seq <= self.last_seq:
                continue
            self.last_seq = seq
            text = entry_text(entry)
            self.lines.append(text.plain)
            log.write(text)
            if entry.get("kind") == "marker" and entry.get("action") in STOPS and entry.get("turn"):
                self.stops.append((seq, str(entry["turn"]), entry))

    def set_turns(self, turns: list[dict[str, Any]]) -> None:
        if turns == self.turns:
            return
        self.turns = turns
        log = self._logs["turns"]
        log.clear()
        if not turns:
            log.write(Text("No turn yet.", style="dim"))
        for t in reversed(turns):  # newest first
            log.write(turn_text(t))

    def set_inbox(self, messages: list[dict[str, Any]]) -> None:
        if messages == self.inbox and messages:
            return
        self.inbox = messages
        log = self._logs["inbox"]
        log.clear()
        if not messages:
            log.write(Text("No pending message.", style="dim"))
        for m in messages:  # oldest first: the order the next turns claim them
            log.write(inbox_text(m))
