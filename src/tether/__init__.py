"""Tether: an actor-model runtime for agents that spawn subagents.

Layering (imports only ever point down; ``src/tether/CONVENTIONS.md`` has the rules):

    tether.serve, tether.cli   the outside faces: the HTTP server and the command
        |
        v
    tether.runtime   processes and the outside world: the Runtime facade, worker pool,
        |            worker turn loop, SQLite store, backends
        v
    tether.actors    pykka actors: the supervisor (catalog, spawn, dispose, discovery) and
        |            a few session hosts, each serving many sessions' state machines
        |            (inbox, state, turn, interrupts) one message at a time; they reach
        |            the pool and the store only through the Protocols in actors.ports
        |
        |   tether.driver   what a driver author imports: the turn contexts, the scripted
        |       |           drivers, the agent tools; the worker (runtime) imports it,
        v       v           it imports only wire
    tether.wire      msgspec Structs and codecs; depends on nothing of ours
"""

from tether import tools
from tether.actors.authority import Ancestor, User
from tether.driver import AsyncScripted, AsyncTurnContext, CommandResult, Scripted, TurnContext
from tether.runtime.runtime import OneShot, Runtime
from tether.wire.budget import Budget, BudgetStatus
from tether.wire.errors import (
    BudgetExhausted,
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
    "Budget",
    "BudgetExhausted",
    "BudgetStatus",
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
