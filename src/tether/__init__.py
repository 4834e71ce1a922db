"""Tether: an actor-model runtime for agents that spawn subagents.

Layering (imports only ever point down):

    tether.serve, tether.cli   the outside faces: the HTTP server and the command; they
        |                      use only the public API below
        v
    tether.runtime   processes and the outside world: the Runtime facade, worker pool,
        |            worker turn loop, SQLite store, drivers, RPC server, CLI
        v
    tether.actors    pykka actors: the supervisor (catalog, spawn, dispose, discovery) and
        |            a few session hosts, each serving many sessions' state machines
        |            (inbox, state, turn, interrupts) one message at a time; they reach
        |            the pool and the store only through the Protocols in actors.ports
        v
    tether.wire      msgspec Structs and codecs; depends on nothing of ours
"""

from tether import tools
from tether.actors.authority import Ancestor, User
from tether.runtime.async_context import AsyncTurnContext
from tether.runtime.runtime import OneShot, Runtime
from tether.runtime.scripted import AsyncScripted, Scripted
from tether.runtime.worker import CommandResult, TurnContext
from tether.wire.errors import (
    DriverNotFound,
    InvalidParams,
    NotFound,
    ParentOffline,
    Preempted,
    StoreLocked,
    StoreUnavailable,
    TetherError,
    TurnFailed,
    Unauthorized,
)
from tether.wire.frames import Cancel, Steer
from tether.wire.records import (
    AgentInfo,
    AgentRef,
    ChildTurnEnded,
    Entry,
    Event,
    Message,
    PendingMessage,
    ProcessFate,
    StopReport,
    ToolFate,
    TurnRecord,
)

__all__ = [
    "AgentInfo",
    "AgentRef",
    "Ancestor",
    "AsyncScripted",
    "AsyncTurnContext",
    "Cancel",
    "ChildTurnEnded",
    "CommandResult",
    "DriverNotFound",
    "Entry",
    "Event",
    "InvalidParams",
    "Message",
    "NotFound",
    "OneShot",
    "ParentOffline",
    "PendingMessage",
    "Preempted",
    "ProcessFate",
    "Runtime",
    "Scripted",
    "Steer",
    "StopReport",
    "StoreLocked",
    "StoreUnavailable",
    "TetherError",
    "ToolFate",
    "TurnContext",
    "TurnFailed",
    "TurnRecord",
    "Unauthorized",
    "User",
    "tools",
]
