"""``TetherTui``: the terminal UI's screen, keys and the calls they make (SPEC §17.3).

The live tree of one root on the left, the selected session on the right (its facts and
its transcript following live, or its turns, or its inbox), the message box and a line for
what the last action did below, the keys in the footer. The tree is kept current by the
root's event stream (``stream.Feed``) and re-listed when an event speaks of a session it
does not hold (a spawn), now and then (a spawn with no prompt emits no event), and after
events were lost; budgets are read in batches. Every call runs off the screen's loop
(``background``), so a tree of a thousand sessions under a hundred events a second stays
responsive: an event costs a model update and one relabelled row. Pending approvals mark
their sessions (from ``approval`` events and the listings); ``A`` lists the tree's, where
they are decided.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Final

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer, Input, Static, Tree

from tether.cli.client import Client, RpcError
from tether.tui import actions
from tether.tui.approvals import Approvals
from tether.tui.background import Answer, in_background
from tether.tui.menus import KeyMenu, Prompt
from tether.tui.model import Model, Row
from tether.tui.report import Reports
from tether.tui.roots import RootPicker
from tether.tui.session import SessionPane
from tether.tui.stream import Feed
from tether.tui.text import one_line
from tether.tui.tree import SessionTree

__all__ = ["TetherTui"]

_RELIST_EVERY: Final = 10.0  # seconds: a spawn with no prompt emits no event
_BUDGETS_EVERY: Final = 30.0  # seconds between reads of every session's budget
_SPENDING_EVERY: Final = 2.0  # usage has no event: budgeted trees are read this often
_RELIST_GAP: Final = 0.25  # at most this often, however many events ask for it
_VIEW_DELAY: Final = 0.03  # a burst of the selected session's events: one read
_BUDGET_DELAY: Final = 0.15
_PAGE: Final = 500  # transcript entries a call
_PAGES: Final = 4  # a view read reads at most this many pages, then goes on next time

_STOP_ITEMS: Final = [
    ("s", "Steer: guidance it reads at its next boundary, then goes on", "steer"),
    ("c", "Cancel: it wraps up at its next boundary (killed after the grace)", "cancel"),
    ("a", "Abort: kill the turn's whole process tree now", "abort"),
    ("p", "Preempt: kill only its running command; the turn goes on", "preempt"),
]
_SUBTREE_ITEMS: Final = [
    ("c", "Cancel: each running turn wraps up at its next boundary", "cancel"),
    ("a", "Abort: kill every running turn's process tree now", "abort"),
]


class _EventsWaiting(Message):
    """The feed holds events (posted once per burst, from its thread)."""


class _Link(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class _Resync(Message):
    """Events were lost: read the tree, the view and the budgets again."""


class _MessageBox(Input):
    """The selected session's message box: ``Enter`` sends, ``Esc`` goes back to the tree."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "submit", "send", key_display="⏎"),
        Binding("escape", "app.leave_box", "back to the tree", key_display="esc"),
    ]


