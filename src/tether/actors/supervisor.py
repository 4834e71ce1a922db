"""The supervisor actor: the catalog's one writer, lineage, spawn, dispose, discovery.

Sessions themselves live on the dispatcher's hosts (``actors.host``); the supervisor
decides what changes the *tree*: a new session (checked against its parent's state, so
nothing is ever spawned under a parent whose disposal has begun), a disposal (the whole
subtree is marked ``disposing`` in one step, then each host is told, deepest first), the
walks of subtree stops and pauses (marked at their top in one step, which also reads the
subtree, so that a spawn below either landed before and is walked, or is refused until
the walk ends), and the recovery of the catalog at start. It never asks a host; it only
tells.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pykka
import structlog

from tether.actors.agent import Session, notice_text
from tether.actors.authority import MAX_DEPTH, Authority, Host
from tether.actors.directory import Directory
from tether.actors.host import Adopt, Dispatcher, DisposeOp, RecoverTurn, simple_inbox
from tether.actors.ports import AgentStore, Durable, Executor, KeptTurn, ParentNotice
from tether.actors.states import AgentState
from tether.wire.errors import InvalidParams, NotFound
from tether.wire.records import AgentInfo, ChildTurnEnded, Message, SessionHeader

__all__ = [
    "Create",
    "DisposeReq",
    "ListReq",
    "Recover",
    "RecoverKept",
    "Resolve",
    "RootsReq",
    "SupervisorActor",
    "Walk",
    "crash_notice",
    "narrow",
]

log = structlog.get_logger("tether.supervisor")


def narrow(parent: dict[str, Any] | None, asked: dict[str, Any] | None) -> dict[str, Any] | None:
    """A child's effective permissions: its parent's, narrowed by what was asked for.

    A ``deny`` anywhere above holds below; an ``allow`` asked for cannot lift it.
    """
    if not parent and not asked:
        return None
    out = dict(parent or {})
    for key, value in (asked or {}).items():
        if out.get(key) != "deny":
            out[key] = value
    return out


def crash_notice(
    headers: Mapping[str, SessionHeader], session: str, turn: str, partial: str | None
) -> ParentNotice | None:
    """The notice a parent gets for its child's turn that a dead host left open (closed
    ``crashed`` at recovery); None for a root, or a parent that is settled."""
    child = headers.get(session)
    if child is None or child.parent is None:
        return None
    parent = headers.get(child.parent)
    if parent is None or parent.settled:
        return None
    told = ChildTurnEnded(
        child=session,
        slug=child.slug,
        turn=turn,
        outcome="crashed",
        cause="system",
        partial=partial,
    )
    return ParentNotice(
        parent.id, notice_text(told), {"notice": msgspec.to_builtins(told)}, session
    )


# ---- messages (asked) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Create:
    header: SessionHeader
    prompt: str | None = None
    data: dict[str, Any] | None = None
    trace: str | None = None  # the caller's trace context, for the prompt (telemetry on)


@dataclass(frozen=True, slots=True)
class ListReq:
    root: str
    scope: str


@dataclass(frozen=True, slots=True)
class RootsReq:
    """A page of the roots, newest first (``before``: those created before that root)."""

    before: str | None
    limit: int


@dataclass(frozen=True, slots=True)
class Resolve:
    """An id or a slug, resolved inside ``caller``'s own subtree."""

    caller: str
    name: str


@dataclass(frozen=True, slots=True)
class DisposeReq:
    session: str
    authority: Authority | Host
    grace: float


@dataclass(frozen=True, slots=True)
class Walk:
    """A subtree stop or pause (``what``: ``stopped`` or ``paused``) begins (``on``) or
    ends at ``root``. Beginning answers the subtree, ``root`` first, pre-order: every
    session created before it; until it ends, a spawn anywhere below ``root`` is
    refused. The supervisor handles one message at a time, so no spawn falls between
    the mark and the read."""

    root: str
    what: str
    on: bool


