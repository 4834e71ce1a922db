"""Tether: an actor-model runtime for agents that spawn subagents.

Imports only ever point down: wire <- actors <- runtime <- serve, cli; driver sits on wire.
The rules are in ``src/tether/CONVENTIONS.md``; which module holds what: docs/design.md,
section 1.
"""

from tether import tools
from tether.actors.authority import Ancestor, User
from tether.driver import AsyncScripted, AsyncTurnContext, CommandResult, Scripted, TurnContext
from tether.driver.calls import current_call_id
from tether.runtime.runtime import OneShot, Runtime
from tether.wire.approval import Approval
from tether.wire.budget import Budget, BudgetStatus
from tether.wire.errors import (
    AlreadyDecided,
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
    Recovered,
    StopReport,
    ToolFate,
    TurnRecord,
    UnknownCall,
)

__all__ = [
    "AgentInfo",
    "AgentRef",
    "AlreadyDecided",
    "Ancestor",
    "Approval",
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
    "Recovered",
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
    "UnknownCall",
    "User",
    "current_call_id",
    "tools",
]
