"""The supervisor actor: registry, lineage, epochs, authority, discovery, lifecycle.

It owns every map that authority and discovery read: the catalog (every session ever
created, with its children in creation order) and the registry (id -> current
activation). Lookups are dict reads, never scans, so an interrupt costs the same with
ten sessions or ten thousand. It asks agents only to release them (agents never ask
back), and never waits on a worker.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import pykka
import structlog

from tether.actors.agent import (
    AgentActor,
    AgentStatus,
    Dispose,
    Enqueue,
    Release,
    Settled,
    StatusCell,
    Sync,
    TurnNotice,
)
from tether.actors.authority import (
    MAX_DEPTH,
    Ancestor,
    Authority,
    Host,
    User,
    check_ancestor_ref,
    sender_of,
)
from tether.actors.ports import AgentStore, EventSink, Executor
from tether.actors.states import AgentState
from tether.wire.errors import InvalidParams, NotFound, ParentOffline, Unauthorized
from tether.wire.records import AgentInfo, AgentRef, ChildTurnEnded, Message, SessionHeader

__all__ = [
    "Activation",
    "Catalog",
    "Create",
    "Directory",
    "DisposeReq",
    "Kick",
    "ListReq",
    "Recover",
    "RefReq",
    "ReleaseReq",
    "Resolve",
    "Running",
    "Send",
    "StatusReq",
    "SupervisorActor",
    "SupervisorStore",
]

log = structlog.get_logger("tether.supervisor")

_EPOCHS = itertools.count(1)


class SupervisorStore(AgentStore, Protocol):
    """The durable operations the supervisor performs, beyond an agent's."""

    def create_session(self, row: SessionHeader) -> None: ...
    def append_message(
        self,
        session: str,
        content: str,
        *,
        data: dict[str, Any] | None = None,
        kind: str = "user",
        sender: str | None = None,
    ) -> Message: ...
    def pending_count(self, session: str) -> int: ...


@dataclass(slots=True)
class _Node:
    header: SessionHeader
    depth: int  # 0 for a root
    settled: bool = False
    children: list[str] = field(default_factory=list)
    slugs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Activation:
    ref: pykka.ActorRef[Any]
    epoch: int
    ancestry: frozenset[str]  # fixed at materialization
    lineage: tuple[str, ...]  # the same ids, root first
    cell: StatusCell


class Catalog:
    """The in-memory image of the store's session catalog."""

    def __init__(self) -> None:
        self.nodes: dict[str, _Node] = {}
        self.roots: list[str] = []

    def add(self, header: SessionHeader) -> _Node:
        parent = self.nodes.get(header.parent) if header.parent is not None else None
        node = _Node(header, 0 if parent is None else parent.depth + 1, header.settled)
        self.nodes[header.id] = node
        if parent is None:
            self.roots.append(header.id)
        else:
            parent.children.append(header.id)
            if header.slug is not None:
                parent.slugs[header.slug] = header.id
        return node

    def get(self, session: str) -> _Node:
        node = self.nodes.get(session)
        if node is None:
            raise NotFound(f"no session {session!r}")
        return node

    def lineage(self, session: str) -> tuple[str, ...]:
        """Ancestor ids, root first; a bounded walk that fails closed past MAX_DEPTH."""
        out: list[str] = []
        parent = self.nodes[session].header.parent
        while parent is not None:
            if len(out) >= MAX_DEPTH:
                raise InvalidParams(f"ancestry deeper than {MAX_DEPTH}")
            out.append(parent)
            parent = self.nodes[parent].header.parent
        return tuple(reversed(out))

    def preorder(self, root: str) -> list[str]:
        """Every id below ``root``, pre-order, siblings in creation order."""
        nodes = self.nodes
        out: list[str] = []
        stack = list(reversed(nodes[root].children))
        while stack:
            sid = stack.pop()
            out.append(sid)
            kids = nodes[sid].children
            if kids:
                stack.extend(reversed(kids))
        return out


