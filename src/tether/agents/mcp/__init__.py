"""MCP tools for agents: servers' tools offered as ``mcp__<server>__<tool>``, and every stop
of a call carried to the server.

One ``McpTools`` per worker, a task per connection and per call: ``_config`` (the servers
and tool policies, checked), ``_transport`` (a connection), ``_calls`` (the tools, their
limits and stops), ``_results``. How a call is stopped, and what each wait is bounded by:
docs/design.md, section 12.2.
"""

from tether.agents.mcp._calls import McpTools
from tether.agents.mcp._config import ToolPolicy
from tether.agents.mcp._results import McpResult, McpTimeout, McpUnavailable

__all__ = ["McpResult", "McpTimeout", "McpTools", "McpUnavailable", "ToolPolicy"]
