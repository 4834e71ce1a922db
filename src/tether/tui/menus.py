"""The modal screens a key opens: a menu of keys, and a prompt for a reason.

``KeyMenu`` answers the value of the key pressed (``Esc`` backs out: None); ``Prompt``
answers the text typed when ``Enter`` confirms (``Esc`` backs out: None). Both draw their
own keys, since the footer belongs to the screen under them.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

__all__ = ["KeyMenu", "Prompt"]

_CSS = """
KeyMenu, Prompt {
    align: center middle;
    background: $background 60%;
}
KeyMenu > Vertical, Prompt > Vertical {
    width: 72;
    max-width: 95%;
    height: auto;
    border: round $accent;
    background: $surface;
    padding: 0 1;
}
.menu-title { text-style: bold; padding-bottom: 1; }
.menu-hint { color: $text-muted; padding-top: 1; }
.menu-error { color: $error; }
"""


class KeyMenu(ModalScreen[str | None]):
    """A menu whose items are picked by one key each: ``(key, label, value)``."""

    DEFAULT_CSS = _CSS
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "back", "back")]

    def __init__(self, title: str, items: list[tuple[str, str, str]], hint: str = "") -> None:
        super().__init__()
        self._title = title
        self._items = items
        self._hint = hint

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self._title), classes="menu-title")
            for key, label, _ in self._items:
                line = Text(f" {key} ", style="bold reverse")
                line.append(f"  {label}")
                yield Static(line)
            hint = Text(self._hint + ("\n" if self._hint else ""))
            hint.append(" esc ", style="bold reverse")
            hint.append("  back")
            yield Static(hint, classes="menu-hint")

    def on_key(self, event: events.Key) -> None:
        for key, _, value in self._items:
            if event.character == key:
                event.stop()
                self.dismiss(value)
                return

    def action_back(self) -> None:
        self.dismiss(None)


class _ReasonInput(Input):
    """The prompt's text box (``Esc`` is the prompt's: it backs out)."""


class Prompt(ModalScreen[str | None]):
    """Ask for a text (a reason, a steer's guidance, a call's arguments); ``required``:
    not empty; ``value``: the text it starts with."""

    DEFAULT_CSS = _CSS
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "back", "back")]

    def __init__(
        self,
        title: str,
        hint: str,
        *,
        required: bool = False,
        value: str = "",
        placeholder: str | None = None,
    ) -> None:
        super().__init__()
        self._title = title
        self._hint = hint
        self._required = required
        self._value = value
        self._placeholder = placeholder

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self._title), classes="menu-title")
            placeholder = self._placeholder or (
                "Reason" if not self._required else "Text (required)"
            )
            yield _ReasonInput(value=self._value, placeholder=placeholder)
            yield Static("", classes="menu-error", id="prompt-error")
            keys = Text(self._hint + "\n" if self._hint else "")
            keys.append(" enter ", style="bold reverse")
            keys.append("  confirm   ")
            keys.append(" esc ", style="bold reverse")
            keys.append("  back")
            yield Static(keys, classes="menu-hint")

    def on_mount(self) -> None:
        self.query_one(_ReasonInput).focus()

    @on(Input.Submitted)
    def _confirm(self, event: Input.Submitted) -> None:
        event.stop()
        if self._required and not event.value.strip():
            self.query_one("#prompt-error", Static).update("This needs a text.")
            return
        self.dismiss(event.value)

    def action_back(self) -> None:
        self.dismiss(None)
