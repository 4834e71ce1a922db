"""Durable turns (semantics §17.1), the session's helper: a tool call's write-ahead, and a
turn that runs on after a crash.

Functions the session calls on its host's thread, with itself and its turn, as its other
helpers are (``actors.stops``, ``actors.watchdog``):

- ``begin_call``: a tool call's start, queued after every entry its worker reported
  before it (the reply that asked for the call), answered with its key once durable;
- ``crashed``: a worker died of something Tether did not do: the turn recovers, or ends
  as before (past ``max_recoveries``, saying so);
- ``recover``: the same turn on a fresh worker, from its last durable step;
- ``recover_kept``: a turn a dead host left open runs on, on this one;
- ``suspend``: the host closes and the turn stays open, to recover at the next start.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import structlog

from tether.actors import stops, watchdog
from tether.actors._ids import new_id
from tether.actors.ports import Durable, KeptTurn, TurnOver
from tether.actors.stops import PendingStop
from tether.actors.turn import Turn
from tether.wire.errors import TetherError
from tether.wire.frames import SteerFrame, ToolCall, ToolReply
from tether.wire.records import Recovered, RecoveryCause, Stop
from tether.wire.text import recovery_reason

if TYPE_CHECKING:
    from tether.actors.agent import Session

__all__ = ["answer_started", "begin_call", "crashed", "recover", "recover_kept", "suspend"]

log = structlog.get_logger("tether.agent")


def begin_call(s: Session, frame: ToolCall, answer: Callable[[ToolReply], None]) -> None:
    """Record the start of the tool call ``frame`` names; ``answer`` gets its key once
    durable, or the error (its tool then never runs)."""
    t = s.turn
    if t is None or t.id != frame.turn:
        answer(ToolReply(frame.turn, frame.call, code="not-found", message="no such turn"))
        return
    args = frame.args
    key = new_id("c_", s.services.clock.now())
    durable = s.services.store.begin_call(
        key,
        s.header.id,
        t.id,
        str(args.get("name", "")),
        str(args.get("arguments", "")),
        args.get("tool_call_id"),
    )

    answer_started(durable, frame, answer, key)


def answer_started(
    durable: Durable, frame: ToolCall, answer: Callable[[ToolReply], None], result: Any
) -> None:
    """Answer the tool call ``frame`` with ``result`` once its start (``durable``) is
    committed; if that commit fails, with the error, and its tool never runs."""

    def done(error: BaseException | None) -> None:
        if error is None:
            answer(ToolReply(frame.turn, frame.call, result=result))
        else:  # never run a tool whose start could not be made durable
            why = f"the call's start could not be recorded: {error}"
            answer(ToolReply(frame.turn, frame.call, code="store-unavailable", message=why))

    durable.then(done)


def crashed(s: Session, t: Turn, over: TurnOver) -> TurnOver | None:
    """A crash ended ``t``'s worker: None once the turn recovers, else how it ends (as
    before; past ``max_recoveries``, saying so). A turn with a stop in force, or of a
    session being disposed, ends as it would have: that was someone's decision. A paused
    one recovers paused."""
    h = s.header
    if not s.recovers or s.disposing:
        return over
    if t.stop is not None:
        return over
    if t.recoveries >= h.max_recoveries:
        why = f"crashed {t.recoveries + 1} times; not recovered again"
        return dataclasses.replace(over, error=why)
    recover(s, t, "worker")
    return None


def recover(s: Session, t: Turn, cause: RecoveryCause) -> None:
    """Run ``t`` again from its last durable step, on a fresh worker: the same turn,
    message and bindings, its unknown calls named to its driver, its marker first; the
    steers not yet delivered reach its first boundary, in order."""
    host, sid = s.services, s.header.id
    t.recoveries += 1
    unknown = host.store.unknown_calls(sid, t.id)
    steps = host.store.turn_steps(sid, t.id)
    t.recovered = Recovered(attempt=t.recoveries, cause=cause, steps=steps, unknown_calls=unknown)
    t.book = None  # the dead worker's open calls: its report starts afresh
    names = [c.name for c in unknown]
    reason = recovery_reason(cause, t.recoveries, steps, names)
    s.marker(t, "recovered", "system", "system", reason)
    claim = host.store.recovered(t.id, t.recoveries)  # dispatched once durable
    log.warning(
        "turn.recovered",
        session=sid,
        turn=t.id,
        attempt=t.recoveries,
        cause=cause,
        steps=steps,
        unknown=names,
    )
    if host.events.wants("turn.recovered"):
        data = {"turn": t.id, "attempt": t.recoveries, "cause": cause, "steps": steps}
        s.emit("turn.recovered", {**data, "unknown_calls": names})
    watchdog.stop(t)
    watchdog.start(s, t)  # a fresh clock, from the new worker's taking it
    try:
        host.executor.submit(s.spec(t, claim))
    except TetherError as exc:  # closed under us: it ends as a crash would
        s.ended(TurnOver(t.id, None, exc.message))
        return
    if t.paused:  # it recovers paused: no worker takes it until resumed (its claim is
        host.executor.freeze(t.id)  # still on its way: the freeze comes first)
        watchdog.pause(t)
    for steer in t.steers or ():
        host.executor.signal(t.id, SteerFrame(t.id, steer))


def recover_kept(s: Session, kept: KeptTurn) -> None:
    """The turn a dead host left open (``kept``) runs on here: back under its tree's
    budgets (timed from now: the time the host was down counts toward none), traced,
    then recovered as after a worker's crash, under the controls the dead host had
    accepted: a cancel or abort ends it as that stop would have (its report's ``via``:
    ``recovery``), a pause holds it paused, the steers no boundary took reach its first."""
    host, h = s.services, s.header
    s.turn = t = Turn(kept.turn, kept.message)
    t.recoveries = kept.recoveries
    t.last_say = host.store.last_assistant_text(h.id, t.id)
    if host.budget is not None:
        host.budget.rejoin(h.id, s.lineage, t.id)
    host.listener.turn_started(t, h, s.lineage)
    s.started_one()
    if kept.stop is not None:
        r = kept.stop
        kind: Literal["cancel", "abort"] = "abort" if r.kind == "abort" else "cancel"
        stop = Stop(kind, r.origin, r.by, r.reason)
        t.stop = PendingStop(stop, 0.0, r.requested_at, kind)
        log.info("turn.stopped_at_recovery", session=h.id, turn=t.id, kind=kind, by=r.by)
        s.ended(TurnOver(t.id, None, "the host stopped", via="recovery"))
        return
    if kept.steers:
        t.steers = deque(kept.steers, maxlen=stops.STEERS_KEPT)
    t.paused = kept.paused is not None
    recover(s, t, "host")


def suspend(s: Session) -> bool:
    """Its host closes and its turn stays open, to recover at the next start: True for
    a recoverable turn with no stop in force (those end as before); a paused one
    recovers paused."""
    t, h = s.turn, s.header
    if t is None or t.stop is not None or s.disposing:
        return False
    if not s.recovers:
        return False
    s.suspended = True
    watchdog.stop(t)
    log.info("turn.suspended", session=h.id, turn=t.id)
    return True
