"""What a worker's tools get of the host (semantics §17.4): its environment without the
host's secrets, as the tool user where one is set; and the session's model key, which
only its model client reads (``model_key``), never a tool.

The worker sets both: the tool user once, when it starts (``set_tool_user``), the key
and the names to hide at each turn (``enter_turn``). Outside a worker (a driver run by
hand) nothing is hidden and ``model_key`` reads the environment.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tether.driver.calls import CALL_ENV, current_call_id

__all__ = [
    "ToolUser",
    "enter_turn",
    "model_key",
    "set_tool_user",
    "spawn_options",
    "tool_env",
    "tool_user",
]


@dataclass(frozen=True, slots=True)
class ToolUser:
    """The user a worker's tools run as: its ids, and what its environment names."""

    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @classmethod
    def lookup(cls, name: str) -> ToolUser:
        """KeyError if there is no such user."""
        entry = pwd.getpwnam(name)
        return cls(name, entry.pw_uid, entry.pw_gid, entry.pw_dir, entry.pw_shell or "/bin/sh")


_user: ToolUser | None = None
# The running turn's session's model keys, by variable name; replaced whole each turn.
_keys: dict[str, str] = {}


def set_tool_user(name: str | None) -> None:
    """Run this worker's tools as ``name`` (None: as the worker)."""
    global _user
    _user = None if name is None else ToolUser.lookup(name)


def tool_user() -> ToolUser | None:
    return _user


def enter_turn(keys: dict[str, str] | None, hide: Iterable[str] = ()) -> None:
    """A turn starts: its session's keys, and the host's secrets gone from this
    process's environment (so from every tool it starts, and every function tool's view)."""
    global _keys
    for name in hide:
        os.environ.pop(name, None)
    _keys = keys or {}


def model_key(name: str) -> str | None:
    """The value of the variable ``name`` that a session's config names as its model key
    (``api_key_env``): given by the host for this turn, never in the environment."""
    return _keys.get(name) or os.environ.get(name)


def tool_env(
    base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a process a tool starts: ``base`` (default this process's, which
    holds no secret of the host's), as the tool user names it where one is set, and
    ``extra``."""
    env = dict(os.environ if base is None else base)
    key = current_call_id()
    if key is not None:  # the tool call it runs for: its key, for an idempotent tool
        env[CALL_ENV] = key
    user = _user
    if user is not None:
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name, SHELL=user.shell)
    if extra:
        env.update(extra)
    return env


def spawn_options() -> dict[str, Any]:
    """``subprocess.Popen`` / ``anyio.open_process`` keywords that start a process as the
    tool user (no supplementary group of the worker's kept); none without one."""
    user = _user
    if user is None:
        return {}
    return {"user": user.uid, "group": user.gid, "extra_groups": []}
