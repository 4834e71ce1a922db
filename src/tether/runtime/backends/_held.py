"""What waits for a turn that cannot take it now, and the bound on it.

A turn waiting for a worker (its claim being committed, or no worker free) keeps the
frames issued to it here; they ride in its start frame. Steers and preempts count
against ``HELD_BYTES`` and one past it is refused: a paused or waiting turn's memory
stays bounded, and its start frame far under the frame cap. A cancel, an escalation or
an answer is never refused. A paused worker's outbox is held to the same bound (the
pool's channel counts it).
"""

from __future__ import annotations

import msgspec

from tether.actors.ports import TurnSpec
from tether.wire.errors import InvalidParams
from tether.wire.frames import CancelFrame, HostFrame, Preempt, RunTurn, SteerFrame

__all__ = ["HELD_BYTES", "Held", "held_over"]

HELD_BYTES = 1 << 20
_encoder = msgspec.msgpack.Encoder()


def held_over(frame: HostFrame, held: int) -> InvalidParams:
    """The refusal of a steer or preempt that would pass HELD_BYTES."""
    what = "steer" if isinstance(frame, SteerFrame) else "preempt"
    return InvalidParams(
        f"{what} refused: {held} bytes of steers and preempts already wait for this turn,"
        f" which cannot take them now (it is paused, or waits for a worker); at most"
        f" {HELD_BYTES} bytes may wait. Resume the turn, or wait for it to start."
    )


class Held:
    """The frames held for one turn until a worker takes it, in issue order."""

    __slots__ = ("bytes", "frames")

    def __init__(self) -> None:
        self.frames: list[HostFrame] = []
        self.bytes = 0  # steers and preempts among ``frames``, encoded

    def hold(self, frame: HostFrame) -> None:
        """Keep ``frame``; InvalidParams (nothing kept) for a steer or preempt past
        HELD_BYTES."""
        if isinstance(frame, SteerFrame | Preempt):
            size = len(_encoder.encode(frame))
            if self.bytes + size > HELD_BYTES:
                raise held_over(frame, self.bytes)
            self.bytes += size
        self.frames.append(frame)

    def start(
        self, spec: TurnSpec, keys: dict[str, str] | None = None, hide: list[str] | None = None
    ) -> tuple[RunTurn, list[HostFrame]]:
        """The frame that starts ``spec`` on a worker, and the held frames that follow
        it, in order; nothing is held after. Steers and a cancel issued before dispatch
        ride inside RunTurn, so the driver has them at its very first boundary (sent
        after it, they could reach the worker's reader only once the driver had passed
        that boundary). ``keys`` and ``hide``: the turn's share of the host's secrets
        (``WorkerHost.turn_secrets``)."""
        ride = [f for f in self.frames if isinstance(f, SteerFrame | CancelFrame)]
        rest: list[HostFrame] = [
            f for f in self.frames if not isinstance(f, SteerFrame | CancelFrame)
        ]
        self.frames = []
        self.bytes = 0
        run = RunTurn(
            turn=spec.turn,
            session=spec.session,
            driver=spec.driver,
            message=spec.message,
            config=spec.config,
            permissions=spec.permissions,
            progress_every=spec.progress_every,
            repeat=spec.repeat,
            held=ride,
            trace=spec.trace,
            keys=keys,
            hide=hide or [],
            recovered=spec.recovered,
        )
        return run, rest