class Directory:
    """The supervisor's maps, with the authority checks of SPEC §6 that read them.

    Only the supervisor's thread writes here. Other threads may call the ``authorize_*``
    methods: each reads single dict entries holding immutable values (an ``Activation``,
    a ``SessionHeader``), so a reader never sees a half-made entry, and the hot paths
    (send, interrupt) need no round trip through the supervisor's mailbox.
    """

    def __init__(self) -> None:
        self.catalog = Catalog()
        self.registry: dict[str, Activation] = {}
        self.disposing: set[str] = set()

    def check_ref(self, auth: Ancestor) -> None:
        act = self.registry.get(auth.agent.id)
        check_ancestor_ref(auth.agent, None if act is None else act.epoch)

    def authorize_send(self, target: str, auth: Authority | None) -> SessionHeader:
        """Who may put work in ``target``'s inbox; ``None`` is a root's owner (the host)."""
        node = self.catalog.get(target)
        if node.settled or target in self.disposing:
            raise InvalidParams(f"session {target} is settled: its inbox is closed")
        h = node.header
        if auth is None:
            if h.parent is not None:
                raise InvalidParams("prompt is for root sessions; use send for a subagent")
            return h
        if h.mode == "one-shot":
            raise InvalidParams("a one-shot subagent takes no messages after its task")
        if isinstance(auth, Ancestor):
            self.check_ref(auth)
            if auth.agent.id != h.parent:
                raise Unauthorized(f"only the direct parent of {target} may send to it")
        else:
            if h.parent is None:
                if auth.parent == target:
                    return h  # a root's owner holds the root's own address
                raise Unauthorized(f"{auth.parent!r} is not the owner of root {target}")
            if auth.parent != h.parent:
                raise Unauthorized(f"{auth.parent!r} is not the parent of {target}")
            if h.parent not in self.registry:
                raise ParentOffline(f"the parent {h.parent} of {target} is not live")
        return h

    def authorize_interrupt(self, target: str, auth: Authority | Host) -> Activation | None:
        """The activation to signal, or None for an accepted no-op; Unauthorized if refused."""
        if isinstance(auth, Ancestor):
            self.check_ref(auth)  # stale refs are refused even for an absent target
        act = self.registry.get(target)
        if act is None:
            return None  # absent (unknown, dormant, settled): an accepted no-op
        if isinstance(auth, Host):
            return act
        header = self.catalog.nodes[target].header
        if header.mode == "one-shot":
            return None  # the continuable path treats a one-shot as absent
        if isinstance(auth, User):
            if _owner_address(header) != auth.parent:
                raise Unauthorized(f"{auth.parent!r} is not the parent of {target}")
        else:
            if auth.agent.id == target:
                raise Unauthorized("a session cannot interrupt itself")
            if auth.agent.id not in act.ancestry:
                raise Unauthorized(f"{auth.agent.id} is not an ancestor of {target}")
        return act


def _owner_address(header: SessionHeader) -> str:
    """The address a person presents as ``User(parent=...)``: the durable parent, or, for
    a root session (which has none), the root's own id: its owner holds the root."""
    return header.parent if header.parent is not None else header.id


# ---- messages (asked unless noted) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Create:
    header: SessionHeader
    prompt: str | None = None
    data: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Send:
    target: str
    content: str
    authority: Authority | None  # None: the host itself (a root's owner prompting it)
    data: dict[str, Any] | None = None
    wake: bool = True


@dataclass(frozen=True, slots=True)
class Kick:
    """Already appended by a fast-path send whose activation went away: hand it on."""

    target: str
    wake: bool


@dataclass(frozen=True, slots=True)
class ListReq:
    root: str
    scope: str


@dataclass(frozen=True, slots=True)
class StatusReq:
    session: str


@dataclass(frozen=True, slots=True)
class RefReq:
    session: str


@dataclass(frozen=True, slots=True)
class Resolve:
    """An id or a slug, resolved inside ``caller``'s own subtree."""

    caller: str
    name: str


@dataclass(frozen=True, slots=True)
class ReleaseReq:
    session: str


@dataclass(frozen=True, slots=True)
class DisposeReq:
    session: str
    authority: Authority | Host
    grace: float


@dataclass(frozen=True, slots=True)
class Running:
    """Ids of sessions with a turn claimed (for the runtime's drain)."""


@dataclass(frozen=True, slots=True)
class Recover:
    """Load the catalog; materialize root sessions with their inboxes parked."""

    rows: list[SessionHeader]


