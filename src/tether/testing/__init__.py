"""Real outside services for tests and demos (SPEC §15.3-15.4): an MCP tool server built
with the official SDK. Nothing in the engine imports this room."""

__all__: list[str] = []
