"""The ``Runtime``'s input checks: bad input raises a typed error and changes nothing.

Each check takes a caller's argument as given (any type), refuses it with
``InvalidParams`` naming the field, or returns it typed. The facade calls them before it
asks any actor, in an order that decides which of several bad arguments is reported.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import msgspec

from tether.actors._ids import is_id
from tether.actors.authority import Ancestor, User
from tether.contain.cgroup import LIMIT_CONTROLLERS, Cgroups
from tether.wire.budget import check_price
from tether.wire.errors import InvalidParams
from tether.wire.records import OnCrash
from tether.wire.text import TERMINAL_CONTROLS, cap
from tether.wire.vocab import (
    Grace,
    Kind,
    Permission,
    Seconds,
    StallPolicy,
    json_problem,
    text_problem,
)

__all__ = [
    "CONTAINMENTS",
    "KINDS",
    "MAX_CONTENT",
    "MAX_NAME",
    "InterruptArgs",
    "Timeout",
    "Workers",
    "check_authority",
    "check_containment",
    "check_data",
    "check_driver",
    "check_enforceable",
    "check_id",
    "check_interrupt",
    "check_limits",
    "check_message",
    "check_name",
    "check_recovery",
    "check_secret_env",
    "check_settings",
    "check_slug",
    "check_stall",
    "check_text",
    "check_tool_user",
    "check_turn",
    "convert",
]

KINDS = ("steer", "cancel", "abort", "preempt")
CONTAINMENTS = ("auto", "cgroup", "walk")
CONTAINMENT_ENV = "TETHER_CONTAINMENT"  # the default of ``containment`` (CI forces each)
MAX_CONTENT = 1_000_000  # characters in one message
_data_encoder = msgspec.msgpack.Encoder()

Workers = Annotated[int, msgspec.Meta(ge=1, le=4096)]
Timeout = Annotated[float, msgspec.Meta(ge=0)]  # inf allowed (no limit); NaN is not >= 0


class InterruptArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``interrupt()``'s arguments, typed: the one place their bounds are checked."""

    kind: Kind = "cancel"
    reason: str = ""
    grace: Grace | None = None
    deadline: Seconds | None = None
    turn: Annotated[str, msgspec.Meta(min_length=1)] | None = None


def convert(value: Any, kind: Any, what: str) -> Any:
    """``value`` as ``kind`` (msgspec's strict conversion: no coercion, bounds checked),
    or InvalidParams naming the field (``interrupt: Expected `float` <= 2592000.0 - at
    `$.deadline```)."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise InvalidParams(f"{what}: {exc}") from None


ON_CRASH = ("recover", "park")
MAX_RECOVERIES = 100


def check_recovery(
    on_crash: object, max_recoveries: object, inherited: tuple[OnCrash, int] | None
) -> tuple[OnCrash, int]:
    """``on_crash`` and ``max_recoveries`` (semantics §17.1), each None for ``inherited``'s."""
    if on_crash is None and inherited is not None:
        on_crash = inherited[0]
    if on_crash not in ON_CRASH:
        raise InvalidParams(f"on_crash must be one of {ON_CRASH}, not {on_crash!r}")
    if max_recoveries is None and inherited is not None:
        max_recoveries = inherited[1]
    if (
        not isinstance(max_recoveries, int)
        or isinstance(max_recoveries, bool)
        or not 0 <= max_recoveries <= MAX_RECOVERIES
    ):
        raise InvalidParams(
            f"max_recoveries must be an integer from 0 to {MAX_RECOVERIES}, not {max_recoveries!r}"
        )
    return on_crash, max_recoveries  # type: ignore[return-value]  # checked just above


def check_text(name: str, value: str) -> None:
    """Text that cannot be encoded (a lone surrogate) is refused before anything is
    recorded (semantics §14.3)."""
    problem = text_problem(value)
    if problem is not None:
        raise InvalidParams(f"{name} {problem}")


def check_id(session_id: object) -> None:
    if not isinstance(session_id, str):
        raise InvalidParams("a session id is a string")


def check_turn(turn: object) -> None:
    """A turn guard is None or a turn id as the runtime makes them. A malformed one (a
    typo, an id of another kind) could never name the running turn, so it is refused
    rather than taken for a stale guard's silent no-op; a well-formed id of another turn
    is that no-op (semantics §14.2)."""
    if turn is None:
        return
    if not isinstance(turn, str) or not is_id(turn, "t_"):
        shown = repr(turn[:80]) if isinstance(turn, str) else type(turn).__name__
        raise InvalidParams(f"turn must be a turn id (t_ and 32 hex digits), not {shown}")


def check_containment(containment: str | None) -> str:
    """The containment asked for; None is the environment's ``TETHER_CONTAINMENT``,
    else auto."""
    if containment is None:
        containment = os.environ.get(CONTAINMENT_ENV) or "auto"
    if containment not in CONTAINMENTS:
        raise InvalidParams(f"containment must be one of {CONTAINMENTS}, not {containment!r}")
    return containment


