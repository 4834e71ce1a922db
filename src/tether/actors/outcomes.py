"""How a turn ended, decided from what happened to it (semantics §5, §14.4, §14.5).

A pure function of the turn's facts, gathered by the session when the turn has ended:
the stop that stands (the first cancel, or an abort, which overrides a pending cancel),
how the worker ended (its end report, or no report: its tree died), and which kills the
session requested and why. Requested is kept apart from took effect: a grace or
deadline that ran out only *requested* a kill, so ``forced`` and ``escalated`` hold only
when the worker did die without an end report; a worker that got its end out first was
neither forced nor escalated.

A preempt never decides an outcome: it stops a tool and the turn goes on (semantics §5), so
a preempted turn ends as its worker ends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tether.wire.records import Origin, Outcome, Stop, StopOrigin

__all__ = ["TurnFacts", "TurnOutcome", "WorkerEnd", "decide_outcome"]

# What the worker reported at the end: ``TurnEnd.outcome``, or ``died`` when no end came
# (its tree was killed, on purpose or not, or it crashed).
WorkerEnd = Literal["completed", "cancelled", "failed", "died"]


@dataclass(frozen=True, slots=True)
class TurnFacts:
    stop: Stop | None  # the stop that stands at the turn's end: a cancel or an abort
    end: WorkerEnd
    # The grace after the cancel's delivery ran out and the session asked for a kill.
    force_requested: bool = False
    # No boundary took the cancel before its deadline and the session asked for a kill.
    escalate_requested: bool = False
    # The error the worker reported (in its end report, or the executor's for a death).
    error: str | None = None


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    outcome: Outcome
    cause: Origin | None  # None for a turn nobody stopped
    by: str | None
    reason: str | None
    forced: bool
    escalated: bool
    error: str | None


def _cause(origin: StopOrigin) -> Origin:
    match origin:
        case "user" | "parent" as cause:
            return cause
        case _:  # the watchdog, a budget, the runtime
            return "system"


def decide_outcome(facts: TurnFacts) -> TurnOutcome:
    """The turn's outcome, cause, ``by``, reason, ``forced``, ``escalated`` and error."""
    stop = facts.stop
    died = facts.end == "died"
    # Only a kill that happened counts: the session asked for one, and no end came.
    forced = facts.force_requested and died
    escalated = facts.escalate_requested and died
    if stop is not None:
        # An escalated cancel is an abort (semantics §5); a forced one is still cancelled.
        outcome: Literal["cancelled", "aborted"] = (
            "aborted" if stop.kind == "abort" or escalated else "cancelled"
        )
        # The watchdog's and the budget's stops are the system's (semantics §14.5, §16.2);
        # their `by` says which.
        cause = _cause(stop.origin)
        # Killed on purpose: the stop says why, the executor's error would not.
        error = None if died else facts.error
        return TurnOutcome(outcome, cause, stop.by, stop.reason, forced, escalated, error)
    if died:  # nobody stopped it and it died: a crash, the system's
        return TurnOutcome("crashed", "system", None, None, forced, escalated, facts.error)
    # The worker's own end. (A worker reports "cancelled" only for a cancel it was
    # given, so it never comes without a stop; it would read as completed.)
    ended: Literal["completed", "failed"] = "failed" if facts.end == "failed" else "completed"
    return TurnOutcome(ended, None, None, None, forced, escalated, facts.error)
