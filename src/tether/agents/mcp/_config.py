"""An ``mcp`` config: its servers (stdio or HTTP) and its tool policies, checked."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tether.wire.errors import InvalidParams

__all__ = [
    "PREFIX",
    "SEP",
    "Http",
    "Preempt",
    "Spec",
    "Stdio",
    "ToolPolicy",
    "parse_policy",
    "parse_server",
    "policy_key",
    "specificity",
]

Preempt = Literal["cooperative", "kill", "never"]

PREFIX = "mcp__"
SEP = "__"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_POLICY_KEY = re.compile(r"^mcp:[^/]+/.+$")
# A framework's own tool, by its own name, under an adapter (semantics §17.1-§17.2)
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.*?\[\]-]+$")
_CONNECT_TIMEOUT = 30.0  # start (or reach) a server and finish the handshake


class ToolPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one tool's calls are bounded and stopped (semantics §15.3)."""

    max_duration: float | None = None  # seconds; exceeded: stopped, McpTimeout
    idle_timeout: float | None = None  # seconds without notifications/progress: the same
    grace: float | None = None  # how long a stopped call may take to end
    preempt: Preempt = "cooperative"
    # A call a crash left unknown may run again with the same call key (semantics §17.1).
    idempotent: bool = False


# ---- configuration -------------------------------------------------------------------


@dataclass(frozen=True)
class Stdio:
    command: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None
    connect_timeout: float


@dataclass(frozen=True)
class Http:
    url: str
    headers: dict[str, str]
    connect_timeout: float


Spec = Stdio | Http


def _str_map(server: str, key: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidParams(f"mcp server {server!r}: {key!r} must map strings to strings")
    return dict(value)


def _timeout(server: str, conf: dict[str, Any]) -> float:
    value = conf.get("connect_timeout", _CONNECT_TIMEOUT)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidParams(f"mcp server {server!r}: 'connect_timeout' must be a positive number")
    return float(value)


def parse_server(name: object, conf: object) -> Spec:
    if not isinstance(name, str) or not _NAME.match(name) or SEP in name:
        raise InvalidParams(
            f"mcp server name {name!r}: letters, digits, '-' and '_' only, and no '__'"
        )
    if not isinstance(conf, dict):
        raise InvalidParams(f"mcp server {name!r}: its config must be an object")
    if ("command" in conf) == ("url" in conf):
        raise InvalidParams(f"mcp server {name!r}: give exactly one of 'command' or 'url'")
    return _parse_stdio(name, conf) if "command" in conf else _parse_http(name, conf)


def _known_fields(name: str, conf: dict[str, Any], fields: set[str]) -> None:
    unknown = set(conf) - fields
    if unknown:
        raise InvalidParams(f"mcp server {name!r}: unknown field {sorted(unknown)[0]!r}")


def _parse_stdio(name: str, conf: dict[str, Any]) -> Stdio:
    _known_fields(name, conf, {"command", "env", "cwd", "connect_timeout"})
    command = conf["command"]
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(a, str) and a for a in command)
    ):
        raise InvalidParams(
            f"mcp server {name!r}: 'command' must be a non-empty list of non-empty strings"
        )
    cwd = conf.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise InvalidParams(f"mcp server {name!r}: 'cwd' must be a string")
    env = _str_map(name, "env", conf.get("env", {}))
    return Stdio(tuple(command), env, cwd, _timeout(name, conf))


def _parse_http(name: str, conf: dict[str, Any]) -> Http:
    _known_fields(name, conf, {"url", "headers", "connect_timeout"})
    url = conf["url"]
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidParams(f"mcp server {name!r}: 'url' must be an http:// or https:// URL")
    return Http(url, _str_map(name, "headers", conf.get("headers", {})), _timeout(name, conf))


def parse_policy(key: object, value: object) -> tuple[str, dict[str, Any]]:
    if not isinstance(key, str) or not (_POLICY_KEY.match(key) or _TOOL_NAME.match(key)):
        raise InvalidParams(
            f"tool policy {key!r}: the key must be a tool's name ('run_command', a "
            "framework's tool) or 'mcp:<server>/<tool>' (either part may be a glob)"
        )
    if not isinstance(value, dict):
        raise InvalidParams(f"tool policy {key!r}: must be an object")
    try:
        msgspec.convert(value, ToolPolicy)
    except msgspec.ValidationError as exc:
        raise InvalidParams(f"tool policy {key!r}: {exc}") from None
    for name in ("max_duration", "idle_timeout", "grace"):
        v = value.get(name)
        if v is not None and (v < 0 or (v == 0 and name != "grace")):
            raise InvalidParams(f"tool policy {key!r}: {name!r} must be positive")
    return key, dict(value)


def policy_key(tool: str) -> str:
    """The name policies are matched against: ``mcp__s__t`` -> ``mcp:s/t``."""
    if tool.startswith(PREFIX):
        server, sep, name = tool[len(PREFIX) :].partition(SEP)
        if sep:
            return f"mcp:{server}/{name}"
    return tool


def specificity(pattern: str, name: str) -> tuple[int, int]:
    exact = pattern == name
    literal = sum(1 for c in pattern if c not in "*?[]")
    return (int(exact), literal)
