"""The stall watchdog (semantics §14.5): a turn that shows no progress for its policy's
``after`` seconds gets the policy's steps, one every ``every`` seconds, each an interrupt
of origin ``watchdog`` issued through its session; progress starts the ladder again.

Its clock runs from when a worker takes the turn (never while the turn waits for one),
stops while the turn is paused and starts afresh when it resumes; the same tool call over
and over is no progress. These are the session's helpers: its host's thread calls them,
with the session and its running turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from tether.actors.clock import Timer
from tether.actors.stops import Interrupt
from tether.actors.turn import Turn
from tether.wire.errors import TetherError
from tether.wire.frames import Progress
from tether.wire.vocab import Kind, StallPolicy

if TYPE_CHECKING:
    from tether.actors.agent import Session

__all__ = [
    "Watch",
    "fired",
    "pause",
    "progress",
    "progress_every",
    "resume",
    "start",
    "stop",
    "took",
]

log = structlog.get_logger("tether.agent")


@dataclass(slots=True)
class Watch:
    """What the watchdog keeps of one watched turn."""

    policy: StallPolicy
    last_progress: float  # monotonic
    timer: Timer | None = None  # armed while the ladder has steps left and it is not paused
    stepped_at: float = 0.0
    step: int = 0  # the ladder's next step
    in_tool: bool = False  # a command runs: a preempt has something to stop
    # A worker has taken the turn (the executor said so, or its first report came): the
    # clock runs from there, never while the turn waits for a free worker.
    started: bool = False


def progress_every(stall: StallPolicy) -> float:
    """How often a worker reports progress: a few times a second at most, and often
    enough that the watchdog's clock is a small fraction of ``after`` late."""
    return min(0.25, stall.after / 8)


def start(s: Session, t: Turn) -> None:
    """A turn of a session with a policy starts: its clock runs (from a worker's taking
    it, ``took``)."""
    stall = s.stall
    if stall is not None:
        t.watch = w = Watch(stall, s.services.clock.monotonic())
        _arm(s, t, w, stall.after)


def took(s: Session, t: Turn) -> None:
    """A worker took the turn: the clock runs from now."""
    w = t.watch
    if w is None or w.started:
        return
    w.started = True
    w.last_progress = max(w.last_progress, s.services.clock.monotonic())


def progress(s: Session, t: Turn, frame: Progress) -> None:
    """The worker's meter: progress, unless the same call over and over."""
    w = t.watch
    if w is None:
        return
    w.in_tool = frame.in_tool
    if not w.started or not frame.looping:
        w.started = True
        w.last_progress = s.services.clock.monotonic()
        w.step = 0
        if w.timer is None and not t.paused and not s.disposing:
            # the ladder had run out: progress starts it again (a turn that stalls
            # again after it recovered is watched again)
            _arm(s, t, w, w.policy.after)


def pause(t: Turn) -> None:
    """A pause: a paused turn is never stalled."""
    w = t.watch
    if w is not None and w.timer is not None:
        w.timer.cancel()
        w.timer = None


def resume(s: Session, t: Turn) -> None:
    """A resume: a fresh idle clock (the pause was not a stall)."""
    w = t.watch
    if w is not None:
        w.last_progress = s.services.clock.monotonic()
        w.step = 0
        _arm(s, t, w, w.policy.after)


def stop(t: Turn) -> None:
    """The turn ended."""
    w = t.watch
    if w is not None and w.timer is not None:
        w.timer.cancel()


def _arm(s: Session, t: Turn, w: Watch, delay: float) -> None:
    if w.timer is not None:
        w.timer.cancel()
    w.timer = s.services.arm(s.id, t.id, "watchdog", max(delay, 0.0), 0)


def fired(s: Session, t: Turn) -> None:
    """The clock fired: the ladder's next step if the turn has been idle long enough."""
    w = t.watch
    if w is None:
        return
    w.timer = None
    if t.paused or s.disposing or t.approvals:
        return  # paused, or waiting for decisions: the clock starts afresh after
    stall = w.policy
    now = s.services.clock.monotonic()
    after = stall.after
    every = stall.every or after
    if not w.started:
        # Still waiting for a worker: a turn that never ran cannot have stalled.
        # Look again later.
        _arm(s, t, w, after)
        return
    if w.step == 0:
        since, wait = w.last_progress, after
    else:
        since, wait = max(w.last_progress, w.stepped_at), every
    due = since + wait
    if now < due:
        _arm(s, t, w, due - now)
        return
    steps = stall.steps
    idle = now - w.last_progress
    while w.step < len(steps):
        kind = steps[w.step]
        w.step += 1
        if kind == "preempt" and not w.in_tool:
            continue  # nothing to preempt: the next step
        _step(s, t, w, kind, idle)
        break
    w.stepped_at = now
    if w.step < len(steps) and s.turn is t:
        _arm(s, t, w, every)


def _step(s: Session, t: Turn, w: Watch, kind: Kind, idle: float) -> None:
    stall = w.policy
    why = f"no progress for {idle:.0f} s"
    text = f"{why}: {stall.nudge}" if kind == "steer" else why
    grace = stall.grace or s.services.grace
    log.info("watchdog.step", session=s.id, turn=t.id, kind=kind, idle=idle)
    if s.services.events.wants("watchdog.step"):
        s.emit("watchdog.step", {"turn": t.id, "step": w.step, "kind": kind, "idle": idle})
    try:
        s.interrupt(Interrupt(kind, "watchdog", "watchdog", text, grace))
    except TetherError as exc:  # a steer refused (too much held): the ladder goes on
        log.warning("watchdog.step_refused", session=s.id, turn=t.id, error=exc.message)
