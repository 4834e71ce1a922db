"""The holder's handle on a one-shot subagent (``Runtime.spawn(mode="one-shot")``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.actors.authority import Host
from tether.actors.host import InterruptOp
from tether.wire.errors import TurnFailed

if TYPE_CHECKING:
    from tether.runtime.runtime import Runtime

__all__ = ["OneShot"]


class OneShot:
    """The holder's handle on a one-shot subagent: one task, one result."""

    def __init__(self, runtime: Runtime, session: str) -> None:
        self._rt = runtime
        self.id = session

    def result(self, timeout: float | None = None) -> str | None:
        """The task's final text; TurnFailed if it did not complete."""
        self._rt.wait(self.id, until="settled", timeout=timeout if timeout is not None else 1e9)
        turns = self._rt.turns(self.id)
        if not turns:
            raise TurnFailed(f"one-shot {self.id} was disposed before it ran")
        last = turns[-1]
        if last.outcome != "completed":
            raise TurnFailed(
                f"one-shot {self.id} ended {last.outcome}: {last.error or last.reason or ''}"
            )
        return self._rt._store.last_assistant_text(self.id, last.id)

    def kill(self) -> None:
        """Hard stop, holder-owned: the turn's whole process tree is killed now."""
        self._rt._interrupt(
            InterruptOp(self.id, Host("user", "holder"), "abort", "killed by its holder", 0.0)
        )

    def dispose(self) -> None:
        self._rt._dispose(self.id, Host("user", "holder"))

    def __repr__(self) -> str:
        return f"OneShot({self.id!r})"
