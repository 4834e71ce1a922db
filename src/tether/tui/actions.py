"""The verbs the keys call, over the RPC, each answered by one line for the screen.

A stop is bound to the turn on screen when its menu opened (``Target``): the call carries
that turn as its ``turn`` guard, so a turn that ended meanwhile is an accepted no-op and
the line says ``already finished`` (semantics §14.2). A refusal is the ``RpcError`` the
call raised; the screen shows it as one line (``refused: code: message``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from tether.cli.client import Client
from tether.tui.model import Row

__all__ = ["DONE", "UNSET", "Target", "decide", "pause", "resume", "send", "stop", "subtree_stop"]

UNSET: Final[Any] = object()  # no edit: the model's own arguments

# What a person reads after each kind of stop: ``cancelled``, ``steered``, ...
DONE: Final = {
    "steer": "steered",
    "cancel": "cancelled",
    "abort": "aborted",
    "preempt": "preempted",
}


@dataclass(frozen=True)
class Target:
    """What a menu was opened for: the session, its address, the turn on screen then."""

    session: str
    label: str
    address: dict[str, str]
    turn: str | None

    @classmethod
    def of(cls, row: Row) -> Target:
        return cls(row.id, row.label, row.address(), row.turn)


def _name(name: str | None) -> dict[str, str]:
    return {"name": name} if name else {}


def send(client: Client, row: Row, content: str, name: str | None) -> str:
    answer = client.call(
        "subagent.send", {"address": row.address(), "content": content, **_name(name)}
    )
    return f"sent {answer.get('message') or 'a message'} to {row.label}"


def stop(client: Client, target: Target, kind: str, reason: str, name: str | None) -> str:
    """A steer, cancel, abort or preempt of the turn on screen when the menu opened."""
    params: dict[str, Any] = {
        "address": target.address,
        "kind": kind,
        "reason": reason,
        **_name(name),
    }
    if target.turn is not None:
        params["turn"] = target.turn
    answer = client.call("subagent.interrupt", params)
    if answer.get("turn"):
        return f"{DONE[kind]}: issued to turn {answer['turn']} of {target.label}"
    if target.turn is None:
        return f"nothing to {kind}: {target.label} has no running turn"
    if kind == "steer":
        return f"already finished or stopping: turn {target.turn} of {target.label} took no steer"
    return (
        f"already finished: turn {target.turn} of {target.label} is no longer running,"
        f" so nothing was {DONE[kind]}"
    )


def subtree_stop(client: Client, target: Target, kind: str, reason: str, name: str | None) -> str:
    """A cancel or an abort of the target's running turn and of every running one below
    it, each bound to its own turn (semantics §15.6)."""
    params: dict[str, Any] = {
        "address": target.address,
        "kind": kind,
        "reason": reason,
        "scope": "subtree",
        **_name(name),
    }
    if target.turn is not None:
        params["turn"] = target.turn
    turns = list(client.call("subagent.interrupt", params).get("turns") or [])
    if turns:
        return f"{DONE[kind]} the subtree of {target.label}: turns {', '.join(turns)}"
    return f"nothing was running in the subtree of {target.label}, so nothing was {DONE[kind]}"


def pause(client: Client, target: Target, reason: str, name: str | None) -> str:
    """Freeze the turn on screen when the key was pressed (semantics §14.4)."""
    params: dict[str, Any] = {"address": target.address, "reason": reason, **_name(name)}
    if target.turn is not None:
        params["turn"] = target.turn
    turns = list(client.call("subagent.pause", params).get("turns") or [])
    if turns:
        return f"paused turn {', '.join(turns)} of {target.label}"
    return (
        f"already finished: turn {target.turn} of {target.label} is no longer running,"
        " so nothing was paused"
    )


def resume(client: Client, target: Target, name: str | None) -> str:
    turns = list(
        client.call("subagent.resume", {"address": target.address, **_name(name)}).get("turns")
        or []
    )
    if turns:
        return f"resumed turn {', '.join(turns)} of {target.label}"
    return f"nothing to resume: {target.label} is not paused"


def decide(
    client: Client,
    approval: str,
    parent: str | None,
    decision: str,
    name: str | None,
    *,
    reason: str | None = None,
    arguments: Any = UNSET,
) -> tuple[str, dict[str, Any]]:
    """Approve or deny a pending tool call with the authority of an interrupt of its
    session: ``parent`` is that session's parent as the tree holds it (a root's own id;
    None: looked up, as ``tether approve`` does). ``arguments``: approve it with these in
    place of the model's (an edit). The line for the screen, and the approval as decided."""
    if parent is None:
        session = client.call("subagent.approval", {"approval": approval})["approval"]["session"]
        info = client.call("subagent.status", {"session": session})
        parent = str(info["parent"] if info.get("parent") is not None else session)
    params: dict[str, Any] = {
        "approval": approval,
        "parent": parent,
        "decision": decision,
        **_name(name),
    }
    if reason:
        params["reason"] = reason
    if arguments is not UNSET:
        params["arguments"] = arguments
    a: dict[str, Any] = client.call("subagent.decide", params)["approval"]
    line = f"{a.get('state')} {a.get('id')}"
    if a.get("state") == "approved" and a.get("arguments_used") != a.get("arguments"):
        line += " with edited arguments"
    if a.get("state") == "denied" and reason:
        line += f": {reason}"
    return line, a
