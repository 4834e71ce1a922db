"""What turns telemetry on, and how spans are exported (semantics §16.3).

On with ``Runtime(telemetry=True)`` or a dict of settings, or when the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set and ``telemetry`` is
left None; ``telemetry=False`` keeps it off whatever the environment says. Every other
``OTEL_*`` variable (headers, protocol, service name, resource attributes, sampler) is
read by the SDK itself, in the host and in every worker (they inherit the host's
environment).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import msgspec

from tether.wire.errors import InvalidParams

__all__ = ["ENDPOINT_ENVS", "Settings", "resolve"]

ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_KEYS = ("endpoint", "content", "service")


class Settings(msgspec.Struct, frozen=True):
    """``endpoint``: the OTLP/HTTP base URL (``http://127.0.0.1:4318``), None: the
    ``OTEL_*`` variables decide (default ``http://localhost:4318``). ``content``: record
    prompts, replies, the system prompt, tool arguments and results (off by default:
    they may hold what a person typed). ``service``: ``service.name`` unless
    ``OTEL_SERVICE_NAME`` says otherwise."""

    endpoint: str | None = None
    content: bool = False
    service: str = "tether"


def resolve(telemetry: object) -> Settings | None:
    """The settings in force for ``Runtime(telemetry=…)``; None: off.

    InvalidParams for a value of the wrong shape, or when telemetry is asked for and the
    extra is not installed; an environment that only sets ``OTEL_*`` for other programs
    leaves it off where the extra is missing, rather than failing the runtime's start.
    """
    asked: dict[str, Any]
    if telemetry is None:
        if not any(os.environ.get(name) for name in ENDPOINT_ENVS):
            return None
        if not _installed():
            return None
        asked = {}
    elif telemetry is False:
        return None
    elif telemetry is True:
        asked = {}
    elif isinstance(telemetry, dict):
        asked = dict(telemetry)
        unknown = sorted(set(asked) - set(_KEYS))
        if unknown:
            raise InvalidParams(f"telemetry: unknown keys {unknown}; keys: {', '.join(_KEYS)}")
    else:
        raise InvalidParams("telemetry must be True, False, None or a dict of settings")
    if not _installed():
        raise InvalidParams(
            "telemetry needs the extra tether-runtime[otel] (pip install 'tether-runtime[otel]')"
        )
    try:
        return msgspec.convert(asked, Settings)
    except msgspec.ValidationError as exc:
        raise InvalidParams(f"telemetry: {exc}") from None


def _installed() -> bool:
    return importlib.util.find_spec("opentelemetry.sdk") is not None
