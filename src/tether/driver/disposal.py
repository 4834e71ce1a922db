"""Worker-side hooks for disposed sessions: what an agent kit keeps across turns.

A driver may keep something in its worker process from one turn to the next (the agent
kit's MCP servers). When sessions are settled for good, the host tells every worker that
may hold something of theirs (``Disposed``), and the worker runs each hook registered
here with their ids, between turns, on its one event loop. The engine never imports a
kit: the kit registers its hook here when its module is imported in the worker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

__all__ = ["DisposalHook", "disposal_hooks", "on_disposed"]

# Called with the disposed sessions' ids; may return an awaitable, which the worker runs
# on its event loop (bounded) before it takes its next turn.
DisposalHook = Callable[[list[str]], Awaitable[None] | None]

_hooks: list[DisposalHook] = []


def on_disposed(hook: DisposalHook) -> DisposalHook:
    """Register ``hook`` (once: registering it again changes nothing); returns it, so it
    may be used as a decorator."""
    if hook not in _hooks:
        _hooks.append(hook)
    return hook


def disposal_hooks() -> list[DisposalHook]:
    """The hooks registered in this process, in order."""
    return list(_hooks)
