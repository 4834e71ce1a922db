"""What the protocol faces (MCP at ``/mcp`` and ``tether mcp``, A2A at ``/a2a``) share.

The faces need the extra ``tether[agents]`` (the official ``mcp`` and ``a2a-sdk``
packages); this module imports neither, so ``tether serve`` runs without them and says
so when ``/mcp`` or ``/a2a`` is asked for. It also holds the few runtime reads both faces
make while they wait for a turn: they poll the store's pages (``after``/``limit``), never
a whole transcript at once.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from tether import Entry, Runtime, TurnRecord
from tether.wire.errors import InvalidParams

__all__ = [
    "AGENTS_EXTRA",
    "DEFAULT_DRIVER",
    "Face",
    "FaceOptions",
    "build_faces",
    "last_seq",
    "load_config",
    "missing_extra",
    "turn_entries",
    "turn_of_message",
    "turn_record",
]

DEFAULT_DRIVER: Final = "tether:Scripted"
AGENTS_EXTRA: Final = "pip install 'tether-runtime[agents]'"
_PAGE: Final = 500


@dataclass(frozen=True)
class FaceOptions:
    """The driver and config of the root sessions that MCP and A2A clients open, the
    roots every MCP client holds from the start (``--root``), and the deadline after
    which an A2A ``CancelTask`` that reached no boundary escalates to an abort."""

    driver: str = DEFAULT_DRIVER
    config: dict[str, Any] | None = None
    roots: tuple[str, ...] = ()
    cancel_deadline: float | None = 30.0
    bearer: bool = False  # the server asks for a bearer token (the Agent Card says so)


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
        return f"the {face.upper()} face needs the extra tether[agents]: {AGENTS_EXTRA}"
    return None


def last_seq(rt: Runtime, session: str) -> int:
    """The seq of the session's last transcript entry (0 for none), page by page."""
    after = 0
    while True:
        page = rt.transcript(session, after=after, limit=_PAGE)
        if not page:
            return after
        after = page[-1].seq
        if len(page) < _PAGE:
            return after


def turn_entries(
    rt: Runtime, session: str, turn: str, after: int, limit: int = _PAGE
) -> tuple[list[Entry], int]:
    """Entries of ``turn`` past seq ``after`` (one page), and the cursor to go on from."""
    page = rt.transcript(session, after=after, limit=limit)
    cursor = page[-1].seq if page else after
    return [e for e in page if e.turn == turn], cursor


def turn_of_message(rt: Runtime, session: str, message: str) -> TurnRecord | None:
    """The turn that claimed ``message``, once one has."""
    return next((t for t in reversed(rt.turns(session)) if t.message == message), None)


def turn_record(rt: Runtime, session: str, turn: str) -> TurnRecord | None:
    return next((t for t in reversed(rt.turns(session)) if t.id == turn), None)


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
