"""An MCP client of a live ``tether serve``'s ``/mcp``, over the official SDK's streamable
HTTP transport, and its calls of Tether's tools (the MCP face's tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tether_server import LiveServer

__all__ = ["call", "http_session", "ok"]


@asynccontextmanager
async def http_session(
    server: LiveServer, token: str | None = None, owner: str | None = None
) -> AsyncIterator[ClientSession]:
    token = token or server.token  # the server's own, made or given, unless another
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if owner is not None:
        headers["Tether-Owner"] = owner
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(server.url + "/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def call(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert result.structured_content is not None, result
    out: dict[str, Any] = result.structured_content
    assert result.is_error == ("error" in out), result
    return out


async def ok(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    out = await call(session, tool, **arguments)
    assert "error" not in out, (tool, out)
    return out
