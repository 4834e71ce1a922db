"""Who may do what to whom (semantics §6).

Two kinds of caller: a person presenting a session's durable parent address (``User``),
or a live agent presenting its activation (``Ancestor``). The checks read the
``Directory`` the hosts write, whose ``authorize_subtree`` walks the catalog's lineage;
none reads the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.wire.errors import Unauthorized
from tether.wire.records import AgentRef, StopOrigin

__all__ = [
    "MAX_DEPTH",
    "Ancestor",
    "Authority",
    "Host",
    "User",
    "check_ancestor_ref",
    "sender_of",
]

MAX_DEPTH = 64


@dataclass(frozen=True, slots=True)
class User:
    """A person holding the target's parent address. ``name`` says who they are: the
    ``by`` of their stops and the sender of their messages (``"user"`` without one). The
    address is not shown: on a grandchild it is an agent's id, and would read as if the
    agent had acted."""

    parent: str
    name: str | None = None

    @property
    def origin(self) -> StopOrigin:
        return "user"

    @property
    def by(self) -> str:
        return self.name or "user"


@dataclass(frozen=True, slots=True)
class Ancestor:
    """A live agent acting on a session below it."""

    agent: AgentRef

    @property
    def origin(self) -> StopOrigin:
        return "parent"

    @property
    def by(self) -> str:
        return self.agent.id


@dataclass(frozen=True, slots=True)
class Host:
    """The embedding host itself (a one-shot's holder, the runtime's drain): trusted."""

    origin: StopOrigin = "system"
    by: str = "host"


Authority = User | Ancestor


def sender_of(auth: Authority | None) -> str | None:
    """Who a message is from, as recorded with it: an agent's id, the person's name (or
    "user"), or None for the host."""
    return None if auth is None else auth.by


def check_ancestor_ref(agent: AgentRef, current_epoch: int | None) -> None:
    """The caller's ref must be its id's current activation: stale refs are refused."""
    if current_epoch is None or current_epoch != agent.epoch:
        raise Unauthorized(f"{agent.id} (epoch {agent.epoch}) is not a live activation")
