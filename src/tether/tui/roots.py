"""The root picker: the roots of the server (``session.list``), newest first, a page at a
time; ``Enter`` opens one, the last line reads the next page."""

from __future__ import annotations

from typing import Any, ClassVar, Final

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from tether.cli.client import Client, RpcError
from tether.tui.background import in_background
from tether.tui.text import STATE_STYLE, one_line

__all__ = ["PAGE", "RootPicker"]

PAGE: Final = 50
_MORE: Final = "\x00more"  # the option that reads the next page (no session id has NUL)


class RootPicker(ModalScreen[str | None]):
    """Choose a root; ``Esc`` backs out (None), ``q`` quits."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back", "back", key_display="esc"),
        Binding("q", "app.quit", "quit"),
    ]

    def __init__(self, client: Client) -> None:
        super().__init__()
        self._client = client
        self._last: str | None = None  # the last root listed: the next page starts after it
        self.roots: list[str] = []

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text("Roots, newest first: Enter opens one", style="bold"), id="title")
            yield OptionList(id="roots")
            yield Static("", id="note")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()
        self._load()

    def _load(self) -> None:
        params: dict[str, Any] = {"limit": PAGE}
        if self._last is not None:
            params["before"] = self._last
        in_background(
            self.app,
            lambda: self._client.call("session.list", params),
            self._show,
            self._refused,
        )

    def _show(self, page: dict[str, Any]) -> None:
        if not self.is_attached:
            return  # dismissed meanwhile
        options = self.query_one(OptionList)
        if options.option_count and options.get_option_at_index(-1).id == _MORE:
            options.remove_option(_MORE)
        for info in page.get("roots") or []:
            sid = str(info["id"])
            self.roots.append(sid)
            label = Text(one_line(str(info.get("slug") or "-"), 40), style="bold")
            label.append(f"  {info['state']}", style=STATE_STYLE.get(str(info["state"]), ""))
            if info.get("pending"):
                label.append(f"  {info['pending']} pending", style="yellow")
            label.append(f"  {sid}", style="dim")
            options.add_option(Option(label, id=sid))
        if page.get("roots"):
            self._last = str(page["roots"][-1]["id"])
        if page.get("more"):
            options.add_option(Option(Text("… older roots", style="italic"), id=_MORE))
        if options.highlighted is None and options.option_count:
            options.highlighted = 0
        note = "" if self.roots else "No root yet: open one (tether open), then press r here."
        self.query_one("#note", Static).update(note)

    def _refused(self, exc: RpcError) -> None:
        if not self.is_attached:
            return
        self.query_one("#note", Static).update(Text(f"refused: {exc}", style="red"))

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        if event.option.id == _MORE:
            self._load()
        elif event.option.id is not None:
            self.dismiss(event.option.id)

    def key_r(self) -> None:
        """Read the list again from the newest."""
        self.query_one(OptionList).clear_options()
        self.roots = []
        self._last = None
        self._load()

    def action_back(self) -> None:
        self.dismiss(None)