class SupervisorActor(pykka.ThreadingActor):
    def __init__(
        self,
        *,
        store: SupervisorStore,
        executor: Executor,
        events: EventSink,
        directory: Directory,
    ) -> None:
        super().__init__()
        self._store = store
        self._executor = executor
        self._events = events
        self._dir = directory
        self._catalog = directory.catalog
        self._registry = directory.registry
        self._disposing = directory.disposing

    def on_stop(self) -> None:
        for act in list(self._registry.values()):
            act.ref.stop(block=False)
        for act in self._registry.values():
            with contextlib.suppress(Exception):
                act.ref.actor_stopped.wait(5.0)
        self._registry.clear()

    def on_receive(self, message: Any) -> Any:
        match message:
            case Create():
                return self._create(message)
            case Send():
                return self._send(message)
            case Kick(target=target, wake=wake):
                return self._kick(target, wake)
            case ListReq(root=root, scope=scope):
                return self._list(root, scope)
            case StatusReq(session=sid):
                return self._status(sid)
            case RefReq(session=sid):
                act = self._registry.get(sid)
                if act is None:
                    self._catalog.get(sid)
                    raise NotFound(f"session {sid!r} is not live")
                return AgentRef(sid, act.epoch)
            case Resolve():
                return self._resolve(message)
            case ReleaseReq(session=sid):
                return self._release(sid)
            case DisposeReq():
                return self._dispose(message)
            case Running():
                return [sid for sid, a in self._registry.items() if a.cell.status.turn is not None]
            case Recover(rows=rows):
                return self._recover(rows)
            case TurnNotice() | Settled():
                try:
                    self._told(message)
                except Exception:  # a tell that fails must not stop the supervisor
                    log.exception("supervisor.error", message=type(message).__name__)
        return None

    def _told(self, message: TurnNotice | Settled) -> None:
        match message:
            case TurnNotice(parent=parent, notice=notice):
                self._notice(parent, notice)
            case Settled(session=sid):
                self._registry.pop(sid, None)
                self._disposing.discard(sid)
                node = self._catalog.nodes.get(sid)
                if node is not None:
                    node.settled = True

    # ---- materialization ----------------------------------------------------------

    def _materialize(self, sid: str, *, pending: int, hold: bool) -> Activation:
        node = self._catalog.nodes[sid]
        lineage = self._catalog.lineage(sid)
        status = AgentStatus(
            AgentState.IDLE if pending == 0 and not hold else AgentState.PARKED, pending
        )
        cell = StatusCell(status, node.header, node.depth)
        ref = AgentActor.start(
            header=node.header,
            lineage=lineage,
            cell=cell,
            pending=pending,
            hold=hold,
            store=self._store,
            executor=self._executor,
            events=self._events,
            supervisor=self.actor_ref,
        )
        act = Activation(ref, next(_EPOCHS), frozenset(lineage), lineage, cell)
        self._registry[sid] = act
        log.debug("agent.materialized", session=sid, epoch=act.epoch)
        return act

    def _recover(self, rows: list[Any]) -> list[str]:
        for row in rows:
            self._catalog.add(row)
        roots = [sid for sid in self._catalog.roots if not self._catalog.nodes[sid].settled]
        for sid in roots:
            self._materialize(sid, pending=self._store.pending_count(sid), hold=True)
        return roots

    # ---- create / send --------------------------------------------------------------

    def _create(self, c: Create) -> str:
        h = c.header
        if h.parent is not None:
            parent = self._catalog.get(h.parent)
            if parent.settled:
                raise InvalidParams(f"session {h.parent} is settled")
            if parent.depth + 1 > MAX_DEPTH:
                raise InvalidParams(f"a session tree is at most {MAX_DEPTH} levels deep")
            if h.slug is not None and h.slug in parent.slugs:
                raise InvalidParams(f"slug {h.slug!r} is taken among {h.parent}'s children")
        self._store.create_session(h)
        self._catalog.add(h)
        act = self._materialize(h.id, pending=0, hold=False)
        if c.prompt is not None:
            self._store.append_message(h.id, c.prompt, data=c.data, sender=h.parent)
            act.ref.tell(Enqueue("yes"))
        return h.id

    def _send(self, s: Send) -> Message:
        self._dir.authorize_send(s.target, s.authority)
        msg = self._store.append_message(
            s.target, s.content, data=s.data, sender=sender_of(s.authority)
        )
        self._accepted(msg)
        act = self._registry.get(s.target)
        if act is None and s.wake:
            act = self._materialize(
                s.target, pending=self._store.pending_count(s.target) - 1, hold=False
            )
        if act is not None:
            act.ref.tell(Enqueue("yes" if s.wake else "no"))
        return msg

    def _accepted(self, msg: Message) -> None:
        if self._events.wants("message.accepted"):
            lineage = self._catalog.lineage(msg.session)
            data = {"message": msg.id, "kind": msg.kind}
            self._events.emit("message.accepted", msg.session, lineage, data)

    def _kick(self, target: str, wake: bool) -> None:
        act = self._registry.get(target)
        if act is None and wake:
            pending = self._store.pending_count(target)
            self._materialize(target, pending=pending, hold=False)
            self._registry[target].ref.tell(Enqueue("yes", 0))
        elif act is not None:
            act.ref.tell(Enqueue("yes" if wake else "no"))

    def _notice(self, parent: str, notice: ChildTurnEnded) -> None:
        node = self._catalog.nodes.get(parent)
        if node is None or node.settled:
            return
        who = notice.slug or notice.child
        text = f"[{who}] turn {notice.outcome}"
        if notice.partial:
            text += f": {notice.partial}"
        msg = self._store.append_message(
            parent,
            text,
            data={"notice": msgspec.to_builtins(notice)},
            kind="notice",
            sender=notice.child,
        )
        self._accepted(msg)
        act = self._registry.get(parent)
        if act is not None:
            act.ref.tell(Enqueue("if-idle"))  # never wakes a parked or dormant parent

    # ---- authority ------------------------------------------------------------------

    # ---- discovery ------------------------------------------------------------------

    def _info(self, sid: str, depth: int) -> AgentInfo:
        node = self._catalog.nodes[sid]
        h = node.header
        act = self._registry.get(sid)
        if act is not None:
            cell = act.cell
            info = cell.info
            quiet = cell.quiet
            if quiet:  # non-waking sends the agent has not counted yet
                state = "parked" if info.state == "idle" else info.state
                return msgspec.structs.replace(
                    info, depth=depth, pending=info.pending + quiet, state=state
                )
            return info if info.depth == depth else msgspec.structs.replace(info, depth=depth)
        state = AgentState.SETTLED if node.settled else AgentState.DORMANT
        pending = 0 if node.settled else self._store.pending_count(sid)
        return AgentInfo(
            id=sid,
            slug=h.slug,
            parent=h.parent,
            depth=depth,
            mode=h.mode,
            state=str(state),
            pending=pending,
        )

    def _list(self, root: str, scope: str) -> list[AgentInfo]:
        base = self._catalog.get(root).depth
        if scope not in ("children", "descendants"):
            raise InvalidParams(f"scope must be 'children' or 'descendants', not {scope!r}")
        nodes = self._catalog.nodes
        ids = nodes[root].children if scope == "children" else self._catalog.preorder(root)
        return [self._info(sid, nodes[sid].depth - base) for sid in ids]

    def _status(self, sid: str) -> AgentInfo:
        """Exact as of the call: the agent first handles what was told to it before."""
        node = self._catalog.get(sid)
        act = self._registry.get(sid)
        if act is not None:
            with contextlib.suppress(pykka.ActorDeadError):  # settled and stopped meanwhile
                act.ref.ask(Sync())
        return self._info(sid, node.depth)

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

    # ---- lifecycle ------------------------------------------------------------------

    def _release(self, sid: str) -> None:
        node = self._catalog.get(sid)
        if node.settled:
            raise InvalidParams(f"session {sid} is settled")
        act = self._registry.get(sid)
        if act is None:
            return
        try:
            act.ref.ask(Release())
        except pykka.ActorDeadError:  # it settled meanwhile
            return
        del self._registry[sid]
        self._events.emit(
            "state",
            sid,
            act.lineage,
            {"state": "dormant", "pending": 0, "stopping": None, "turn": None},
        )

    def _dispose(self, d: DisposeReq) -> list[str]:
        node = self._catalog.get(d.session)
        h = node.header
        auth = d.authority
        if isinstance(auth, Ancestor):
            self._dir.check_ref(auth)
            if auth.agent.id != h.parent:
                raise Unauthorized(f"only the direct parent of {d.session} may dispose it")
        elif isinstance(auth, User) and auth.parent != _owner_address(h):
            raise Unauthorized(f"{auth.parent!r} is not the parent of {d.session}")
        subtree = self._catalog.preorder(d.session)
        order = [*reversed(subtree), d.session]  # deepest first
        for sid in order:
            n = self._catalog.nodes[sid]
            if n.settled:
                continue
            act = self._registry.get(sid)
            if act is not None:
                self._disposing.add(sid)
                act.ref.tell(Dispose(auth.origin, auth.by, d.grace))
            else:
                self._store.settle(sid)
                n.settled = True
        return order
