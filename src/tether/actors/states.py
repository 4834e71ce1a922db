"""An agent's lifecycle as an explicit enum with a transition table (semantics §3)."""

from __future__ import annotations

from tether.wire.records import AgentState

__all__ = ["TRANSITIONS", "AgentState", "IllegalTransition", "check_transition"]


_S = AgentState

# DORMANT or IDLE -> PAUSED: at a start on a store, a turn the dead host had paused
# recovers paused (semantics §17.1), and its session goes live in that state.
TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    _S.DORMANT: frozenset({_S.IDLE, _S.PARKED, _S.RUNNING, _S.PAUSED, _S.SETTLED}),
    _S.IDLE: frozenset({_S.RUNNING, _S.PAUSED, _S.PARKED, _S.DISPOSING, _S.DORMANT, _S.SETTLED}),
    _S.PARKED: frozenset({_S.RUNNING, _S.DISPOSING, _S.DORMANT, _S.SETTLED}),
    _S.RUNNING: frozenset({_S.RUNNING, _S.PAUSED, _S.IDLE, _S.PARKED, _S.DISPOSING, _S.SETTLED}),
    # resumed; or its turn ended while frozen (an abort); or disposed (which aborts it)
    _S.PAUSED: frozenset({_S.RUNNING, _S.IDLE, _S.PARKED, _S.DISPOSING, _S.SETTLED}),
    _S.DISPOSING: frozenset({_S.SETTLED}),
    _S.SETTLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug: the agent tried a transition the table does not allow."""


def check_transition(old: AgentState, new: AgentState) -> None:
    if old != new and new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old} -> {new}")
