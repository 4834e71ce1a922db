"""The agent kit (SPEC §15.1-15.3): what a model-driven agent uses inside a turn.

Above the engine: nothing in tether.wire, tether.actors or tether.runtime imports it.
"""

from tether.agents.mcp import McpResult, McpTimeout, McpTools, McpUnavailable, ToolPolicy

__all__ = ["McpResult", "McpTimeout", "McpTools", "McpUnavailable", "ToolPolicy"]
