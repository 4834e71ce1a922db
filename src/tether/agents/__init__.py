"""The agent kit (semantics §15.1-15.3): what a model-driven agent uses inside a turn.

``"tether.agents:ChatAgent"`` is a model agent over any OpenAI-compatible endpoint;
``McpTools`` its client for MCP tool servers. This room stands on the engine's public
driver API; nothing outside it imports it (it needs the extra ``tether-runtime[agents]``: the
``openai`` client, the ``mcp`` SDK).
"""

from tether.agents.chat import ChatAgent, ModelError
from tether.agents.mcp import McpResult, McpTimeout, McpTools, McpUnavailable, ToolPolicy

__all__ = [
    "ChatAgent",
    "McpResult",
    "McpTimeout",
    "McpTools",
    "McpUnavailable",
    "ModelError",
    "ToolPolicy",
]
