"""What a session needs from the actor that hosts it: ``SessionServices``, set up by
``SessionHost`` (the machine's tests give fakes), and the kinds of its timers.

A session and its helpers read the time and arm timers only through these (``clock``,
``arm``), never ``time.*``: ``tests/unit/test_session_machine.py`` moves both by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from tether.actors.budget import Governor
from tether.actors.clock import SYSTEM_CLOCK, Clock, Timer
from tether.actors.listener import Listener, listener_for
from tether.actors.ports import AgentStore, EventSink, Executor, TurnSink
from tether.telemetry.hooks import NOOP, Telemetry
from tether.wire.records import Message

__all__ = ["SessionServices", "TimerKind"]

# The stop's clocks (``actors.stops``), the watchdog's (``actors.watchdog``) and each
# approval's timeout (``actors.approvals``).
TimerKind = Literal["grace", "deadline", "escalate", "watchdog", "approval"]


class SessionServices:
    """What a session needs from the actor that hosts it (set up by ``SessionHost``)."""

    def __init__(
        self,
        *,
        store: AgentStore,
        executor: Executor,
        events: EventSink,
        sink: Callable[[str], TurnSink],
        arm: Callable[[str, str, TimerKind, float, int], Timer],
        notify_parent: Callable[[str, Message], None],
        grace: float,
        inbox_open: Callable[[str], bool] = lambda _parent: True,
        clock: Clock = SYSTEM_CLOCK,
        cancel_deadline: float | None = None,
        telemetry: Telemetry = NOOP,
        budget: Governor | None = None,
    ) -> None:
        # The governor of every tree's budget (semantics §16.2); None: no budgets (tests of
        # the machine alone).
        self.budget = budget
        self.grace = grace  # the runtime's default, for the watchdog's cancel
        # The deadline of a cancel issued without one: a driver stuck where no boundary
        # comes (a blocking call) would otherwise keep its turn for ever.
        self.cancel_deadline = cancel_deadline
        self.store = store
        self.executor = executor
        self.events = events
        self.sink = sink
        self.arm = arm
        # A child's turn end is told to its parent as a notice message, written with
        # the end (``inbox_open``: whether the parent still takes one), then handed to
        # the parent's host to queue (``notify_parent``).
        self.notify_parent = notify_parent
        self.inbox_open = inbox_open
        # Every time the session reads: wall time for records, monotonic for clocks.
        self.clock = clock
        # What happened to the turns and their control actions, told to telemetry as
        # spans (semantics §16.3); with telemetry off, a listener that does nothing.
        self.listener: Listener = listener_for(telemetry, executor)
