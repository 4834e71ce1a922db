"""Real outside services for tests and demos (semantics §15.3-15.4): an OpenAI-compatible
model server that replays a script (``tether.testing.model_server``) and an MCP tool
server built with the official SDK (``tether.testing.mcp_server``). No key, no network.
Nothing in the engine imports this room.

The names load on first use, so that ``python -m tether.testing.model_server`` runs the
module once, as ``__main__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tether.testing.model_server import Disconnect, ModelServer, Request

__all__ = ["Disconnect", "ModelServer", "Request"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tether.testing import model_server

        return getattr(model_server, name)
    raise AttributeError(f"module 'tether.testing' has no attribute {name!r}")
