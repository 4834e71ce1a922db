"""What the terminal UI draws, as Rich ``Text``: tree rows, transcript entries, turns,
pending messages, budget bars, markers.

Everything that came from a model, a tool or a person is shown with its control characters
escaped (``cli._terminal.shown``) and put in a ``Text`` as plain text, never parsed as
markup, so a reason of ``[bold]`` or ``\\x1b[2J`` reads as written. Markers are drawn from
their fields (the raw reason), as the web console draws them, not from the text escaped for
models.
"""

from __future__ import annotations

from typing import Any, Final

from rich.text import Text

from tether.cli._terminal import shown
from tether.tui.model import Gauge, Model, Row
from tether.wire.approval import call_text
from tether.wire.budget import spent_text
from tether.wire.text import who

__all__ = [
    "STATE_STYLE",
    "STOPS",
    "approval_mark",
    "approval_text",
    "bar",
    "entry_text",
    "facts_text",
    "inbox_text",
    "marker_line",
    "one_line",
    "row_text",
    "turn_text",
]

STATE_STYLE: Final = {
    "running": "bold green",
    "paused": "bold cyan",  # frozen in place until resumed (semantics §14.4)
    "idle": "dim",
    "parked": "yellow",
    "disposing": "magenta",
    "dormant": "dim italic",
    "settled": "dim strike",
}
# Markers of a stop that may have a report (semantics §15.6): `r` shows it.
STOPS: Final = frozenset({"cancelled", "aborted", "preempted", "forced", "escalated"})
_VERBS: Final = {
    "steered": ("↪", "Steered"),  # guidance the turn goes on with: not a stop's ⊘
    "cancelled": ("⊘", "Cancelled"),
    "aborted": ("⊘", "Aborted"),
    "preempted": ("⊘", "Preempted"),
    "paused": ("‖", "Paused"),  # U+2016, as the console: every terminal font has it
    "resumed": ("▶", "Resumed"),
}
_MARKER_STYLE: Final = {"steered": "cyan", "paused": "cyan", "resumed": "green"}
_BAR: Final = 10  # cells of a budget bar


