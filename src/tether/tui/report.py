"""The stop reports of a session (semantics §15.6): its stop markers, newest first; the one
under the cursor shows its turn's report, read when it is shown (so a report completed
since the turn ended reads as it is now)."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from tether.cli._terminal import shown
from tether.cli.client import Client
from tether.cli.main import report_lines
from tether.tui.background import in_background
from tether.tui.session import StopMarker
from tether.tui.text import marker_line, one_line

__all__ = ["Reports"]


class Reports(ModalScreen[None]):
    """``↑``/``↓`` choose a stop marker; its report shows below; ``Esc`` backs out."""

    DEFAULT_CSS = """
    Reports { align: center middle; background: $background 60%; }
    Reports > Vertical {
        width: 100; max-width: 95%; height: 80%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    Reports OptionList { height: auto; max-height: 8; }
    Reports #report { height: 1fr; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "back", "back")]

    def __init__(self, client: Client, label: str, stops: list[StopMarker]) -> None:
        super().__init__()
        self._client = client
        self._label = label
        self._stops = sorted(stops, key=lambda s: s[0], reverse=True)
        self.shown: str = ""  # the report on screen, as plain text
        self._turn: str | None = None  # the turn whose report is (being) read

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(f"Stop reports of {one_line(self._label, 60)}", style="bold"))
            yield OptionList(
                *[
                    Option(Text(f"[{seq}] {one_line(marker_line(entry), 90)}"), id=str(i))
                    for i, (seq, _, entry) in enumerate(self._stops)
                ],
                id="stops",
            )
            with VerticalScroll(id="report"):
                yield Static(Text("reading the stop report…", style="dim"), id="report-text")
            keys = Text(" ↑↓ ", style="bold reverse")
            keys.append("  choose   ")
            keys.append(" esc ", style="bold reverse")
            keys.append("  back")
            yield Static(keys)

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.focus()
        if self._stops:
            options.highlighted = 0

    @on(OptionList.OptionHighlighted)
    def _read(self, event: OptionList.OptionHighlighted) -> None:
        index = int(event.option.id or 0)
        turn = self._turn = self._stops[index][1]
        self._put(Text("reading the stop report…", style="dim"))
        in_background(
            self.app,
            lambda: self._client.call("subagent.stopReport", {"turn": turn}),
            lambda got: self._show(turn, got),
            lambda exc: self._put(Text(f"refused: {exc}", style="red")),
        )

    def _show(self, turn: str, got: dict[str, Any]) -> None:
        if turn != self._turn:
            return  # another marker was chosen meanwhile
        report = got.get("report")
        if report is None:
            text = f"No stop report: no stop took effect on {turn}."
        else:
            text = shown("\n".join(report_lines(report)))
        self._put(Text(text))

    def _put(self, text: Text) -> None:
        if not self.is_attached:
            return  # dismissed meanwhile
        self.shown = text.plain
        self.query_one("#report-text", Static).update(text)

    def action_back(self) -> None:
        self.dismiss(None)
