"""The web console: static files served by ``tether serve`` at ``/``.

The page is a handful of hand-written ES modules next to this file; the browser loads
them as they are (no bundler, no npm, nothing from a CDN), and the wheel ships them as
package data. The files are read once, when the app is built, and served from memory by
exact name, so no request path ever reaches the filesystem.

The page's files hold no secrets: with a token they are served without one (the page
then asks for the token and sends it on every RPC and ``/events`` request); without a
token the server's loopback ``Host``/``Origin`` rule applies to them as to every route.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

__all__ = ["PREFIX", "console_routes", "is_console_path"]

PREFIX: Final = "/console/"

_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

# Only our own files, no inline script or style, no frames, no form posts elsewhere:
# even if some text were ever rendered as HTML, the browser would not run it.
_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _load() -> dict[str, tuple[bytes, str]]:
    files: dict[str, tuple[bytes, str]] = {}
    for item in resources.files(__name__).iterdir():
        suffix = "." + item.name.rpartition(".")[2]
        if item.is_file() and suffix in _TYPES:
            files[item.name] = (item.read_bytes(), _TYPES[suffix])
    return files


def is_console_path(method: str, path: str) -> bool:
    """A request for one of the page's files (which the token does not guard)."""
    return method in ("GET", "HEAD") and (path == "/" or path.startswith(PREFIX))


def console_routes() -> list[BaseRoute]:
    """``GET /`` (the page) and ``GET /console/{name}`` (its modules and styles)."""
    files = _load()

    def serve(name: str) -> Response:
        found = files.get(name)
        if found is None:
            return Response(b"not found", 404, media_type="text/plain")
        body, media_type = found
        return Response(body, media_type=media_type, headers=_HEADERS)

    async def index(_: Request) -> Response:
        return serve("index.html")

    async def asset(request: Request) -> Response:
        return serve(str(request.path_params["name"]))

    return [
        Route("/", index, methods=["GET", "HEAD"]),
        Route(PREFIX + "{name}", asset, methods=["GET", "HEAD"]),
    ]
