"""The one shape of an HTTP refusal that ``tether serve`` makes itself: JSON ``{"error": ...}``."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

__all__ = ["http_error"]


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    body = msgspec.json.encode({"error": message})
    return Response(body, status, headers=headers, media_type="application/json")
