"""Walks of a subtree: a subtree stop and a subtree pause or resume (docs/design.md,
section 6.6).

Authorized once at the top (``authorize_subtree``); then the supervisor marks the top and
returns the subtree in pre-order in the same step, so a spawn below either landed before
(and is walked) or is refused until the walk ends. Each session's host is then asked in
turn, top first (a stopped parent is parked before its children's notices reach it), with
a ``Host`` authority: the same person or ancestor acts on each. A one-shot is passed by:
it belongs to its handle's holder. The ``turn`` guard applies to the top only. A resume
walks the current catalog without a mark: a child spawned meanwhile was never paused.
"""

from __future__ import annotations

import contextlib

import pykka

from tether.actors.authority import Authority, Host
from tether.actors.host import InterruptOp, PauseOp
from tether.actors.supervisor import Walk
from tether.runtime._checks import check_id
from tether.runtime._engine import Engine
from tether.wire.vocab import Kind

__all__ = ["pause_subtree", "stop_subtree"]


def stop_subtree(
    rt: Engine,
    target: str,
    auth: Authority,
    kind: Kind,
    reason: str,
    grace: float,
    deadline: float | None,
    turn: str | None,
) -> list[str]:
    """Stop every running turn from ``target`` down, top first; the turns stopped."""
    rt._check_open()
    check_id(target)
    rt._dir.authorize_subtree(target, auth, what="stop")
    delegate = Host(auth.origin, auth.by)
    nodes = rt._dir.catalog.nodes
    turns: list[str] = []
    trace = rt._tel.current()
    # The subtree as of the mark; a spawn below it is refused until the walk ends.
    ids: list[str] = rt._ask(Walk(target, "stopped", on=True))
    try:
        for sid in ids:
            node = nodes.get(sid)
            if node is None or node.header.mode == "one-shot":
                continue  # a one-shot belongs to its handle's holder, not to the subtree
            guard = turn if sid == target else None  # the guard names the target's turn
            op = InterruptOp(sid, delegate, kind, reason, grace, deadline, guard, trace)
            bound = rt._dispatcher.ask(sid, op)
            if bound is not None:
                turns.append(str(bound))
    finally:
        _walk_end(rt, target, "stopped")
    return turns


def pause_subtree(
    rt: Engine,
    target: str,
    auth: Authority,
    reason: str,
    *,
    resume: bool,
    turn: str | None,
    trace: str | None,
) -> list[str]:
    """Pause (or resume) every running turn from ``target`` down, top first; the turns
    paused (resumed)."""
    rt._dir.authorize_subtree(target, auth)
    delegate = Host(auth.origin, auth.by)
    nodes = rt._dir.catalog.nodes
    turns: list[str] = []
    if resume:  # a child spawned meanwhile was never paused: nothing to hold off
        ids = [target, *rt._dir.catalog.preorder(target)]
    else:  # as for a subtree stop: what the mark read; no spawn below until the end
        ids = rt._ask(Walk(target, "paused", on=True))
    try:
        for sid in ids:
            if nodes[sid].header.mode == "one-shot":
                continue  # its holder's result() must not hang on a pause it never asked
            guard = turn if sid == target else None  # the guard names the target's turn
            op = PauseOp(sid, delegate, reason, resume, guard, trace)
            bound = rt._dispatcher.ask(sid, op)
            if bound is not None:
                turns.append(str(bound))
    finally:
        if not resume:
            _walk_end(rt, target, "paused")
    return turns


def _walk_end(rt: Engine, target: str, what: str) -> None:
    """Spawns below ``target`` land again; a runtime closed meanwhile has no tree."""
    with contextlib.suppress(pykka.ActorDeadError):
        rt._sup.ask(Walk(target, what, on=False))
