"""Host <-> worker frames: one tagged union per direction, one typed decoder each.

Every frame of a turn names the turn it belongs to, so a frame that arrives after its
turn ended (a late steer, a late tool reply) is recognised and dropped rather than
misapplied. A worker's own frames (a driver check, a disposal, the shutdown) name none.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tether.wire.records import Message, ProcessFate, Recovered, Stop, StopKind, StopOrigin, Via
from tether.wire.text import render_frame

__all__ = [
    "Cancel",
    "CancelFrame",
    "Delivered",
    "Disposed",
    "Escalate",
    "Escalating",
    "HostFrame",
    "Preempt",
    "Probe",
    "ProbeReply",
    "Progress",
    "Ready",
    "RunTurn",
    "Say",
    "Shutdown",
    "SpanEvent",
    "Steer",
    "SteerFrame",
    "ToolCall",
    "ToolFateName",
    "ToolKilled",
    "ToolMark",
    "ToolReply",
    "Trace",
    "TurnEnd",
    "Usage",
    "WorkerFrame",
]


def _check_kind(stop: Stop, kind: StopKind) -> None:
    # A ValueError here is a ValidationError when decoding: a worker's frame that names
    # another kind of stop is refused as any malformed frame is.
    if stop.kind != kind:
        raise ValueError(f"expected a {kind} stop, got {stop.kind!r}")


class Steer(msgspec.Struct, frozen=True):
    """A correction delivered at a boundary; the driver continues."""

    text: str
    origin: StopOrigin
    by: str

    def render(self) -> str:
        return render_frame("steer", self.origin, self.by, self.text)


class Cancel(msgspec.Struct, frozen=True):
    """A stop delivered at a boundary; the driver must wrap up and return. A driver reads
    who asked and why as ``reason``, ``origin``, ``by``; ``stop`` is the record itself."""

    stop: Stop

    def __post_init__(self) -> None:
        _check_kind(self.stop, "cancel")

    @property
    def reason(self) -> str:
        return self.stop.reason

    @property
    def origin(self) -> StopOrigin:
        return self.stop.origin

    @property
    def by(self) -> str:
        return self.stop.by

    def render(self) -> str:
        return render_frame("cancel", self.origin, self.by, self.reason)


# ---- host -> worker -----------------------------------------------------------------


class Trace(msgspec.Struct, frozen=True):
    """Telemetry for one turn (semantics §16.3), only when it is on. The worker makes the
    turn's span (``invoke_agent``) with the ids the host picked: ``parent`` is that span's
    W3C ``traceparent`` (the worker's other spans are its children), ``up`` the one it is
    a child of (None: a new trace's root), ``name``, ``root`` and ``start`` (ns since the
    epoch, when the host claimed the turn) what the host knows of it at dispatch. How the
    worker exports (``endpoint``: the OTLP base URL, None: the ``OTEL_*`` variables
    decide; ``content``: prompts, replies and tool arguments recorded)."""

    parent: str
    endpoint: str | None = None
    content: bool = False
    up: str | None = None
    name: str = ""
    root: str = ""
    start: int = 0


class RunTurn(msgspec.Struct, frozen=True, tag="run"):
    turn: str
    session: str
    driver: str
    message: Message
    config: dict[str, Any] | None = None
    permissions: dict[str, str] | None = None
    # Report progress beats (boundaries, says, tool calls and returns) at most this
    # often, in seconds; None: the session has no stall watchdog, no beats (tool calls'
    # open and close are sent anyway: see Progress).
    progress_every: float | None = None
    # The same tool called with the same arguments this many times in a row is a loop:
    # it counts as no progress (semantics §14.5).
    repeat: int | None = None
    # Steers and a cancel issued before a worker took the turn, in order: in force before
    # the driver's first boundary.
    held: list[SteerFrame | CancelFrame] = []
    trace: Trace | None = None  # None: telemetry is off
    # The session's model keys, by the variable names its config gives (semantics
    # §17.4): for its model client only, so never in the worker's environment.
    keys: dict[str, str] | None = None
    # The host's secrets by name, to take out of the worker's environment before the
    # turn runs: those the host learnt of after the worker started.
    hide: list[str] = []
    # Set when a crash interrupted this turn and it runs on from its last step
    # (semantics §17.1): the driver reads it as ``ctx.recovered``.
    recovered: Recovered | None = None


class SteerFrame(msgspec.Struct, frozen=True, tag="steer"):
    turn: str
    steer: Steer


class CancelFrame(msgspec.Struct, frozen=True, tag="cancel"):
    turn: str
    cancel: Cancel


class Preempt(msgspec.Struct, frozen=True, tag="preempt"):
    turn: str
    stop: Stop

    def __post_init__(self) -> None:
        _check_kind(self.stop, "preempt")


class ToolReply(msgspec.Struct, frozen=True, tag="reply"):
    turn: str
    call: int
    result: Any = None
    code: str | None = None
    message: str | None = None


class Escalate(msgspec.Struct, frozen=True, tag="escalate"):
    """The cancel's deadline passed with no delivery seen: unless the driver already has
    the cancel, never hand it over now (the turn is about to be killed) and answer
    ``Escalating``. The worker decides, so a delivery just before the deadline is never
    mistaken for none."""

    turn: str


class SpanEvent(msgspec.Struct, frozen=True, tag="span_event"):
    """Telemetry on: an event on the turn's span, which its worker owns (a pause or a
    resume, seen by the host at ``time``, ns since the epoch)."""

    turn: str
    name: str
    time: int
    attrs: dict[str, str]


class Probe(msgspec.Struct, frozen=True, tag="probe"):
    """Load ``driver``; with ``config``, also run its class's ``check_config`` on it (an
    adapter's factory that cannot be imported is refused at open, not at the first turn)."""

    driver: str
    config: dict[str, Any] | None = None


