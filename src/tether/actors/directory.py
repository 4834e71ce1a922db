"""The maps that authority and discovery read: the catalog and the registry.

The catalog holds every session ever created (header, depth, children in creation
order); only the supervisor adds to it and marks subtrees ``disposing``; a session's
host marks it ``settled``. The registry maps an id to its live ``Session``; only the
actor hosting that id adds or removes it. Every value is replaced whole or is a plain
attribute write, so readers on other threads see either the old or the new value.

Epochs are ``boot << 40 | n``: ``boot`` counts host starts in the store, so an
``AgentRef`` from an earlier host process never matches a live activation (semantics §9).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tether.actors.authority import (
    MAX_DEPTH,
    Ancestor,
    Authority,
    Host,
    User,
    check_ancestor_ref,
)
from tether.wire.errors import InvalidParams, NotFound, ParentOffline, Unauthorized
from tether.wire.records import SessionHeader

if TYPE_CHECKING:
    from tether.actors.agent import Session

__all__ = ["Catalog", "Directory", "Node", "owner_address"]


@dataclass(slots=True)
class Node:
    header: SessionHeader
    depth: int  # 0 for a root
    settled: bool = False
    disposing: bool = False
    # The subtree stops and pauses walking from here ("stopped", "paused"): no spawn
    # lands below while one walks (see the supervisor's ``Walk``).
    walks: list[str] | None = None
    children: list[str] | None = None  # None until the first child: most sessions are leaves
    slugs: dict[str, str] | None = None  # children's slugs, made with the first one


class Catalog:
    """The in-memory image of the store's session catalog."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.roots: list[str] = []
        self._root_at: dict[str, int] = {}  # a root's index in ``roots``

    def add(self, header: SessionHeader) -> Node:
        parent = self.nodes.get(header.parent) if header.parent is not None else None
        node = Node(header, 0 if parent is None else parent.depth + 1, header.settled)
        self.nodes[header.id] = node
        if parent is None:
            self._root_at[header.id] = len(self.roots)
            self.roots.append(header.id)
        else:
            if parent.children is None:
                parent.children = []
            parent.children.append(header.id)
            if header.slug is not None:
                if parent.slugs is None:
                    parent.slugs = {}
                parent.slugs[header.slug] = header.id
        return node

    def get(self, session: str) -> Node:
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

    def roots_before(self, before: str | None, limit: int) -> list[str]:
        """At most ``limit`` roots, newest first: the newest of all, or (``before``, a
        root's id) those created before that one."""
        if before is None:
            end = len(self.roots)
        else:
            end_at = self._root_at.get(before)
            if end_at is None:
                self.get(before)  # NotFound for an unknown id
                raise InvalidParams(f"session {before} is not a root")
            end = end_at
        return self.roots[max(0, end - limit) : end][::-1]

    def children(self, session: str) -> list[str]:
        return list(self.nodes[session].children or ())

    def preorder(self, root: str) -> list[str]:
        """Every id below ``root``, pre-order, siblings in creation order."""
        nodes = self.nodes
        out: list[str] = []
        stack = list(reversed(nodes[root].children or ()))
        while stack:
            sid = stack.pop()
            out.append(sid)
            kids = nodes[sid].children
            if kids:
                stack.extend(reversed(kids))
        return out

    def slug_taken(self, parent: str, slug: str) -> bool:
        slugs = self.nodes[parent].slugs
        return slugs is not None and slug in slugs


def owner_address(header: SessionHeader) -> str:
    """The address a person presents as ``User(parent=...)``: the durable parent, or, for
    a root session (which has none), the root's own id: its owner holds the root."""
    return header.parent if header.parent is not None else header.id