def check_data(data: dict[str, Any] | None, name: str = "data") -> None:
    """JSON data as it will be stored and sent, unchanged: string keys at every
    level, encodable text, 64-bit integers, finite floats, at most 1 MB."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise InvalidParams(f"{name} must be a dict")
    problem = json_problem(data, name)
    if problem is not None:
        raise InvalidParams(problem)
    try:
        size = len(_data_encoder.encode(data))
    except (TypeError, ValueError, OverflowError) as exc:  # UnicodeEncodeError: ValueError
        raise InvalidParams(f"{name} is not serializable: {exc}") from None
    if size > MAX_CONTENT:
        raise InvalidParams(f"{name} of {size} bytes is over {MAX_CONTENT}")


def check_message(content: str, data: dict[str, Any] | None) -> None:
    if not isinstance(content, str):
        raise InvalidParams("content must be a string")
    if len(content) > MAX_CONTENT:
        raise InvalidParams(f"content of {len(content)} characters is over {MAX_CONTENT}")
    check_text("content", content)
    check_data(data)


def check_authority(authority: object) -> None:
    if not isinstance(authority, User | Ancestor):
        raise InvalidParams("authority must be tether.User(parent) or tether.Ancestor(ref)")
    if isinstance(authority, User):
        if not isinstance(authority.parent, str):
            raise InvalidParams("User.parent must be a session id")
        check_text("User.parent", authority.parent)
        if authority.name is not None:
            check_name(authority.name)


MAX_NAME = 64  # characters in a person's name (``User.name``)


def check_name(name: object) -> None:
    """A person's name is shown after "by" in markers, reports and every face, on one
    line: a string of at most 64 characters, none a terminal acts on, no tab or newline
    ("" is no name)."""
    if not isinstance(name, str) or len(name) > MAX_NAME:
        raise InvalidParams(f"User.name must be a string of at most {MAX_NAME} characters")
    check_text("User.name", name)
    bad = TERMINAL_CONTROLS.search(name) or re.search("[\t\n]", name)
    if bad is not None:
        raise InvalidParams(f"User.name must hold no control character, not {bad.group()!r}")


def check_interrupt(
    scope: str,
    kind: str,
    reason: str,
    grace: float | None,
    deadline: float | None,
    turn: str | None,
) -> InterruptArgs:
    """Every argument of ``interrupt()`` but its target and authority, checked before
    anything is issued: a stop is never half-applied."""
    if scope not in ("session", "subtree"):
        raise InvalidParams(f"scope must be 'session' or 'subtree', not {scope!r}")
    args: InterruptArgs = convert(
        {"kind": kind, "reason": reason, "grace": grace, "deadline": deadline, "turn": turn},
        InterruptArgs,
        "interrupt",
    )
    check_turn(args.turn)
    if scope == "subtree" and args.kind not in ("cancel", "abort"):
        raise InvalidParams(f"a subtree stop is a cancel or an abort, not {args.kind!r}")
    check_text("reason", args.reason)
    if args.kind == "steer" and not args.reason.strip():
        raise InvalidParams("a steer needs a non-empty text")
    return args


# ---- a new session's header -----------------------------------------------------------


def check_driver(driver: object) -> None:
    if not isinstance(driver, str) or not driver:
        raise InvalidParams("driver must be an import string 'package.module:Class'")
    check_text("driver", driver)


def check_slug(slug: object) -> None:
    if slug is None:
        return
    if not isinstance(slug, str) or not slug or len(slug) > 128:
        raise InvalidParams("slug must be a non-empty string of at most 128 characters")
    check_text("slug", slug)
    # A slug is a one-line name that every face prints: no character a terminal acts on,
    # nor a tab or a newline (repr shows the one found escaped).
    bad = TERMINAL_CONTROLS.search(slug) or re.search("[\t\n]", slug)
    if bad is not None:
        raise InvalidParams(f"slug must hold no control character, not {bad.group()!r}")


def check_settings(
    config: dict[str, Any] | None, permissions: Mapping[str, str] | None
) -> dict[str, Any] | None:
    """A session's ``config`` (JSON data; its model's price, if any, valid) and its
    ``permissions``, returned typed."""
    for name, value in (("config", config), ("permissions", permissions)):
        if value is not None and not isinstance(value, dict):
            raise InvalidParams(f"{name} must be a dict")
    perms: dict[str, Any] | None = None
    if permissions is not None:
        perms = convert(permissions, dict[str, Permission], "permissions")
        check_data(perms, "permissions")  # its keys' text
    check_data(config, "config")
    model = (config or {}).get("model")
    if isinstance(model, dict) and model.get("price") is not None:
        check_price(model["price"])
    return perms


def check_limits(limits: object) -> dict[str, float]:
    """``{"memory_mb": MB, "pids": N, "cpu": cores}``, each optional and positive."""
    if not isinstance(limits, dict):
        raise InvalidParams("limits must be a dict like {'memory_mb': 512}")
    unknown = set(limits) - set(LIMIT_CONTROLLERS)
    if unknown:
        raise InvalidParams(
            f"limits has unknown keys {sorted(unknown)} (known: {sorted(LIMIT_CONTROLLERS)})"
        )
    out: dict[str, float] = {}
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise InvalidParams(f"limits.{key} must be a positive number")
        if key == "pids" and value != int(value):
            raise InvalidParams("limits.pids must be a whole number")
        out[key] = float(value)
    return out


def check_enforceable(
    limits: object, cgroups: Cgroups | None, containment: str, cgroup_reason: str
) -> dict[str, float]:
    """Valid, and enforceable by ``cgroups`` (the runtime's group, None when it has
    none): a limit the kernel cannot enforce is refused, never silently ignored
    (semantics §15.5). ``cgroup_reason`` says why a runtime has no group."""
    checked = check_limits(limits)
    if not checked:
        return checked
    if cgroups is None:
        if containment == "cgroup":  # Ray: leaves on the nodes, no limits yet
            why = "the Ray backend's leaves do not enforce limits yet"
        else:
            why = cgroup_reason or "this runtime runs with containment='walk'"
        raise InvalidParams(
            f"limits {sorted(checked)} need cgroup containment, not in force here ({why})"
        )
    missing = cgroups.missing(checked)
    if missing:
        have = ", ".join(sorted(cgroups.controllers)) or "none"
        raise InvalidParams(
            f"limits {sorted(checked)} need the cgroup v2 controller(s) "
            f"{', '.join(missing)}, not available here (available: {have})"
        )
    return checked


_NUDGE = (
    "you have made no visible progress for a while. Say where you are, and if you are "
    "stuck, change approach or wrap up."
)


def check_stall(stall: object) -> StallPolicy:
    """The stall watchdog's policy, validated and completed (semantics §14.5).

    ``after`` (seconds, required) without progress takes the first of ``steps``
    (default steer, cancel, abort), then the next after each further ``every``
    (default ``after``); ``nudge`` is the steer's text; ``repeat`` (>= 2) counts that
    many identical tool calls in a row as no progress; ``grace`` is the watchdog's
    cancel's grace (default the runtime's). Seconds are finite, positive and at most
    ``MAX_SECONDS`` (30 days). Takes a dict or a ``StallPolicy``.
    """
    if isinstance(stall, StallPolicy):  # a Struct built in Python checks no bounds
        stall = msgspec.to_builtins(stall)
    if not isinstance(stall, dict):
        raise InvalidParams("stall must be a dict like {'after': 60}")
    policy: StallPolicy = convert(stall, StallPolicy, "stall")
    nudge = _NUDGE if policy.nudge is None else policy.nudge
    if not nudge.strip():
        raise InvalidParams("stall.nudge must be a non-empty string")
    check_text("stall.nudge", nudge)
    return msgspec.structs.replace(
        policy,
        every=policy.every if policy.every is not None else policy.after,
        nudge=cap(nudge),
    )


def check_secret_env(names: object) -> list[str]:
    """``Runtime(secret_env=...)``: variable names, each a non-empty string."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise InvalidParams("secret_env must be a list of environment variable names")
    checked = list(names)
    for name in checked:
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise InvalidParams(f"secret_env: {name!r} is not an environment variable name")
    return checked


# Linux capability bits (capability.h): what switching users takes besides root.
_CAP_SETGID = 6
_CAP_SETUID = 7


def _may_switch_users() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status") as f:
            eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    want = (1 << _CAP_SETGID) | (1 << _CAP_SETUID)
    return eff & want == want


def check_tool_user(name: object, backend: object) -> str | None:
    """``Runtime(tool_user=...)`` (semantics §17.4): another user of this machine, whom
    the host may become, on the local backend."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise InvalidParams("tool_user must be a user name")
    if backend != "local":
        raise InvalidParams("tool_user runs tools as another user on the local backend only")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise InvalidParams(f"tool_user: there is no user {name!r} on this machine") from None
    if entry.pw_uid == os.geteuid() or entry.pw_uid == 0:
        who = "root" if entry.pw_uid == 0 else "the host's own user"
        raise InvalidParams(
            f"tool_user: {name!r} is {who}; tools run as it would read what the host"
            " reads: name another user"
        )
    if not _may_switch_users():
        raise InvalidParams(
            f"tool_user: this host (uid {os.geteuid()}) may not switch users: run it as root,"
            " or with the capabilities CAP_SETUID and CAP_SETGID"
        )
    return name
