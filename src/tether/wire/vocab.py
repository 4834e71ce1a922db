"""What a caller may pass, as types: interrupt kinds, seconds, the stall policy, and JSON.

The Python API (``Runtime``), JSON-RPC (``wire.rpc``), the CLI and the model tools all
take their numbers and words from here, so a value one of them refuses, every one of
them refuses, with the same bounds. A duration is a finite number of seconds, at most
``MAX_SECONDS``: a clock set further than that is a mistake (or an attack on the one
timer thread), never a plan.

Free-form JSON (``data``, ``config``) cannot be typed by a Struct, so ``json_problem``
walks it: keys are strings, text is encodable, integers fit 64 bits, floats are finite,
and nothing nests too deep. What passes goes through SQLite (JSON) and the worker channel
(msgpack) unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal

import msgspec

__all__ = [
    "DEFAULT_STEPS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DEPTH",
    "MAX_SECONDS",
    "Grace",
    "Kind",
    "ListScope",
    "PauseScope",
    "Permission",
    "Seconds",
    "StallPolicy",
    "json_problem",
    "text_problem",
]

# 30 days. Longer than any turn we expect to guard, and far below what a timer wait can
# hold (threading's TIMEOUT_MAX is ~292 years, but a monotonic clock plus 1e10 s already
# overflows a C timespec wait on some platforms).
MAX_SECONDS: Final = 30 * 24 * 3600.0
# How deeply free-form JSON may nest (see wire.rpc: the same bound for the whole body).
MAX_DEPTH: Final = 64
# Integers are 64-bit signed wherever they go (SQLite, msgpack frames to the workers).
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

Kind = Literal["steer", "cancel", "abort", "preempt"]
PauseScope = Literal["session", "subtree"]
ListScope = Literal["children", "descendants"]
Permission = Literal["allow", "deny"]
# A clock's length: finite, positive, at most MAX_SECONDS (NaN and inf fail both bounds).
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]
# A cancel's grace may be 0: force-break as soon as the cancel is delivered.
Grace = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]

DEFAULT_STEPS: Final = ("steer", "cancel", "abort")


class StallPolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The stall watchdog's policy (semantics §14.5). ``every`` defaults to ``after``;
    ``grace`` (the watchdog's cancel's) to the runtime's."""

    after: Seconds
    every: Seconds | None = None
    steps: Annotated[list[Kind], msgspec.Meta(min_length=1, max_length=64)] = msgspec.field(
        default_factory=lambda: list(DEFAULT_STEPS)
    )
    nudge: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    repeat: Annotated[int, msgspec.Meta(ge=2, le=INT64_MAX)] | None = None
    grace: Seconds | None = None


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored or sent (a lone surrogate), or None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid text (a lone surrogate at index {exc.start})"
    return None


def json_problem(value: Any, name: str, limit: int = MAX_DEPTH) -> str | None:
    """What makes ``value`` unacceptable as JSON data, with its path
    (``data.a[3]: a key must be a string, not int``); None if nothing. Iterative: no
    recursion however deep the value nests, and a path is spelt out only for a problem."""
    # (node, depth, trail): a trail is (key, parent trail), so a node costs one tuple.
    stack: list[tuple[Any, int, Any]] = [(value, 0, None)]
    while stack:
        node, depth, trail = stack.pop()
        kind = type(node)
        if kind in _PLAIN:  # by exact type, first: the common case costs one lookup
            check = _PLAIN[kind]
            problem = None if check is None else check(node)
        elif isinstance(node, dict | list | tuple):
            problem = _push_items(node, depth, trail, limit, stack)
        else:
            problem = _leaf_problem(node)
        if problem is not None:
            return f"{_path(name, trail)}: {problem}"
    return None


def _int_problem(node: int) -> str | None:
    if INT64_MIN <= node <= INT64_MAX:
        return None
    return "an integer outside the 64-bit signed range"


def _float_problem(node: float) -> str | None:
    return None if math.isfinite(node) else f"{node!r} is not a JSON number"


# The check of each plain JSON scalar type (None: always fine); subclasses (an IntEnum, a
# str subclass) are not here: ``_leaf_problem`` takes them by isinstance.
_PLAIN: Final[dict[type, Callable[[Any], str | None] | None]] = {
    type(None): None,
    bool: None,
    int: _int_problem,
    float: _float_problem,
    str: text_problem,
}


def _leaf_problem(node: Any) -> str | None:
    """What makes a value that holds no other unacceptable as JSON, or None."""
    if node is None or isinstance(node, bool):
        return None
    if isinstance(node, int):
        return _int_problem(node)
    if isinstance(node, float):
        return _float_problem(node)
    if isinstance(node, str):
        return text_problem(node)
    return f"a {type(node).__name__} is not JSON"


def _push_items(
    node: dict[Any, Any] | list[Any] | tuple[Any, ...],
    depth: int,
    trail: Any,
    limit: int,
    stack: list[tuple[Any, int, Any]],
) -> str | None:
    """Push a dict's or a list's items on ``stack``, to be walked; what makes the
    container itself unacceptable instead (too deep, a bad key), or None."""
    if depth + 1 > limit:
        return f"nested deeper than {limit} levels"
    if not isinstance(node, dict):
        stack.extend((item, depth + 1, (i, trail)) for i, item in enumerate(node))
        return None
    for key, item in node.items():
        if not isinstance(key, str):
            return f"a key must be a string, not {type(key).__name__} {key!r:.40}"
        if text_problem(key) is not None:
            return "a key is not valid text (it holds a lone surrogate)"
        stack.append((item, depth + 1, (key, trail)))
    return None


def _path(name: str, trail: Any) -> str:
    keys: list[Any] = []
    while trail is not None:
        key, trail = trail
        keys.append(key)
    parts = [f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys)]
    return name + "".join(parts)
