"""How a turn ends, row by row: semantics §5's table (and §14.2, §14.4, §14.5) as the facts a
session gathers when a turn has ended and what ``decide_outcome`` makes of them.

Where the spec is vague the runtime's behaviour is the reference (the end-to-end suites
in ``test_interrupts.py`` and ``test_model.py`` hold it): a cancel whose worker then
dies for any reason is ``cancelled`` with no error, and an abort that overrides a cancel
already forced keeps ``forced``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tether.actors.outcomes import TurnFacts, TurnOutcome, decide_outcome
from tether.wire.records import Stop, StopOrigin

pytestmark = pytest.mark.unit  # starts no process: make test-unit


def cancel(origin: StopOrigin = "user", by: str = "s_parent", reason: str = "wrap up") -> Stop:
    return Stop("cancel", origin, by, reason)


def abort(origin: StopOrigin = "user", by: str = "s_parent", reason: str = "stuck") -> Stop:
    return Stop("abort", origin, by, reason)


@dataclass(frozen=True)
class Row:
    id: str
    facts: TurnFacts
    want: TurnOutcome


def out(
    outcome: str,
    cause: str | None = None,
    by: str | None = None,
    reason: str | None = None,
    *,
    forced: bool = False,
    escalated: bool = False,
    error: str | None = None,
) -> TurnOutcome:
    return TurnOutcome(outcome, cause, by, reason, forced, escalated, error)  # type: ignore[arg-type]


ROWS = [
    # -- nobody stopped it (steer and preempt: "the turn goes on") --------------------------
    Row(
        "a-turn-nobody-stopped-completes",
        TurnFacts(None, "completed"),
        out("completed"),
    ),
    Row(
        "a-steered-or-preempted-turn-goes-on-and-ends-as-its-worker-ends-it",
        TurnFacts(None, "completed"),
        out("completed"),
    ),
    Row(
        "a-driver-error-fails-the-turn-and-keeps-the-error",
        TurnFacts(None, "failed", error="ValueError: boom"),
        out("failed", error="ValueError: boom"),
    ),
    Row(
        "a-worker-that-dies-unasked-crashed-the-turn-cause-system",
        TurnFacts(None, "died", error="worker exited with -11"),
        out("crashed", "system", error="worker exited with -11"),
    ),
    Row(
        "a-worker-never-says-cancelled-unasked-and-it-would-read-as-completed",
        TurnFacts(None, "cancelled"),
        out("completed"),
    ),
    # -- cancel -------------------------------------------------------------------------------
    Row(
        "a-cancel-the-driver-takes-at-a-boundary-is-cancelled-with-its-cause-by-and-reason",
        TurnFacts(cancel("user", "alice", "out of budget"), "cancelled"),
        out("cancelled", "user", "alice", "out of budget"),
    ),
    Row(
        "a-parents-cancel-is-cause-parent",
        TurnFacts(cancel("parent", "s_lead", "wrong approach"), "cancelled"),
        out("cancelled", "parent", "s_lead", "wrong approach"),
    ),
    Row(
        "a-cancelled-driver-that-returns-normally-is-still-cancelled",
        TurnFacts(cancel(), "completed"),
        out("cancelled", "user", "s_parent", "wrap up"),
    ),
    Row(
        "a-cancelled-driver-that-fails-while-wrapping-up-is-cancelled-and-keeps-its-error",
        TurnFacts(cancel(), "failed", error="RuntimeError: half done"),
        out("cancelled", "user", "s_parent", "wrap up", error="RuntimeError: half done"),
    ),
    Row(
        "a-cancel-whose-grace-ran-out-and-whose-worker-was-killed-is-forced",
        TurnFacts(cancel(), "died", force_requested=True, error="killed"),
        out("cancelled", "user", "s_parent", "wrap up", forced=True),
    ),
    Row(
        "a-force-requested-loses-to-an-end-already-reported-not-forced",
        TurnFacts(cancel(), "cancelled", force_requested=True),
        out("cancelled", "user", "s_parent", "wrap up"),
    ),
    Row(
        "a-cancel-with-no-boundary-before-its-deadline-escalates-to-aborted",
        TurnFacts(cancel("parent", "s_lead", "go"), "died", escalate_requested=True),
        out("aborted", "parent", "s_lead", "go", escalated=True),
    ),
    Row(
        "an-escalation-requested-loses-to-an-end-already-reported-still-cancelled",
        TurnFacts(cancel(), "completed", escalate_requested=True),
        out("cancelled", "user", "s_parent", "wrap up"),
    ),
    Row(
        "a-cancelled-turn-whose-worker-dies-unasked-is-cancelled-without-the-error",
        TurnFacts(cancel(), "died", error="worker exited with 1"),
        out("cancelled", "user", "s_parent", "wrap up"),
    ),
    # -- abort --------------------------------------------------------------------------------
    Row(
        "an-abort-kills-the-tree-aborted-with-its-cause-and-no-error",
        TurnFacts(abort("user", "bob", "stuck"), "died", error="killed"),
        out("aborted", "user", "bob", "stuck"),
    ),
    Row(
        "an-abort-racing-a-natural-end-still-lands-on-its-turn-aborted",
        TurnFacts(abort(), "completed"),
        out("aborted", "user", "s_parent", "stuck"),
    ),
    Row(
        "an-abort-overriding-a-pending-cancel-ends-aborted-with-the-aborts-by-and-reason",
        TurnFacts(abort("parent", "s_lead", "now"), "died"),
        out("aborted", "parent", "s_lead", "now"),
    ),
    Row(
        "an-abort-overriding-a-cancel-already-forced-keeps-forced",
        TurnFacts(abort("parent", "s_lead", "now"), "died", force_requested=True),
        out("aborted", "parent", "s_lead", "now", forced=True),
    ),
    Row(
        "an-abort-of-a-paused-turn-is-aborted",  # §14.4: the frozen tree is killed at once
        TurnFacts(abort("user", "me", ""), "died"),
        out("aborted", "user", "me", ""),
    ),
    # -- the stall watchdog (§14.5): origin watchdog, cause system, by watchdog ---------------
    Row(
        "a-watchdog-cancel-is-cause-system-by-watchdog",
        TurnFacts(cancel("watchdog", "watchdog", "no progress for 30 s"), "cancelled"),
        out("cancelled", "system", "watchdog", "no progress for 30 s"),
    ),
    Row(
        "a-watchdog-abort-is-aborted-cause-system",
        TurnFacts(abort("watchdog", "watchdog", "no progress for 60 s"), "died"),
        out("aborted", "system", "watchdog", "no progress for 60 s"),
    ),
    Row(
        "a-watchdog-cancel-that-escalates-is-aborted-cause-system",
        TurnFacts(cancel("watchdog", "watchdog", "idle"), "died", escalate_requested=True),
        out("aborted", "system", "watchdog", "idle", escalated=True),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_a_turns_outcome_follows_the_interrupt_table(row: Row) -> None:
    assert decide_outcome(row.facts) == row.want


def test_every_outcome_and_cause_of_the_table_has_a_row() -> None:
    """The table above is the whole of §5: every outcome, cause and flag appears."""
    got = [decide_outcome(r.facts) for r in ROWS]
    assert {o.outcome for o in got} == {"completed", "cancelled", "aborted", "failed", "crashed"}
    assert {o.cause for o in got} == {None, "user", "parent", "system"}
    assert any(o.forced for o in got) and any(o.escalated for o in got)
    assert len({r.id for r in ROWS}) == len(ROWS)
