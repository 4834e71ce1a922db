"""Who may reach ``tether serve``: loopback, the Host and Origin a browser sends (against
DNS rebinding), and the bearer token when one is set."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from typing import Final
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tether.serve.refusals import http_error
from tether.serve.token import blank_is_none
from tether.serve.web import is_console_path

__all__ = ["Guard", "is_loopback"]


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost``: the only binds that need no token."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


class Guard:
    """Access control for every route.

    With a token, a request needs ``Authorization: Bearer <token>`` (compared in constant
    time), except the web console's own static files, which hold no secret: the page asks
    for the token and sends it with each request it makes. Without one the server is
    loopback-only, and it refuses what a web page in a local browser could send: a foreign
    ``Host`` (DNS rebinding) or a foreign ``Origin`` (the console's files included).
    """

    def __init__(self, app: ASGIApp, *, token: str | None) -> None:
        self._app = app
        token = blank_is_none(token)  # an empty or blank token is no token
        self._token = None if token is None else _digest(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            public = is_console_path(scope["method"], scope["path"])
            denied = self._check(Headers(scope=scope), public=public)
            if denied is not None:
                await denied(scope, receive, send)
                return
        await self._app(scope, receive, send)

    def _check(self, headers: Headers, *, public: bool = False) -> Response | None:
        host = _host_header(headers.get("host", ""))
        if host is None:
            return http_error(400, "bad request: malformed Host header")
        if self._token is not None and public:
            return None
        if self._token is not None:
            scheme, _, credential = headers.get("authorization", "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                _digest(credential.strip()), self._token
            ):
                return None
            return http_error(401, "unauthorized", {"WWW-Authenticate": "Bearer"})
        origin = headers.get("origin")
        origin_host = "localhost" if origin is None else _hostname(origin)
        if origin_host is not None and is_loopback(host) and is_loopback(origin_host):
            return None
        return http_error(403, "forbidden: foreign Host or Origin on a loopback server")


_HOST: Final = re.compile(r"(\[[^\[\]]*\]|[^\[\]/@:?#\s]*)(?::[0-9]{1,5})?")


def _host_header(value: str) -> str | None:
    """The host a ``Host`` header names, or None if it is not ``host[:port]`` (with an
    IPv6 address in brackets)."""
    found = _HOST.fullmatch(value)
    if found is None:
        return None
    name = found.group(1)
    if name.startswith("["):
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    return name


def _hostname(url: str) -> str | None:
    """The host part of ``url`` ("" if none), or None when it cannot be parsed: a header
    like ``[::1`` or ``http://[evil]`` is the client's error, never a server fault."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return None