class Disposed(msgspec.Struct, frozen=True, tag="disposed"):
    """These sessions are settled for good: no turn of theirs will run again. A worker
    runs it between turns, never during one: what it keeps for them across turns (an
    agent kit's tool servers) may go. Names no turn: it is for the worker, not a turn."""

    sessions: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


HostFrame = (
    RunTurn
    | SteerFrame
    | CancelFrame
    | Preempt
    | ToolReply
    | Escalate
    | SpanEvent
    | Probe
    | Disposed
    | Shutdown
)


# ---- worker -> host -----------------------------------------------------------------


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    pid: int


class Say(msgspec.Struct, frozen=True, tag="say"):
    turn: str
    kind: Literal["assistant", "tool"]
    text: str
    data: dict[str, Any] | None = None
    # The usage of the model response this is the reply of (``ctx.say(..., usage=...)``):
    # counted as a ``Usage`` frame's, one frame instead of two.
    usage: dict[str, int | bool] | None = None


class ToolCall(msgspec.Struct, frozen=True, tag="call"):
    turn: str
    call: int
    name: str
    args: dict[str, Any]
    # The traceparent of the tool call's span (telemetry on): a turn the call wakes (a
    # spawn's prompt, a send) is a child of it, in the same trace.
    trace: str | None = None


class Delivered(msgspec.Struct, frozen=True, tag="delivered"):
    """Frames handed to the driver at a boundary: the host writes their markers.

    ``via`` says where the cancel reached the driver, for its stop report: at a
    ``checkpoint()`` (``boundary``), or at whatever an async driver was awaiting
    (``cancel-at-await``, semantics §15.1). ``held``: it reached the driver inside a shield
    (a ``preempt="never"`` call), which holds it back; the grace clock starts, and a
    second ``Delivered`` (not held) says when the shield let it through.
    """

    turn: str
    steers: list[Steer]
    cancel: bool = False
    via: Literal["boundary", "cancel-at-await"] = "boundary"
    held: bool = False


class ToolKilled(msgspec.Struct, frozen=True, tag="tool_killed"):
    """A preempt took effect: the running command's tree is dead. For the stop report:
    ``via`` says how the tool was stopped (its tree killed by a ``walk``, or the await on
    it cancelled, ``cancel-at-await``), ``processes`` what the kill signalled, where the
    worker noted it."""

    turn: str
    stop: Stop  # the preempt's, as its Preempt carried it
    via: Via = "walk"
    processes: list[ProcessFate] = []

    def __post_init__(self) -> None:
        _check_kind(self.stop, "preempt")


class TurnEnd(msgspec.Struct, frozen=True, tag="end"):
    turn: str
    outcome: Literal["completed", "cancelled", "failed"]
    final: str | None = None
    error: str | None = None
    # Token usage the driver reported (``ctx.add_usage``), summed over the turn.
    usage: dict[str, int | bool] | None = None


ToolFateName = Literal["returned", "preempted", "cancelled", "abandoned", "killed", "shielded"]


class ToolMark(msgspec.Struct, frozen=True, array_like=True):
    """A tool call opened (``name`` set) or closed (``fate`` set), numbered per turn."""

    id: int
    name: str | None = None
    fate: ToolFateName | None = None
    call: str | None = None  # the call's own id where it has one (an MCP request id)


class Progress(msgspec.Struct, frozen=True, tag="progress"):
    """The turn made progress since the last report (rate-limited by ``progress_every``).

    ``looping``: its last ``repeat`` tool calls were identical, which is no progress.
    ``in_tool``: a ``run_command`` is running now.

    ``tools``: tool calls that opened or closed, so that the host knows which are open
    when a stop lands (the stop report, semantics §15.6). Sent whether or not the session has
    a watchdog, as they happen, in frames of their own with ``beat=False``: the watchdog
    reads only ``beat`` frames (rate-limited) as progress. (Tool calls ride on
    Progress because every backend already routes it to the session.)
    """

    turn: str
    looping: bool = False
    in_tool: bool = False
    beat: bool = True
    tools: list[ToolMark] = []


class Usage(msgspec.Struct, frozen=True, tag="usage"):
    """What one model response cost (``ctx.add_usage``), sent as it is reported so the
    host's budgets (semantics §16.2) see it at once: a delta, e.g. ``{"prompt_tokens": 12,
    "completion_tokens": 30, "cost_microusd": 240}``, and ``"estimated": true`` where a
    count is an estimate (a cut reply's, semantics §15.2). The turn's sum still comes in
    its ``TurnEnd``."""

    turn: str
    usage: dict[str, int | bool]


class Escalating(msgspec.Struct, frozen=True, tag="escalating"):
    """Answer to ``Escalate``: the cancel was not delivered and now never will be."""

    turn: str


class ProbeReply(msgspec.Struct, frozen=True, tag="probe_reply"):
    """``error``: why the driver (or, by ``code``, its config) is refused; None: loaded.
    ``checks_config``: its class has ``check_config``, so each new config is asked too."""

    driver: str
    error: str | None = None
    code: str = "driver-not-found"
    checks_config: bool = False
    recoverable: bool = False  # its class continues a crashed turn (semantics §17.1)


WorkerFrame = (
    Ready
    | Say
    | ToolCall
    | Delivered
    | ToolKilled
    | TurnEnd
    | Progress
    | Usage
    | Escalating
    | ProbeReply
)
