"""The error hierarchy: one root, a stable ``.code`` per subclass.

The code is what crosses the wire (RPC ``error.data.code``, tool results), so it never
changes once published; the message is for people.
"""

from __future__ import annotations

__all__ = [
    "AlreadyDecided",
    "BudgetExhausted",
    "DriverNotFound",
    "FrameError",
    "InvalidParams",
    "NotFound",
    "ParentOffline",
    "Preempted",
    "StoreLocked",
    "StoreUnavailable",
    "TetherError",
    "TurnFailed",
    "Unauthorized",
    "error_from_code",
]


class TetherError(Exception):
    """Root of every error Tether raises on purpose."""

    code: str = "internal"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)
        self.message = message or self.code


class Unauthorized(TetherError):
    """The caller has no authority over the target (semantics §6). Nothing was changed."""

    code = "subagent-unauthorized"


class ParentOffline(TetherError):
    """A ``User`` send whose durable parent is not live."""

    code = "parent-offline"


class NotFound(TetherError):
    """No session (or other record) with that id."""

    code = "not-found"


class DriverNotFound(TetherError):
    """The driver import string does not name a loadable class."""

    code = "driver-not-found"


class InvalidParams(TetherError):
    """Bad input: unknown kind, oversized content, empty steer, closed inbox, ..."""

    code = "invalid-params"


class BudgetExhausted(TetherError):
    """A budget of the tree (semantics §16.2) is spent: no spawn below it until it is raised."""

    code = "budget-exhausted"


class TurnFailed(TetherError):
    """A one-shot's turn ended with an outcome other than ``completed``."""

    code = "turn-failed"


class FrameError(TetherError):
    """A frame that could not be decoded, or one over the size cap."""

    code = "frame-error"


class Preempted(TetherError):
    """Raised by ``ctx.run_command`` (and, for an async driver, by the innermost
    ``ctx.call_tool`` or ``ctx.preemptable`` await) when the running tool was preempted.

    Where the worker knows them: who preempted it (``origin``, ``by``), why (``reason``),
    how long the tool had run (``elapsed``, seconds) and what it wrote until then
    (``partial``), so that a driver can give its model an honest tool result.
    """

    code = "preempted"

    def __init__(
        self,
        message: str = "",
        *,
        origin: str | None = None,
        by: str | None = None,
        reason: str = "",
        elapsed: float | None = None,
        partial: str = "",
    ) -> None:
        super().__init__(message)
        self.origin = origin
        self.by = by
        self.reason = reason
        self.elapsed = elapsed
        self.partial = partial


class StoreUnavailable(TetherError):
    """The store cannot commit (disk full, its write lock held elsewhere, or it has failed
    for good): the call was refused and nothing of it was recorded."""

    code = "store-unavailable"


class AlreadyDecided(TetherError):
    """The approval was decided already (semantics §17.2): the first decision stands; the
    message says how it was decided."""

    code = "already-decided"


class StoreLocked(TetherError):
    """Another live host holds the store; the message names its path and that host's pid."""

    code = "store-locked"


_BY_CODE: dict[str, type[TetherError]] = {
    cls.code: cls
    for cls in (
        Unauthorized,
        ParentOffline,
        NotFound,
        DriverNotFound,
        InvalidParams,
        BudgetExhausted,
        TurnFailed,
        FrameError,
        Preempted,
        StoreUnavailable,
        StoreLocked,
        AlreadyDecided,
    )
}


def error_from_code(code: str, message: str) -> TetherError:
    """Rebuild a typed error on the far side of a channel; unknown codes stay generic."""
    return _BY_CODE.get(code, TetherError)(message)
