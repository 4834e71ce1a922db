"""What the terminal UI knows of the tree on screen, kept current by the event stream.

Sessions are kept by id (``Row``): the root's tree in pre-order, each session's state,
its last marker while that describes it, and its budget as last read. A session's state
comes from the ``state`` events once one has been seen for it (the stream is in order and
every transition emits one, so the last event applied is the truth as of its time); a
listing fills only the sessions the stream has not spoken of yet, and a ``gap`` on the
stream forgets that. The web console keeps the same rules (``serve/web/state.js``).

Pending approvals (semantics §17.2) are kept by id: from ``approval`` events (the whole
``Approval``), from listings (``AgentInfo.approvals``: ids only) and from reads of
``subagent.approvals``. A decision seen is final (a listing read before it never brings
the approval back), and an approval asked on the stream stays until the stream says it
was decided (a listing read before it was asked never drops it); a ``gap`` forgets the
latter, so the next listing is the truth again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "BUDGET_EVENTS",
    "ENDS_TURN",
    "OFFLINE",
    "Effect",
    "Gauge",
    "Model",
    "Row",
    "marker_stands",
]

STATE_FIELDS: Final = ("state", "pending", "stopping", "turn")
# A session in one of these states takes no message from a person (a subagent's parent
# must be live for a send).
OFFLINE: Final = frozenset({"dormant", "settled", "disposing"})
# Stops that end their turn: their marker says why the session is parked until a later turn
# starts. Any other marker (a steer, a preempt, a pause) speaks of its running turn.
ENDS_TURN: Final = frozenset({"cancelled", "aborted", "forced", "escalated"})
# Events after which a tree may have spent (a turn started or ended, a budget's marker), or
# a budget's state changed (``budget``: a crossing, a budget set).
BUDGET_EVENTS: Final = frozenset({"turn.started", "turn.ended", "marker", "budget"})
_LIMITS: Final = ("tokens", "cost_usd", "turn_seconds", "turns")
_RANK: Final = {"ok": 0, "soft": 1, "exhausted": 2}
_MAX_DEPTH: Final = 64  # as the runtime's lineage walk


@dataclass
class Row:
    """One session as the screen shows it (``AgentInfo``'s fields, and what events add)."""

    id: str
    slug: str | None = None
    parent: str | None = None
    depth: int = 0
    mode: str = "continuable"
    state: str = "?"
    pending: int = 0
    stopping: str | None = None
    turn: str | None = None
    dispatched: bool | None = None  # None: unknown until listed again
    marker: dict[str, Any] | None = None  # the last marker entry, while it describes it
    budget: dict[str, Any] | None = None  # its BudgetStatus as last read
    budget_read: bool = False
    from_events: bool = False  # its state fields come from the event stream
    drawn_ts: float | None = None  # the newest event applied and not yet drawn (its ts)
    approvals: int = 0  # its pending approvals, as far as the screen knows

    @property
    def label(self) -> str:
        """The name a person reads: the slug, else the id."""
        return self.slug or self.id

    def address(self) -> dict[str, str]:
        """The RPC address: the caller acts as ``User(parent=…)``; a root's owner is
        addressed by the root's own id."""
        return {"session": self.id, "parent": self.parent or self.id, "mode": "continuable"}

    @property
    def running(self) -> bool:
        """A turn runs (paused included): what a stop or a pause acts on."""
        return self.turn is not None and self.state != "settled"

    def shown(self) -> tuple[Any, ...]:
        """What a row draws from a listing: a change here is a row to draw again."""
        return (
            self.slug,
            self.state,
            self.pending,
            self.stopping,
            self.turn,
            self.dispatched,
            self.approvals,
        )

    @property
    def own_budget(self) -> bool:
        return self.budget is not None and self.budget.get("budget") is not None


@dataclass(frozen=True)
class Gauge:
    """A budget bar: the limit shown (the one of the budget that set the state, else the
    fullest), how much of it is spent, the state, and whose budget it is."""

    key: str
    spent: float
    limit: float
    state: str
    owner: str
    own: bool

    @property
    def fraction(self) -> float:
        return self.spent / self.limit if self.limit else 1.0


@dataclass(frozen=True)
class Effect:
    """What one event changed: which row, and what must be read again."""

    session: str
    in_tree: bool  # the session is on the tree on screen
    relist: bool  # the tree's shape may have changed (a new session), or a fact no event
    # carries (whether a worker took the turn) is unknown
    budgets: bool  # a budget may have moved
    approval: bool = False  # an approval was asked or decided


def marker_stands(marker: dict[str, Any], event: str, data: dict[str, Any]) -> bool:
    """Whether a session's last marker still describes it after one of its events."""
    turn = data.get("turn")
    if event == "turn.started":
        return turn == marker.get("turn")
    if event == "turn.ended":
        return turn != marker.get("turn") or marker.get("action") in ENDS_TURN
    return True


@dataclass
class Model:
    """The root on screen and its tree; every session seen, by id."""

    root: str | None = None
    order: list[str] = field(default_factory=list)  # the root's descendants, pre-order
    rows: dict[str, Row] = field(default_factory=dict)
    # The tree's pending approvals by id: an ``Approval`` as the server sent it, or only
    # ``{"id", "session"}`` while a listing is all that named it.
    approvals: dict[str, dict[str, Any]] = field(default_factory=dict)
    _in_tree: set[str] = field(default_factory=set)
    _asked: set[str] = field(default_factory=set)  # pending by an event of the stream
    _decided: set[str] = field(default_factory=set)  # decided, expired or cancelled

    def row(self, sid: str) -> Row:
        got = self.rows.get(sid)
        if got is None:
            got = self.rows[sid] = Row(sid)
        return got

    def open(self, root: str) -> None:
        """Show ``root``'s tree (read with ``set_tree``)."""
        self.root = root
        self.order = []
        self._in_tree = {root}
        for a in self.approvals.values():
            self.row(str(a.get("session"))).approvals = 0
        self.approvals = {}
        self._asked = set()

    def in_tree(self, sid: str) -> bool:
        return sid in self._in_tree

    def apply_info(self, info: dict[str, Any]) -> Row:
        """Merge an ``AgentInfo`` read by a call: its state only where no event spoke."""
        row = self.row(str(info["id"]))
        row.slug = info.get("slug")
        row.parent = info.get("parent")
        row.depth = int(info.get("depth") or 0)
        row.mode = str(info.get("mode") or "continuable")
        row.dispatched = info.get("dispatched")
        if not row.from_events:
            row.state = str(info["state"])
            row.pending = int(info.get("pending") or 0)
            row.stopping = info.get("stopping")
            row.turn = info.get("turn")
        ids = info.get("approvals")
        if isinstance(ids, list | tuple):
            self._reconcile({row.id}, [{"id": str(i), "session": row.id} for i in ids])
        return row

    # ---- approvals -------------------------------------------------------------------

    def _reconcile(self, sessions: set[str], listed: list[dict[str, Any]]) -> set[str]:
        """A read of the pending approvals of ``sessions`` (``listed``): the sessions whose
        count it changed. A listing's bare id never replaces an approval known whole."""
        touched: set[str] = set()
        ids = {str(a["id"]) for a in listed}
        for a in listed:
            aid = str(a["id"])
            if aid in self._decided:
                continue
            known = self.approvals.get(aid)
            if known is None or "tool" in a or "tool" not in known:
                self.approvals[aid] = a
            touched.add(str(a["session"]))
        for aid, a in list(self.approvals.items()):
            sid = str(a.get("session"))
            if sid in sessions and aid not in ids and aid not in self._asked:
                del self.approvals[aid]
                touched.add(sid)
        return {sid for sid in touched if self._recount(sid)}

    def _recount(self, sid: str) -> bool:
        row = self.row(sid)
        count = sum(1 for a in self.approvals.values() if a.get("session") == sid)
        changed = row.approvals != count
        row.approvals = count
        return changed

    def set_approvals(self, listed: list[dict[str, Any]]) -> set[str]:
        """A read of ``subagent.approvals`` of the root, ``scope: subtree``: the sessions
        whose count changed."""
        return self._reconcile(set(self.tree_ids()), listed)

    def approval_seen(self, a: dict[str, Any]) -> bool:
        """An ``Approval`` from an event or a decision's answer: whether a count changed."""
        aid, sid = str(a.get("id")), str(a.get("session"))
        if a.get("state") == "pending":
            if aid in self._decided:
                return False
            self._asked.add(aid)
            self.approvals[aid] = a
        else:
            self._decided.add(aid)
            self._asked.discard(aid)
            self.approvals.pop(aid, None)
        return self._recount(sid)

    def pending_approvals(self) -> list[dict[str, Any]]:
        """The tree's pending approvals, oldest first (those known only by id last)."""
        tree = set(self.tree_ids())
        found = [a for a in self.approvals.values() if a.get("session") in tree]
        return sorted(found, key=lambda a: (a.get("requested_at") is None, a.get("requested_at")))

    def set_tree(
        self, root: dict[str, Any], agents: list[dict[str, Any]]
    ) -> tuple[list[str], list[str]]:
        """A fresh listing of the root (``subagent.status``) and its descendants
        (``subagent.list``): the ids new to the tree, in pre-order, and the ids of the
        sessions whose row it changed."""
        changed: list[str] = []
        for info in [root, *agents]:
            row = self.rows.get(str(info["id"]))
            before = None if row is None else row.shown()
            if self.apply_info(info).shown() != before:
                changed.append(str(info["id"]))
        order = [str(a["id"]) for a in agents]
        new = [sid for sid in order if sid not in self._in_tree]
        self.order = order
        self._in_tree = {str(root["id"]), *order}
        return new, changed

    def set_budget(self, sid: str, status: dict[str, Any] | None) -> bool:
        """A budget read for ``sid``: whether it changed what the screen shows."""
        row = self.row(sid)
        changed = not row.budget_read or row.budget != status
        row.budget = status
        row.budget_read = True
        return changed

    def apply(self, ev: dict[str, Any]) -> Effect:
        """One event from ``/events`` (its JSON payload: ``event``, ``session``,
        ``lineage``, ``data``, ``ts``)."""
        sid = str(ev.get("session") or "")
        name = str(ev.get("event") or "")
        data = ev.get("data") or {}
        known = sid in self.rows
        row = self.row(sid)
        if name == "state":
            turn = row.turn
            for key in STATE_FIELDS:
                setattr(row, key, data.get(key))
            row.state = str(row.state)
            row.pending = int(row.pending or 0)
            row.from_events = True
            if row.turn != turn:
                row.dispatched = None  # unknown until listed again
        elif name == "marker":
            row.marker = data.get("entry")
        elif name == "budget" and not row.own_budget:
            row.budget_read = False  # a budget set where none was: read it again
        elif name == "approval" and isinstance(data.get("approval"), dict):
            self.approval_seen(data["approval"])
        if row.marker is not None and not marker_stands(row.marker, name, data):
            row.marker = None
        if ev.get("ts") is not None:
            row.drawn_ts = float(ev["ts"])
        in_tree = self.in_tree(sid)
        lineage = ev.get("lineage") or ()
        belongs = self.root is not None and (sid == self.root or self.root in lineage)
        unsure = row.state == "running" and row.dispatched is None
        tool = name == "entry" and (data.get("entry") or {}).get("kind") == "tool"
        return Effect(
            session=sid,
            in_tree=in_tree,
            relist=belongs and (not known or not in_tree or unsure or tool),
            budgets=belongs and name in BUDGET_EVENTS,
            approval=name == "approval",
        )

    def forget_event_state(self) -> None:
        """Events were lost (a ``gap``): the next listing is the truth again."""
        for row in self.rows.values():
            row.from_events = False
        self._asked = set()

    def tree_ids(self) -> list[str]:
        """The root and its descendants, pre-order."""
        return [] if self.root is None else [self.root, *self.order]

    def running_below(self, sid: str) -> bool:
        """Whether a session below ``sid`` (as far as the screen knows) has a turn running."""
        for other in self.rows.values():
            if not other.running or other.mode == "one-shot":
                continue
            up, steps = other.parent, 0
            while up is not None and steps <= _MAX_DEPTH:
                if up == sid:
                    return True
                parent = self.rows.get(up)
                up, steps = (parent.parent if parent else None), steps + 1
        return False

    def send_blocked(self, row: Row) -> str | None:
        """Why a person cannot send to ``row`` now, or None."""
        if row.mode == "one-shot":
            return f"{row.label} is a one-shot subagent: it belongs to the holder of its handle"
        if row.state in ("settled", "disposing"):
            return f"{row.label} is {row.state}: it takes no more messages"
        parent = self.rows.get(row.parent) if row.parent else None
        if parent is not None and parent.state in OFFLINE:
            return (
                f"its parent {parent.label} is {parent.state} (offline), and a message to a "
                "subagent needs a live parent (stops still work)"
            )
        return None

    def gauge(self, sid: str) -> Gauge | None:
        """The bar of a session, or None when no budget governs it (as far as read): the
        tightest state of its own budget and its ancestors', and the limit shown."""
        chain: list[Row] = []
        row = self.rows.get(sid)
        for _ in range(_MAX_DEPTH + 1):
            if row is None:
                break
            if row.own_budget:
                chain.append(row)
            row = self.rows.get(row.parent) if row.parent else None
        if not chain:
            return None
        state, decided_by = "ok", None
        for owner in chain:
            status = owner.budget or {}
            s = str(status.get("state") or "ok")
            if _RANK.get(s, 0) > _RANK[state]:
                state, decided_by = s, status.get("decided_by")
        decider = [owner for owner in chain if owner.id == decided_by]
        best: tuple[float, Row, str, float, float] | None = None
        for owner in decider or chain:
            status = owner.budget or {}
            limits = status.get("limits") or {}
            spent_all = status.get("spent") or {}
            for key in _LIMITS:
                if key not in limits:
                    continue
                limit = float(limits[key])
                spent = float(spent_all.get(key) or 0.0)
                fraction = spent / limit if limit else 1.0
                if best is None or fraction > best[0]:
                    best = (fraction, owner, key, spent, limit)
        if best is None:
            return None
        _, owner, key, spent, limit = best
        return Gauge(key, spent, limit, state, owner.id, owner.id == sid)
