"""The pending approvals of the tree on screen (``A``; semantics §17.2), oldest first.

The call under the cursor shows whole below the list; ``y`` approves it, ``n`` denies it
(asking a reason: the model reads who denied it and why), ``e`` edits its arguments (a
JSON prompt filled with the model's) and approves it with those, ``Esc`` backs out. The
list follows the app's model, which the event stream keeps current, so a call asked or
decided elsewhere comes and goes while it is open. The calls are the app's
(``decide``), and so is the outcome line (``say``, shown here too by the app's ``note``):
a refusal is one line, here and under the message box.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from tether.cli._terminal import json_line, shown
from tether.tui.actions import UNSET
from tether.tui.menus import Prompt
from tether.tui.model import Model
from tether.tui.text import approval_text, one_line

__all__ = ["Approvals", "Decide", "Say"]

# (approval, "approve" | "deny", reason, arguments or UNSET)
Decide = Callable[[dict[str, Any], str, str | None, Any], None]
Say = Callable[[str], None]  # a refusal, on the outcome line


class Approvals(ModalScreen[None]):
    """``↑``/``↓`` choose a pending call; ``y``, ``n``, ``e`` decide it; ``Esc`` backs out."""

    DEFAULT_CSS = """
    Approvals { align: center middle; background: $background 60%; }
    Approvals > Vertical {
        width: 110; max-width: 95%; height: auto; max-height: 90%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    Approvals OptionList { height: auto; max-height: 12; }
    Approvals #call { height: auto; max-height: 10; padding-top: 1; }
    Approvals #approvals-note { height: auto; padding-top: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back", "back"),
        Binding("y", "approve", "approve"),
        Binding("n", "deny", "deny"),
        Binding("e", "edit", "edit"),
    ]

    def __init__(self, model: Model, decide: Decide, refuse: Say, *, title: str) -> None:
        super().__init__()
        self._model = model
        self._decide = decide
        self._refuse = refuse
        self._title = title
        self.ids: list[str] = []  # the approvals listed, in order
        self.note_text = ""  # the last outcome shown here, as plain text
        self._mounted = False

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self._title, style="bold"))
            yield OptionList(id="approvals")
            yield Static("", id="call")
            yield Static("", id="approvals-note")
            keys = Text()
            for key, label in (("↑↓", "choose"), ("y", "approve"), ("n", "deny")):
                keys.append(f" {key} ", style="bold reverse")
                keys.append(f"  {label}   ")
            keys.append(" e ", style="bold reverse")
            keys.append("  edit the arguments, then approve   ")
            keys.append(" esc ", style="bold reverse")
            keys.append("  back")
            yield Static(keys, classes="menu-hint")

    @property
    def _ready(self) -> bool:
        """Composed and on the app (an answer may come before it is, or after it left)."""
        return self._mounted and self.is_attached

    def on_mount(self) -> None:
        self._mounted = True
        self.query_one(OptionList).focus()
        self.show()

    def show(self) -> None:
        """List the model's pending approvals again, the cursor kept on the same one."""
        if not self._ready:
            return
        options = self.query_one(OptionList)
        keep = self.current()
        pending = self._model.pending_approvals()
        self.ids = [str(a["id"]) for a in pending]
        options.set_options(
            [Option(approval_text(a, self._model), id=str(a["id"])) for a in pending]
        )
        if self.ids:
            at = self.ids.index(str(keep["id"])) if keep and keep["id"] in self.ids else 0
            options.highlighted = at
        self._show_call()

    def current(self) -> dict[str, Any] | None:
        """The approval under the cursor."""
        if not self._ready:
            return None
        option = self.query_one(OptionList).highlighted_option
        if option is None or option.id is None:
            return None
        return self._model.approvals.get(option.id)

    @on(OptionList.OptionHighlighted)
    def _highlighted(self) -> None:
        self._show_call()

    def _show_call(self) -> None:
        if not self._ready:
            return
        a = self.current()
        if a is None:
            text = Text("No tool call waits for a decision in this tree.", style="dim")
        elif "tool" not in a:
            text = Text("reading the call…", style="dim")
        else:
            text = Text(f"{shown(str(a['tool']))} ", style="bold")
            text.append(shown(json.dumps(a.get("arguments"), ensure_ascii=False, indent=1)))
            row = self._model.rows.get(str(a.get("session")))
            text.append(f"\nsession {one_line(row.label if row else '?', 40)}", style="dim")
            text.append(f" {a.get('session')}, turn {a.get('turn')}", style="dim")
        self.query_one("#call", Static).update(text)

    def note(self, text: str, *, error: bool = False) -> None:
        """The outcome of the last decision (or why it was refused), on one line."""
        if not self._ready:
            return
        self.note_text = text
        line = Text(one_line(text, 300), style="bold red" if error else "")
        self.query_one("#approvals-note", Static).update(line)

    def _chosen(self) -> dict[str, Any] | None:
        a = self.current()
        if a is None:
            self.note("nothing to decide: no tool call waits in this tree")
        return a

    def action_approve(self) -> None:
        a = self._chosen()
        if a is not None:
            self._decide(a, "approve", None, UNSET)

    def action_deny(self) -> None:
        a = self._chosen()
        if a is None:
            return

        def reason(text: str | None) -> None:
            if text is not None:
                self._decide(a, "deny", text, UNSET)

        hint = "The model reads who denied it and why (`denied by user NAME: …`), and goes on."
        self.app.push_screen(Prompt(f"Deny {_call(a)}", hint, required=True), reason)

    def action_edit(self) -> None:
        a = self._chosen()
        if a is None:
            return
        if "tool" not in a:
            self.note("reading the call: press e again in a moment")
            return

        def edited(text: str | None) -> None:
            if text is None:
                return
            try:
                arguments = json.loads(text)
            except ValueError as exc:
                self._refuse(f"refused: the arguments are not JSON: {exc}")
                return
            self._decide(a, "approve", None, arguments)

        hint = "Approves the call with these arguments (JSON, checked against the tool's schema)."
        value = json_line(a.get("arguments"))  # the same JSON value, safe on a terminal
        prompt = Prompt(f"Edit {_call(a)}", hint, required=True, value=value, placeholder="JSON")
        self.app.push_screen(prompt, edited)

    def action_back(self) -> None:
        self.dismiss(None)


def _call(a: dict[str, Any]) -> str:
    return f"{one_line(str(a.get('tool')), 40)} ({a.get('id')})"