@dataclass(frozen=True, slots=True)
class Recover:
    """Load the catalog and materialize root sessions with their inboxes parked (the
    turns a dead host left were closed, and their parents told, by the store's
    ``recover``: see ``crash_notice``), but those of ``running``, which ``RecoverKept``
    makes live once the budgets are restored over the catalog."""

    rows: list[SessionHeader]
    running: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RecoverKept:
    """Make each session whose turn the dead host left open and that recovers live (not
    dormant), its turn running on (semantics §17.1)."""

    kept: list[KeptTurn] = field(default_factory=list)


class SupervisorActor(pykka.ThreadingActor):
    _create_actor_inbox = staticmethod(simple_inbox)
    # A program that forgets close() must still exit (the runtime closes itself then).
    use_daemon_thread = True

    def __init__(
        self,
        *,
        store: AgentStore,
        executor: Executor,
        directory: Directory,
        dispatcher: Dispatcher,
    ) -> None:
        super().__init__()
        self._store = store
        self._executor = executor
        self._dir = directory
        self._catalog = directory.catalog
        self._dispatcher = dispatcher
        self._walking = 0  # walks under way: only then does a spawn look up its lineage

    def on_receive(self, message: Any) -> Any:
        match message:
            case Create():
                return self._create(message)
            case ListReq(root=root, scope=scope):
                return self._list(root, scope)
            case RootsReq(before=before, limit=limit):
                return [self._info(sid, 0) for sid in self._catalog.roots_before(before, limit)]
            case Resolve():
                return self._resolve(message)
            case DisposeReq():
                return self._dispose(message)
            case Walk():
                return self._walk(message)
            case Recover(rows=rows, running=running):
                return self._recover(rows, running)
            case RecoverKept(kept=kept):
                return self._recover_kept(kept)
        return None

    # ---- create ---------------------------------------------------------------------

    def _create(self, c: Create) -> tuple[str, Durable]:
        h = c.header
        if h.parent is not None:
            parent = self._catalog.get(h.parent)
            if parent.settled or parent.disposing:
                raise InvalidParams(f"session {h.parent} is settled or being disposed")
            if parent.depth + 1 > MAX_DEPTH:
                raise InvalidParams(f"a session tree is at most {MAX_DEPTH} levels deep")
            if self._walking:
                self._check_walks(h.parent)
            if h.slug is not None and self._catalog.slug_taken(h.parent, h.slug):
                raise InvalidParams(f"slug {h.slug!r} is taken among {h.parent}'s children")
            permissions = narrow(parent.header.permissions, h.permissions)
            if permissions != h.permissions:
                h = msgspec.structs.replace(h, permissions=permissions)
            if h.stall is None and parent.header.stall is not None:
                h = msgspec.structs.replace(h, stall=parent.header.stall)  # semantics §14.5
            if h.limits is None and parent.header.limits is not None:
                h = msgspec.structs.replace(h, limits=parent.header.limits)  # semantics §15.5
        ticket = self._store.create_session(h)
        inbox: list[Message] = []
        if c.prompt is not None:
            msg, ticket = self._store.append_message(
                h.id, c.prompt, data=c.data, sender=h.parent, trace=c.trace
            )
            inbox.append(msg)
        self._catalog.add(h)
        self._adopt(h, inbox, parked=False)
        return h.id, ticket

    def _adopt(
        self, h: SessionHeader, inbox: list[Message], *, parked: bool, horizon: int = 0
    ) -> None:
        """Make the session live on its host; the registry has it before anyone can ask."""
        node = self._catalog.nodes[h.id]
        lineage = self._catalog.lineage(h.id)
        services = self._dispatcher.services_for(h.id)
        epoch = self._dir.next_epoch()
        s = Session(services, h, lineage, node.depth, epoch, inbox, parked, horizon)
        # Registered before its host hears of it, so its host (which removes it once it
        # settles) always acts after this.
        self._dir.registry[h.id] = s
        self._dispatcher.tell(h.id, Adopt(s))

    # ---- subtree walks --------------------------------------------------------------

    def _walk(self, w: Walk) -> list[str]:
        node = self._catalog.get(w.root)
        if w.on:
            node.walks = [*(node.walks or ()), w.what]
            self._walking += 1
            return [w.root, *self._catalog.preorder(w.root)]
        if node.walks and w.what in node.walks:
            rest = list(node.walks)
            rest.remove(w.what)
            node.walks = rest or None
            self._walking -= 1
        return []

    def _check_walks(self, parent: str) -> None:
        """Refuse a spawn under ``parent`` while a subtree stop or pause walks a subtree
        holding it: the walk has read the subtree already and would miss the child."""
        nodes = self._catalog.nodes
        for sid in (parent, *reversed(self._catalog.lineage(parent))):
            walks = nodes[sid].walks
            if walks:
                raise InvalidParams(
                    f"session {parent} is in a subtree being {walks[0]} (from {sid}): "
                    "no spawn there until that returns"
                )

    # ---- recovery -------------------------------------------------------------------

    def _recover(self, rows: list[SessionHeader], running: frozenset[str]) -> list[str]:
        for row in rows:
            self._catalog.add(row)
        nodes = self._catalog.nodes
        roots = [sid for sid in self._catalog.roots if not nodes[sid].settled]
        for sid in roots:
            if sid not in running:
                inbox, horizon = self._store.pending(sid)
                self._adopt(nodes[sid].header, inbox, parked=True, horizon=horizon)
        return roots

    def _recover_kept(self, kept: list[KeptTurn]) -> None:
        nodes = self._catalog.nodes
        for k in kept:  # live, not dormant: its turn runs on without a waking send
            inbox, horizon = self._store.pending(k.session)
            self._adopt(nodes[k.session].header, inbox, parked=False, horizon=horizon)
            self._dispatcher.tell(k.session, RecoverTurn(k))

    # ---- discovery ------------------------------------------------------------------

    def _info(self, sid: str, depth: int) -> AgentInfo:
        live = self._dir.registry.get(sid)
        if live is not None:
            info = live.info
            t = live.turn
            dispatched = t is not None and self._executor.dispatched(t.id)
            if info.depth != depth or dispatched:
                info = msgspec.structs.replace(info, depth=depth, dispatched=dispatched)
            return info
        node = self._catalog.nodes[sid]
        state = AgentState.SETTLED if node.settled else AgentState.DORMANT
        pending = 0 if node.settled else self._store.pending_count(sid)
        h = node.header
        return AgentInfo(
            id=sid,
            slug=h.slug,
            parent=h.parent,
            depth=depth,
            mode=h.mode,
            state=state,
            pending=pending,
        )

    def _list(self, root: str, scope: str) -> list[AgentInfo]:
        base = self._catalog.get(root).depth
        if scope not in ("children", "descendants"):
            raise InvalidParams(f"scope must be 'children' or 'descendants', not {scope!r}")
        nodes = self._catalog.nodes
        ids = self._catalog.children(root) if scope == "children" else self._catalog.preorder(root)
        return [self._info(sid, nodes[sid].depth - base) for sid in ids]

    def _resolve(self, r: Resolve) -> str:
        if r.name in self._catalog.nodes:
            return r.name
        self._catalog.get(r.caller)
        found = [
            sid
            for sid in self._catalog.preorder(r.caller)
            if self._catalog.nodes[sid].header.slug == r.name
        ]
        if not found:
            raise NotFound(f"no session with id or slug {r.name!r} below {r.caller}")
        if len(found) > 1:
            raise InvalidParams(f"slug {r.name!r} is ambiguous below {r.caller}; use an id")
        return found[0]

    # ---- dispose --------------------------------------------------------------------

    def _dispose(self, d: DisposeReq) -> tuple[list[str], Durable | None]:
        self._dir.authorize_dispose(d.session, d.authority)
        subtree = self._catalog.preorder(d.session)
        order = [*reversed(subtree), d.session]  # deepest first
        nodes = self._catalog.nodes
        todo = [sid for sid in order if not nodes[sid].settled]
        # One step: from here on no spawn under any of them and no send into them.
        for sid in todo:
            nodes[sid].disposing = True
        # Durable in one commit, queued before any of their settles: a host killed
        # before those leaves the next host to finish the disposal (finish_disposals).
        ticket = self._store.dispose_accepted(todo) if todo else None
        auth = d.authority
        for sid in todo:
            self._dispatcher.tell(sid, DisposeOp(sid, auth.origin, auth.by, d.grace))
        return order, ticket
