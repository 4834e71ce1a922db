"""What the protocol faces (MCP at ``/mcp`` and ``tether mcp``, A2A at ``/a2a``) share.

The faces need the extra ``tether-runtime[agents]`` (the official ``mcp`` and ``a2a-sdk``
packages); this module imports neither, so ``tether serve`` runs without them and says
so when ``/mcp`` or ``/a2a`` is asked for. What the faces take and read is in
``face_kit``, which imports no face.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from tether import Runtime
from tether.serve.face_kit import FaceOptions
from tether.wire.errors import InvalidParams

__all__ = ["AGENTS_EXTRA", "Face", "build_faces", "load_config", "missing_extra"]

AGENTS_EXTRA: Final = "pip install 'tether-runtime[agents]'"


def load_config(path: str | Path | None) -> dict[str, Any] | None:
    """A driver config from a JSON file (``--config FILE``); None without one."""
    if path is None:
        return None
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidParams(f"--config {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidParams(f"--config {path}: a driver config is a JSON object")
    return doc


def missing_extra(face: str) -> str | None:
    """None when the packages of ``face`` ("mcp" or "a2a") are importable, else why not."""
    module = {"mcp": "mcp.server.lowlevel", "a2a": "a2a.server.routes"}[face]
    try:
        importlib.import_module(module)
    except ImportError:
        return f"the {face.upper()} face needs the extra tether-runtime[agents]: {AGENTS_EXTRA}"
    return None


class Face(Protocol):
    """A protocol face on ``tether serve``: its routes (behind the server's guard) and
    what must run while the server does."""

    routes: list[BaseRoute]

    def lifespan(self) -> AbstractAsyncContextManager[None]: ...


class _Missing:
    """A face whose packages are not installed: its paths answer 501 and say why."""

    def __init__(self, paths: list[str], why: str) -> None:
        body = msgspec.json.encode({"error": why})

        async def refuse(_: Request) -> Response:
            return Response(body, 501, media_type="application/json")

        self.routes: list[BaseRoute] = [
            Route(p, refuse, methods=["GET", "POST", "DELETE"]) for p in paths
        ]

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        yield


def build_faces(rt: Runtime, options: FaceOptions) -> list[Face]:
    """MCP at ``/mcp`` and A2A at ``/a2a`` (with its Agent Card), each imported only
    here, so that a server without the extra still starts."""
    faces: list[Face] = []
    why = missing_extra("mcp")
    if why is not None:
        faces.append(_Missing(["/mcp"], why))
    else:
        from tether.serve.mcp_face import McpHttp

        faces.append(McpHttp(rt, options))
    why = missing_extra("a2a")
    if why is not None:
        faces.append(_Missing(["/a2a", "/a2a/", "/.well-known/agent-card.json"], why))
    else:
        from tether.serve.a2a_face import A2aHttp

        faces.append(A2aHttp(rt, options))
    return faces