class TetherTui(App[None]):
    """``tether tui``: a root's tree, one session's view, every verb on a key."""

    TITLE = "tether tui"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #link { height: 1; background: $panel; padding: 0 1; }
    #main { height: 1fr; }
    #tree { width: 50%; border-right: solid $panel-lighten-2; overflow-x: hidden; }
    #session { width: 1fr; }
    #facts { height: auto; padding: 0 1; border-bottom: solid $panel-lighten-2; }
    #panes { height: 1fr; }
    #message { height: 3; }
    #outcome { height: 1; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop_menu", "stop", key_display="esc"),
        Binding("z", "pause", "pause/resume"),
        Binding("S", "subtree", "subtree stop"),
        Binding("A", "approvals", "approvals"),
        Binding("t", "pane('turns')", "turns"),
        Binding("i", "pane('inbox')", "inbox"),
        Binding("r", "report", "stop report"),
        Binding("o", "roots", "roots"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, client: Client, *, root: str | None = None, name: str | None = None) -> None:
        super().__init__()
        self.client = client
        self.me = name or None  # who the person is, said in markers ("by user NAME")
        self.model = Model()
        self.first_root = root
        self.feed: Feed | None = None
        self.link = "connecting"
        self.said = ""  # the outcome line, as plain text
        self._tree_busy = False
        self._tree_again = False
        self._tree_last = 0.0
        self._tree_timer = False
        self._view_busy = False
        self._view_again = False
        self._view_timer = False
        self._budget_timer = False
        self._budget_all = False
        self.tree_view = SessionTree(self.model, id="tree")
        self.pane = SessionPane(self.model, id="session")
        self._box = _MessageBox(
            placeholder="Message (Enter on a session to write here)", id="message"
        )
        self._link_line = Static(id="link")
        self._outcome = Static(id="outcome")
        self._approvals: Approvals | None = None  # the list of ``A``, while it is open

    # ---- the screen ---------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Held by the app, not queried: a query looks in the screen on top, and a menu
        # or the root picker may be on top when an event or an answer arrives.
        yield self._link_line
        with Horizontal(id="main"):
            yield self.tree_view
            yield self.pane
        yield self._box
        yield self._outcome
        yield Footer()

    def on_mount(self) -> None:
        self._show_link()
        self.set_interval(_RELIST_EVERY, self.schedule_tree)
        self.set_interval(_BUDGETS_EVERY, lambda: self.schedule_budgets(every=True))
        self.set_interval(_SPENDING_EVERY, self._spending)
        self.tree_view.focus()
        if self.first_root is not None:
            self.open_root(self.first_root)
        else:
            self.action_roots()

    def on_unmount(self) -> None:
        if self.feed is not None:
            self.feed.stop()

    def say(self, text: str, *, error: bool = False) -> None:
        """The outcome line: what the last action did, or why it was refused."""
        self.said = text
        line = Text(one_line(text, 400), style="bold red" if error else "")
        self._outcome.update(line)
        if self._approvals is not None:
            self._approvals.note(text, error=error)

    def refused(self, exc: RpcError) -> None:
        self.say(f"refused: {exc.code}: {exc.message}", error=True)

    def _show_link(self) -> None:
        root = self.model.rows.get(self.model.root or "")
        line = Text("tether tui", style="bold")
        line.append(f"  {self.client.url}")
        if root is not None:
            line.append(f"  root {one_line(root.label, 40)}")
        style = "green" if self.link == "live" else "bold yellow"
        line.append(f"  {self.link}", style=style)
        line.append(f"  as {self.me or 'user'}", style="dim")
        self._link_line.update(line)

    # ---- roots ---------------------------------------------------------------------

    def action_roots(self) -> None:
        def chosen(root: str | None) -> None:
            if root is not None:
                self.open_root(root)
            elif self.model.root is None:
                self.exit()

        self.push_screen(RootPicker(self.client), chosen)

    def open_root(self, root: str) -> None:
        """Show ``root``'s tree, following its event stream (connected before the tree is
        read, so nothing falls between)."""
        if self.feed is not None:
            self.feed.stop()
        self.model.open(root)
        self.tree_view.show(root)
        self.pane.open(root)
        self.feed = Feed(
            self.client,
            root,
            wake=lambda: self.post_message(_EventsWaiting()),
            status=lambda text: self.post_message(_Link(text)),
            resync=lambda: self.post_message(_Resync()),
        )
        self.feed.start()
        self._show_link()
        self.schedule_tree(now=True)
        self.schedule_view()

    @property
    def selected(self) -> Row | None:
        sid = self.pane.session
        return None if sid is None else self.model.rows.get(sid)

    @on(Tree.NodeHighlighted)
    def _highlighted(self, event: Tree.NodeHighlighted[str]) -> None:
        sid = event.node.data
        if sid is not None and sid != self.pane.session:
            self.pane.open(sid)
            self.schedule_view()

    # ---- the event stream ----------------------------------------------------------

    @on(_EventsWaiting)
    def _drain(self) -> None:
        if self.feed is None:
            return
        changed: set[str] = set()
        relist = budgets = view = approvals = False
        selected = self.pane.session
        for ev in self.feed.take():
            effect = self.model.apply(ev)
            if effect.in_tree:
                changed.add(effect.session)
            relist = relist or effect.relist
            budgets = budgets or effect.budgets
            view = view or effect.session == selected
            approvals = approvals or effect.approval
        for sid in changed:
            self.tree_view.redraw(sid)
        if approvals and self._approvals is not None:
            self._approvals.show()
        if view:
            self.pane.show_facts()
            self.schedule_view()
        if relist:
            self.schedule_tree()
        if budgets:
            self.schedule_budgets()

    @on(Answer)
    def _answer(self, message: Answer) -> None:
        message.deliver()

    @on(_Link)
    def _link(self, message: _Link) -> None:
        self.link = message.text
        self._show_link()

    @on(_Resync)
    def _resync(self) -> None:
        self.model.forget_event_state()
        self.schedule_tree(now=True)
        self.schedule_view()
        self.schedule_budgets(every=True)

    # ---- reading the tree, the view, the budgets -------------------------------------

    def schedule_tree(self, *, now: bool = False) -> None:
        """List the tree again soon: at most every _RELIST_GAP, one read at a time."""
        if self.model.root is None or self._tree_timer:
            return
        if self._tree_busy:
            self._tree_again = True
            return
        wait = 0.0 if now else max(0.0, self._tree_last + _RELIST_GAP - time.monotonic())
        self._tree_timer = True
        self.set_timer(wait or 0.001, self._read_tree)

    def _read_tree(self) -> None:
        self._tree_timer = False
        root = self.model.root
        if root is None:
            return
        self._tree_busy = True
        self._tree_last = time.monotonic()

        def work() -> tuple[Any, Any]:
            info = self.client.call("subagent.status", {"session": root})
            listing = self.client.call("subagent.list", {"root": root, "scope": "descendants"})
            return info, listing["agents"]

        def done(got: tuple[Any, Any]) -> None:
            self._tree_read_ended()
            if self.model.root != root:
                return
            first = not self.model.order and got[1]
            new, changed = self.model.set_tree(got[0], got[1])
            self.tree_view.grow(new)
            for sid in changed:  # a tree of a thousand: only the rows that changed
                self.tree_view.redraw(sid)
            self.pane.show_facts()
            if self._approvals is not None:
                self._approvals.show()
            self._show_link()
            if new or first:
                self.schedule_budgets(every=True)

        def failed(exc: RpcError) -> None:
            self._tree_read_ended()
            if self.model.root == root and not self.model.order:
                self.refused(exc)

        in_background(self, work, done, failed)

    def _tree_read_ended(self) -> None:
        self._tree_busy = False
        if self._tree_again:
            self._tree_again = False
            self.schedule_tree()

    def schedule_view(self) -> None:
        """Read the selected session again soon (a burst of its events: one read)."""
        if self._view_timer:
            return
        if self._view_busy:
            self._view_again = True
            return
        self._view_timer = True
        self.set_timer(_VIEW_DELAY, self._read_view)

    def _read_view(self) -> None:
        self._view_timer = False
        sid = self.pane.session
        if sid is None:
            return
        self._view_busy = True
        after = self.pane.last_seq
        call = self.client.call

        def work() -> dict[str, Any]:
            got: dict[str, Any] = {
                "info": call("subagent.status", {"session": sid}),
                "turns": call("subagent.turns", {"session": sid})["turns"],
                "inbox": call("subagent.inbox", {"session": sid})["messages"],
                "entries": [],
                "more": False,
            }
            at = after
            for _ in range(_PAGES):
                page = call("subagent.transcript", {"session": sid, "after": at, "limit": _PAGE})
                got["entries"] += page["entries"]
                got["more"] = page["more"]
                if page["entries"]:
                    at = int(page["entries"][-1]["seq"])
                if not page["more"]:
                    break
            return got

        def done(got: dict[str, Any]) -> None:
            self._view_read_ended()
            if self.pane.session != sid or self.pane.last_seq != after:
                self.schedule_view()  # the pane moved on meanwhile: read what it shows now
                return
            self.model.apply_info(got["info"])
            self.pane.append(got["entries"])
            self.pane.set_turns(got["turns"])
            self.pane.set_inbox(got["inbox"])
            self.pane.show_facts()
            self.tree_view.redraw(sid)
            if got["more"]:
                self.schedule_view()

        def failed(exc: RpcError) -> None:
            self._view_read_ended()
            if self.pane.session == sid and exc.code != "unreachable":
                self.refused(exc)

        in_background(self, work, done, failed)

    def _view_read_ended(self) -> None:
        self._view_busy = False
        if self._view_again:
            self._view_again = False
            self.schedule_view()

    def schedule_budgets(self, *, every: bool = False) -> None:
        """Read budgets soon: of the sessions known to have one and those never read;
        ``every``: of the whole tree (a budget may have been set anywhere)."""
        self._budget_all = self._budget_all or every
        if self._budget_timer or self.model.root is None:
            return
        self._budget_timer = True
        self.set_timer(_BUDGET_DELAY, self._read_budgets)

    def _spending(self) -> None:
        rows = [self.model.rows[s] for s in self.model.tree_ids() if s in self.model.rows]
        if any(r.state == "running" for r in rows) and any(r.own_budget for r in rows):
            self.schedule_budgets()

    def _read_budgets(self) -> None:
        self._budget_timer = False
        every, self._budget_all = self._budget_all, False
        root = self.model.root
        rows = self.model.rows
        ids = [
            s
            for s in self.model.tree_ids()
            if every or s not in rows or not rows[s].budget_read or rows[s].own_budget
        ]
        if not ids:
            return

        def work() -> list[tuple[str, Any]]:
            answers = self.client.batch([("subagent.budget", {"session": s}) for s in ids])
            return list(zip(ids, answers, strict=True))

        def done(got: list[tuple[str, Any]]) -> None:
            if self.model.root != root:
                return
            changed = False
            for sid, answer in got:
                if isinstance(answer, dict):  # a refusal: keep what was known
                    changed = self.model.set_budget(sid, answer.get("budget")) or changed
            if changed:  # a bar may be an ancestor's: every row is drawn again
                self.tree_view.redraw_all()
                self.pane.show_facts()

        in_background(self, work, done, lambda exc: None)

    # ---- the verbs -----------------------------------------------------------------

    @on(Tree.NodeSelected)
    def _open_box(self, event: Tree.NodeSelected[str]) -> None:
        row = self.selected
        if row is None:
            return
        blocked = self.model.send_blocked(row)
        if blocked is not None:
            self.say(f"Send is off: {blocked}.", error=True)
            return
        box = self._box
        box.placeholder = f"Message to {one_line(row.label, 40)} (Enter sends, Esc goes back)"
        box.focus()

    def action_leave_box(self) -> None:
        self.tree_view.focus()

    @on(Input.Submitted, "#message")
    def _send(self, event: Input.Submitted) -> None:
        row = self.selected
        content = event.value
        if row is None or not content.strip():
            return
        event.input.value = ""
        in_background(
            self,
            lambda: actions.send(self.client, row, content, self.me),
            self._did,
            self.refused,
        )

    def _did(self, line: str) -> None:
        self.say(line)
        self.schedule_view()

    def action_stop_menu(self) -> None:
        row = self.selected
        if row is None:
            return
        if not row.running:
            below = (
                " (S stops the sessions running below it)"
                if self.model.running_below(row.id)
                else ""
            )
            self.say(f"nothing to stop: {row.label} has no running turn{below}")
            return
        target = actions.Target.of(row)  # the turn on screen now is the one stopped

        def chosen(kind: str | None) -> None:
            if kind is None:
                return
            hint = {
                "steer": "The agent reads this at its next boundary and goes on.",
                "cancel": "The agent wraps up at its next boundary; after the grace it is killed.",
                "abort": "Kills the turn's whole process tree now.",
                "preempt": "Kills only the running command; the turn goes on.",
            }[kind]
            title = f"{kind.capitalize()} {target.label}, turn {target.turn}"

            def reason(text: str | None) -> None:
                if text is None:
                    return
                in_background(
                    self,
                    lambda: actions.stop(self.client, target, kind, text, self.me),
                    self._did,
                    self.refused,
                )

            self.push_screen(Prompt(title, hint, required=kind == "steer"), reason)

        self.push_screen(KeyMenu(f"Stop {target.label}, turn {target.turn}", _STOP_ITEMS), chosen)

    def action_pause(self) -> None:
        row = self.selected
        if row is None:
            return
        target = actions.Target.of(row)
        if row.state == "paused":
            in_background(
                self, lambda: actions.resume(self.client, target, self.me), self._did, self.refused
            )
            return
        if not row.running:
            self.say(f"nothing to pause: {row.label} has no running turn")
            return

        def reason(text: str | None) -> None:
            if text is None:
                return
            in_background(
                self,
                lambda: actions.pause(self.client, target, text, self.me),
                self._did,
                self.refused,
            )

        hint = "Freezes the turn in place, its commands too, until z resumes it."
        self.push_screen(Prompt(f"Pause {target.label}, turn {target.turn}", hint), reason)

    def action_subtree(self) -> None:
        row = self.selected
        if row is None:
            return
        if not row.running and not self.model.running_below(row.id):
            self.say(f"nothing to stop: nothing runs in the subtree of {row.label}")
            return
        target = actions.Target.of(row)

        def chosen(kind: str | None) -> None:
            if kind is None:
                return

            def reason(text: str | None) -> None:
                if text is None:
                    return
                in_background(
                    self,
                    lambda: actions.subtree_stop(self.client, target, kind, text, self.me),
                    self._did,
                    self.refused,
                )

            title = f"{kind.capitalize()} the subtree of {target.label}"
            hint = "Each running turn below it too, each on its own turn."
            self.push_screen(Prompt(title, hint), reason)

        self.push_screen(KeyMenu(f"Stop the subtree of {target.label}", _SUBTREE_ITEMS), chosen)

    def action_pane(self, name: str) -> None:
        shown = self.pane.switch(name)
        self.say(
            f"showing the {shown}" + (" (the same key goes back)" if shown != "transcript" else "")
        )
        self.schedule_view()

    def action_report(self) -> None:
        row = self.selected
        if row is None:
            return
        if not self.pane.stops:
            self.say(f"no stop marker in the transcript of {row.label}: no stop report to show")
            return
        self.push_screen(Reports(self.client, row.label, self.pane.stops))

    # ---- approvals -----------------------------------------------------------------

    def action_approvals(self) -> None:
        """The tree's pending approvals (read again as the list opens)."""
        root = self.model.rows.get(self.model.root or "")
        if root is None or self._approvals is not None:
            return
        screen = Approvals(
            self.model,
            self.decide,
            lambda text: self.say(text, error=True),
            title=f"Tool calls waiting for a decision in the tree of {one_line(root.label, 40)}",
        )
        self._approvals = screen

        def closed(_: None) -> None:
            if self._approvals is screen:
                self._approvals = None

        self.push_screen(screen, closed)
        self.read_approvals()

    def read_approvals(self) -> None:
        """Read the tree's pending approvals whole (a listing names them only by id)."""
        root = self.model.root
        if root is None:
            return

        def work() -> list[dict[str, Any]]:
            params = {"session": root, "scope": "subtree"}
            return list(self.client.call("subagent.approvals", params)["approvals"])

        def done(listed: list[dict[str, Any]]) -> None:
            if self.model.root == root:
                self._approvals_changed(self.model.set_approvals(listed))

        in_background(self, work, done, self.refused)

    def _approvals_changed(self, sessions: set[str]) -> None:
        for sid in sessions:
            self.tree_view.redraw(sid)
        if self.pane.session in sessions:
            self.pane.show_facts()
        if self._approvals is not None:
            self._approvals.show()

    def decide(self, a: dict[str, Any], decision: str, reason: str | None, arguments: Any) -> None:
        """Approve or deny ``a`` with the authority the stop menu uses: its session's parent
        as the tree holds it (a root's own id) and ``--as`` NAME."""
        sid = str(a["session"])
        row = self.model.rows.get(sid)
        parent = (row.parent or row.id) if row is not None and self.model.in_tree(sid) else None
        aid = str(a["id"])

        def work() -> tuple[str, dict[str, Any]]:
            return actions.decide(
                self.client, aid, parent, decision, self.me, reason=reason, arguments=arguments
            )

        def done(got: tuple[str, dict[str, Any]]) -> None:
            line, decided = got
            self.model.approval_seen(decided)
            self._approvals_changed({sid})
            self.say(line)
            self.schedule_view()

        def failed(exc: RpcError) -> None:
            self.refused(exc)
            if exc.code in ("already-decided", "not-found"):
                self.read_approvals()  # the list on screen is behind: read it again

        in_background(self, work, done, failed)
