"""The live tree: one node per session of the root on screen, labelled by ``text.row_text``.

Nodes are kept by session id and relabelled in place, so an event redraws one line and
never moves the cursor. A session is never removed from a tree (a settled one stays,
struck through), and siblings come in creation order, so a listing only ever adds nodes:
each new one as the last child of its parent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from tether.tui.model import Model
from tether.tui.text import row_text

__all__ = ["SessionTree"]


class SessionTree(Tree[str]):
    """``↑``/``↓`` and ``j``/``k`` move; the node under the cursor is the session shown;
    ``Enter`` selects it (the app then opens its message box)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("down", "cursor_down", "move", key_display="↑↓ jk"),
        Binding("up", "cursor_up", "up", show=False),
        Binding("j", "cursor_down", "down", show=False),
        Binding("k", "cursor_up", "up", show=False),
        Binding("enter", "select_cursor", "message", key_display="⏎"),
    ]

    def __init__(self, model: Model, *, id: str | None = None) -> None:
        super().__init__(Text("(no root open)"), id=id)
        self.auto_expand = False
        self.guide_depth = 2
        self._model = model
        self._by_id: dict[str, TreeNode[str]] = {}
        # Called as a row that an event changed is drawn: (session, the event's ts).
        self.on_drawn: Callable[[str, float], None] | None = None

    def show(self, root: str) -> None:
        """Start over with ``root`` alone."""
        self.clear()
        self.root.data = root
        self.root.allow_expand = False
        self.root.expand()
        self._by_id = {root: self.root}
        self.redraw(root)
        self.move_cursor(self.root)

    def grow(self, new: Iterable[str]) -> None:
        """Add the sessions new to the tree (pre-order: a parent before its children)."""
        for sid in new:
            if sid in self._by_id:
                continue
            row = self._model.row(sid)
            parent = self._by_id.get(row.parent or "", self.root)
            # A node shows an expander only once it has children.
            parent.allow_expand = True
            node = parent.add(row_text(row, self._model), data=sid, expand=True)
            node.allow_expand = False
            self._by_id[sid] = node

    def redraw(self, sid: str) -> None:
        node = self._by_id.get(sid)
        if node is not None:
            node.set_label(row_text(self._model.row(sid), self._model))

    def redraw_all(self) -> None:
        for sid in self._by_id:
            self.redraw(sid)

    def select_session(self, sid: str) -> bool:
        node = self._by_id.get(sid)
        if node is None:
            return False
        self.move_cursor(node)
        return True

    def render_label(self, node: TreeNode[str], base_style: Style, style: Style) -> Text:
        label = super().render_label(node, base_style, style)
        if self.on_drawn is not None and node.data is not None:
            row = self._model.rows.get(node.data)
            if row is not None and row.drawn_ts is not None:
                ts, row.drawn_ts = row.drawn_ts, None
                self.on_drawn(node.data, ts)
        return label