class Directory:
    """The catalog, the registry, epochs, and the authority checks of semantics §6."""

    def __init__(self, boot: int) -> None:
        self.catalog = Catalog()
        self.registry: dict[str, Session] = {}
        # Dormant sessions a waking send has been accepted for, not yet materialized by
        # their host (a count per id: several such sends may be on their way). They are
        # live to every later check (semantics §15.8): the send that woke one has returned.
        self._waking: dict[str, int] = {}
        self._waking_lock = threading.Lock()
        self._boot = boot << 40
        self._epochs = itertools.count(1)

    def waking(self, session: str) -> None:
        """A waking send to the dormant ``session`` is accepted: it is live from now on
        (the caller tells its host, which materializes it and then calls ``woken``)."""
        with self._waking_lock:
            self._waking[session] = self._waking.get(session, 0) + 1

    def woken(self, session: str) -> None:
        """The host has handled that send (materialized ``session``, or closed it)."""
        with self._waking_lock:
            n = self._waking.pop(session, 0) - 1
            if n > 0:
                self._waking[session] = n

    def live(self, session: str) -> bool:
        """Live, or accepted to be: the waking mark is read first, since a host adds to
        the registry before it clears the mark."""
        return session in self._waking or session in self.registry

    def next_epoch(self) -> int:
        return self._boot | next(self._epochs)

    def check_ref(self, auth: Ancestor) -> None:
        live = self.registry.get(auth.agent.id)
        check_ancestor_ref(auth.agent, None if live is None else live.epoch)

    def authorize_send(self, target: str, auth: Authority | None) -> Node:
        """Who may put work in ``target``'s inbox; ``None`` is a root's owner (the host).

        Called on the sender's thread (the send's fast path): it reads only what a call
        that returned has already set (the catalog, the registry, the waking marks).
        """
        node = self.catalog.get(target)
        if node.settled or node.disposing:
            raise InvalidParams(f"session {target} is settled: its inbox is closed")
        h = node.header
        if auth is None:
            if h.parent is not None:
                raise InvalidParams("prompt is for root sessions; use send for a subagent")
            return node
        if h.mode == "one-shot":
            raise InvalidParams("a one-shot subagent takes no messages after its task")
        if isinstance(auth, Ancestor):
            self.check_ref(auth)
            if auth.agent.id != h.parent:
                raise Unauthorized(f"only the direct parent of {target} may send to it")
        elif h.parent is None:
            if auth.parent != target:
                raise Unauthorized(f"{auth.parent!r} is not the owner of root {target}")
        else:
            if auth.parent != h.parent:
                raise Unauthorized(f"{auth.parent!r} is not the parent of {target}")
            if not self.live(h.parent):
                raise ParentOffline(f"the parent {h.parent} of {target} is not live")
        return node

    def authorize_interrupt(
        self, target: str, auth: Authority | Host, *, one_shot: bool = False
    ) -> Session | None:
        """The live session to signal, or None for an accepted no-op; Unauthorized if
        refused. Called on the thread of the actor hosting ``target``. ``one_shot``: a
        one-shot session is not absent (an approval's decision: its ancestors decide)."""
        if isinstance(auth, Ancestor):
            self.check_ref(auth)  # stale refs are refused even for an absent target
        live = self.registry.get(target)
        if live is None:
            return None  # absent (unknown, dormant, settled): an accepted no-op
        if isinstance(auth, Host):
            return live
        header = live.header
        if header.mode == "one-shot" and not one_shot:
            return None  # the continuable path treats a one-shot as absent
        if isinstance(auth, User):
            if owner_address(header) != auth.parent:
                raise Unauthorized(f"{auth.parent!r} is not the parent of {target}")
        else:
            if auth.agent.id == target:
                raise Unauthorized("a session cannot interrupt itself")
            if auth.agent.id not in live.lineage:
                raise Unauthorized(f"{auth.agent.id} is not an ancestor of {target}")
        return live

    def authorize_subtree(self, target: str, auth: Authority | Host, what: str = "pause") -> Node:
        """Authority over ``target`` as for an interrupt (semantics §6), checked against the
        catalog so that it holds whether or not ``target`` itself is live: a subtree
        pause, resume or stop then applies to every session below it."""
        node = self.catalog.get(target)
        if isinstance(auth, Host):
            return node
        if isinstance(auth, Ancestor):
            self.check_ref(auth)
            if auth.agent.id == target:
                raise Unauthorized(f"a session cannot {what} itself")
            if auth.agent.id not in self.catalog.lineage(target):
                raise Unauthorized(f"{auth.agent.id} is not an ancestor of {target}")
        elif owner_address(node.header) != auth.parent:
            raise Unauthorized(f"{auth.parent!r} is not the parent of {target}")
        return node

    def authorize_dispose(self, target: str, auth: Authority | Host) -> Node:
        node = self.catalog.get(target)
        h = node.header
        if isinstance(auth, Ancestor):
            self.check_ref(auth)
            if auth.agent.id != h.parent:
                raise Unauthorized(f"only the direct parent of {target} may dispose it")
        elif isinstance(auth, User) and auth.parent != owner_address(h):
            raise Unauthorized(f"{auth.parent!r} is not the parent of {target}")
        return node