def one_line(text: str, width: int) -> str:
    """``text`` on one line (whitespace runs as one space), cut to ``width`` with ``…``."""
    flat = " ".join(shown(text).split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _who(origin: str | None, by: str | None, short: bool) -> str:
    if origin is None:
        return "?"
    if short and origin not in ("user", "watchdog", "budget"):
        return origin  # the tree leaves out an agent's id: the session view has it
    return who(origin, by)


def marker_line(entry: dict[str, Any], *, short: bool = False) -> str:
    """A marker as a person reads it: ``⊘ Cancelled by user alice: reason``."""
    action = entry.get("action")
    origin, by, reason = entry.get("origin"), entry.get("by"), entry.get("reason") or ""
    if action == "discarded":
        stop = (entry.get("data") or {}).get("stop")
        why = f"the {stop} came first" if stop else "the turn ended first"
        return f"⊘ Discarded steer by {_who(origin, by, short)} ({why}): {reason}"
    if not action:
        return str(entry.get("text") or "")
    sign, verb = _VERBS.get(str(action), ("⊘", str(action).capitalize()))
    by_part = f" by {_who(origin, by, short)}" if action in _VERBS and origin else ""
    return f"{sign} {verb}{by_part}" + (f": {reason}" if reason else "")


def state_text(row: Row) -> str:
    """As ``tether tree`` says it: a claimed turn no worker has taken yet is waiting."""
    if row.state == "running" and row.dispatched is False:
        return "waiting for a worker"
    return row.state


def bar(g: Gauge, model: Model, *, width: int = _BAR, whose: bool = True) -> Text:
    """A budget bar and its words (``1,200 of 2,000 tokens``): amber at soft, red once
    exhausted; with ``whose``, a bar of an ancestor's budget says whose (the session
    pane's does; a tree row's ancestor is drawn above it)."""
    filled = min(width, round(min(1.0, g.fraction) * width))
    style = {"soft": "yellow", "exhausted": "bold red"}.get(g.state, "green")
    out = Text("▕", style="dim")
    out.append("█" * filled, style=style)
    out.append("░" * (width - filled), style="dim")
    out.append("▏ ", style="dim")
    words = spent_text(g.key, g.spent, g.limit)
    if whose and not g.own:
        owner = model.rows.get(g.owner)
        words += f" ({shown(owner.label if owner else g.owner)}'s tree)"
    if g.state != "ok":
        words += f" · {g.state}"
    out.append(words, style=style if g.state != "ok" else "")
    return out


def approval_mark(count: int) -> str:
    """The mark of a session with pending approvals: ``! approval``, ``! 2 approvals``."""
    return "! approval" if count == 1 else f"! {count} approvals"


def approval_text(a: dict[str, Any], model: Model) -> Text:
    """A pending approval in the list of ``A``: the call (one line, as the model wrote
    it), whose it is, and who may decide when only a person may."""
    out = Text()
    if "tool" in a:
        out.append(one_line(call_text(str(a["tool"]), a.get("arguments")), 90), style="bold")
    else:
        out.append("(reading the call…)", style="dim italic")
    row = model.rows.get(str(a.get("session")))
    out.append(f"  {one_line(row.label if row else str(a.get('session')), 40)}")
    if a.get("approver") == "user":
        out.append("  (a person decides)", style="dim")
    out.append(f"  {a.get('id')}", style="dim")
    return out


def row_text(row: Row, model: Model) -> Text:
    """A tree row: name, state, stopping, pending count, the mark of pending approvals,
    last marker, budget bar."""
    out = Text(one_line(row.label, 40), style="bold")
    state = state_text(row)
    out.append("  ")
    out.append(state, style=STATE_STYLE.get(row.state, ""))
    if row.stopping:
        out.append(f"  stopping: {row.stopping}", style="bold red")
    if row.pending:
        out.append(f"  {row.pending} pending", style="yellow")
    if row.approvals:
        out.append(f"  {approval_mark(row.approvals)}", style="bold magenta")
    if row.marker is not None:
        action = str(row.marker.get("action") or "")
        out.append("  ")
        style = _MARKER_STYLE.get(action, "red")
        out.append(one_line(marker_line(row.marker, short=True), 48), style)
    gauge = model.gauge(row.id)
    if gauge is not None:
        out.append("  ")
        out.append_text(bar(gauge, model, whose=False))
    return out


def entry_text(entry: dict[str, Any]) -> Text:
    """One transcript entry: ``[seq] kind: text`` (a marker drawn from its fields; a
    reply that is only tool calls names them)."""
    kind = str(entry.get("kind") or "?")
    out = Text(f"[{entry.get('seq')}] ", style="dim")
    if kind == "marker":
        action = str(entry.get("action") or "")
        out.append(shown(marker_line(entry)), style=_MARKER_STYLE.get(action, "bold red"))
        if action in STOPS and entry.get("turn"):
            out.append("  (r: stop report)", style="dim")
        return out
    style = {"user": "bold", "notice": "magenta", "tool": "blue"}.get(kind, "")
    out.append(f"{kind}: ", style=style or "bold green")
    data = entry.get("data") or {}
    calls = data.get("tool_calls") if isinstance(data, dict) else None
    names = [str((c.get("function") or {}).get("name") or "?") for c in calls or ()]
    text = str(entry.get("text") or "")
    if names:
        text += ("  " if text else "") + f"(calls {', '.join(names)})"
    out.append(shown(text) or "(no text)")
    return out


def turn_text(t: dict[str, Any]) -> Text:
    """A turn: id, outcome, who ended it and why (newest first in the pane)."""
    outcome = str(t.get("outcome") or "running")
    style = {"running": "bold green", "completed": "", "failed": "bold red"}.get(outcome, "red")
    out = Text(str(t.get("id")), style="dim")
    out.append(f"  {outcome}", style=style)
    bits = []
    if t.get("cause"):
        bits.append(f"by {shown(who(str(t['cause']), t.get('by')))}")
    if t.get("forced"):
        bits.append("forced")
    if t.get("escalated"):
        bits.append("escalated")
    if t.get("message"):
        bits.append(f"message {t['message']}")
    if bits:
        out.append("  " + " · ".join(bits))
    if t.get("reason"):
        out.append(f"  {one_line(str(t['reason']), 120)}", style="italic")
    if t.get("error"):
        out.append(f"  error: {one_line(str(t['error']), 120)}", style="red")
    return out


def inbox_text(m: dict[str, Any]) -> Text:
    """A pending message: id, kind, sender, preview."""
    out = Text(str(m.get("id")), style="dim")
    sender = m.get("sender")
    out.append(f"  {m.get('kind')}" + (f" from {shown(str(sender))}" if sender else ""))
    out.append(f": {one_line(str(m.get('preview') or ''), 160)}")
    return out


def facts_text(row: Row, model: Model) -> Text:
    """The head of the session pane: name, state, pending, running turn, budget."""
    out = Text(one_line(row.label, 60), style="bold")
    out.append(f"  {row.id}", style="dim")
    out.append("\nstate ")
    out.append(state_text(row), style=STATE_STYLE.get(row.state, ""))
    if row.stopping:
        out.append(f"  stopping: {row.stopping}", style="bold red")
    out.append(f"  ·  {row.pending} pending")
    if row.approvals:
        out.append(f"  ·  {approval_mark(row.approvals)} (A)", style="bold magenta")
    out.append(f"\nturn {row.turn or '—'}")
    out.append("\n" + ("a root" if row.parent is None else f"parent {row.parent}"), "dim")
    gauge = model.gauge(row.id)
    if gauge is not None:
        out.append("\nbudget ")
        out.append_text(bar(gauge, model, width=20))
    return out
