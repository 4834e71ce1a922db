"""Call keys (semantics §17.1): the key Tether made for the tool call running now.

A recoverable driver writes each tool call's start before the tool runs
(``ctx.begin_call``) and runs the tool inside ``calling(key)``: the key then reaches the
tool as ``tether.current_call_id()``, as ``TETHER_CALL_ID`` in a command's environment, and
as ``_meta["tether/call_id"]`` in an MCP request, so a tool can make itself idempotent.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Final

__all__ = ["CALL_ENV", "CALL_META", "calling", "current_call_id"]

CALL_ENV: Final = "TETHER_CALL_ID"
CALL_META: Final = "tether/call_id"  # its key in an MCP request's _meta

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tether_call_id", default=None
)


def current_call_id() -> str | None:
    """The call key of the tool call running in this context, or None outside one."""
    return _current.get()


@contextlib.contextmanager
def calling(key: str | None) -> Iterator[None]:
    """Run the block as the tool call ``key`` (None: as no call)."""
    token = _current.set(key)
    try:
        yield
    finally:
        _current.reset(token)
