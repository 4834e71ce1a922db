"""What a call gives back: its result, or one of the two errors of MCP's own."""

from __future__ import annotations

from typing import Literal

import msgspec

from tether.wire.errors import TetherError

__all__ = ["McpResult", "McpTimeout", "McpUnavailable"]


class McpResult(msgspec.Struct, frozen=True):
    """What a call returned: the tool's text, or a one-line error."""

    text: str
    is_error: bool = False
    request_id: str | None = None


class McpTimeout(TetherError):
    """A call exceeded its ``max_duration`` or ``idle_timeout`` and was stopped."""

    code = "mcp-timeout"

    def __init__(self, kind: Literal["max_duration", "idle_timeout"], partial: str) -> None:
        super().__init__(f"mcp call exceeded its {kind}")
        self.kind = kind
        self.partial = partial


class McpUnavailable(TetherError):
    """A server could not be started or reached (the message says which, and why)."""

    code = "mcp-unavailable"
