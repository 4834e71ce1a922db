"""Budgets (semantics §16.2): what a caller may set on a tree, and what it reads back.

A ``Budget`` caps a session *and its whole subtree*. Its four limits are optional, at
least one is set. Money crosses the wire and sits in usage records as whole
micro-dollars (``cost_microusd``), so sums never drift; the API speaks ``cost_usd``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec

from tether.wire.errors import InvalidParams
from tether.wire.vocab import INT64_MAX, MAX_SECONDS

__all__ = [
    "LIMITS",
    "Budget",
    "BudgetState",
    "BudgetStatus",
    "check_budget",
    "check_price",
    "cost_microusd",
    "limit_text",
    "merge_usage",
    "parse_budget",
    "spent_text",
]

# The limits, in the order they are shown.
LIMITS: Final = ("tokens", "cost_usd", "turn_seconds", "turns")
# At most a trillion dollars: a float that large is still exact to the micro-dollar.
_MAX_USD: Final = 1e12

BudgetState = Literal["ok", "soft", "exhausted"]


class Budget(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """A tree's budget: any subset of the four limits (at least one), the soft threshold
    (a fraction of each limit) and what happens at each threshold."""

    tokens: Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)] | None = None
    cost_usd: Annotated[float, msgspec.Meta(gt=0, le=_MAX_USD)] | None = None
    turn_seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS * 1000)] | None = None
    turns: Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)] | None = None
    soft: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    on_soft: Literal["steer", "pause", "none"] = "steer"
    on_hard: Literal["cancel", "abort", "pause"] = "cancel"

    def limits(self) -> dict[str, float]:
        """The limits it sets, keyed as ``LIMITS``."""
        out: dict[str, float] = {}
        for key in LIMITS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class BudgetStatus(msgspec.Struct, frozen=True, kw_only=True):
    """``rt.budget(target)``: what the target's subtree spent, against its own budget.

    ``spent`` has the four keys (over the target and every session below it, running
    turns' seconds included); ``limits`` and ``remaining`` only the keys the target's
    own budget sets. ``state`` is the tightest of the target's own budget and its
    ancestors' (``exhausted`` > ``soft`` > ``ok``); ``decided_by`` names the session
    whose budget sets it (None while ``ok``). ``budget`` is the target's own, or None.
    """

    session: str
    limits: dict[str, float]
    spent: dict[str, float]
    remaining: dict[str, float]
    state: BudgetState
    decided_by: str | None = None
    budget: Budget | None = None


def check_budget(value: object) -> Budget | None:
    """A budget from a ``Budget`` or a dict (``None`` stays None); InvalidParams naming
    the field when a value is out of range or no limit is set."""
    if value is None:
        return None
    if isinstance(value, Budget):  # a Struct built in Python checks no bounds
        value = msgspec.to_builtins(value)
    if not isinstance(value, dict):
        raise InvalidParams("budget must be a dict like {'tokens': 200000}")
    try:
        budget = msgspec.convert(value, Budget)
    except msgspec.ValidationError as exc:
        raise InvalidParams(f"budget: {exc}") from None
    if not budget.limits():
        raise InvalidParams(f"budget: set at least one of {', '.join(LIMITS)}")
    return budget


def parse_budget(text: str) -> dict[str, Any]:
    """``tokens=200000,cost_usd=1.5,on_hard=abort`` (the CLI's ``--budget``) as a dict,
    numbers typed; what it means is checked by ``check_budget``."""
    out: dict[str, Any] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            raise InvalidParams(f"budget: {part!r} is not key=value")
        if key in ("on_soft", "on_hard"):
            out[key] = raw
        elif key in ("tokens", "turns"):
            try:
                out[key] = int(raw.replace("_", ""))
            except ValueError:
                raise InvalidParams(f"budget: {key} must be a whole number, not {raw!r}") from None
        else:
            try:
                out[key] = float(raw)
            except ValueError:
                raise InvalidParams(f"budget: {key} must be a number, not {raw!r}") from None
    return out


def check_price(price: object) -> dict[str, float]:
    """``model.price``: ``{"input_per_mtok": $, "output_per_mtok": $}`` (dollars per
    million tokens), each optional, finite and non-negative."""
    if not isinstance(price, dict):
        raise InvalidParams("model.price must be a dict like {'input_per_mtok': 3.0}")
    unknown = set(price) - {"input_per_mtok", "output_per_mtok"}
    if unknown:
        raise InvalidParams(f"model.price has unknown keys {sorted(unknown)}")
    out: dict[str, float] = {}
    for key, value in price.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidParams(f"model.price.{key} must be a number")
        if not 0 <= value <= 1e9:
            raise InvalidParams(f"model.price.{key} must be between 0 and 1e9")
        out[key] = float(value)
    return out


def cost_microusd(price: dict[str, Any], prompt: int, completion: int) -> int:
    """What ``prompt`` + ``completion`` tokens cost at ``price`` ($ per million tokens),
    in micro-dollars: a token at $X per million costs X micro-dollars."""
    cost = prompt * float(price.get("input_per_mtok") or 0.0)
    cost += completion * float(price.get("output_per_mtok") or 0.0)
    return round(cost)


def merge_usage(total: dict[str, int | bool], delta: Mapping[str, int | bool]) -> None:
    """Add ``delta``'s counts into ``total``. ``estimated`` is a flag, not a count: true
    once any part of the total is an estimate (semantics §15.2, a cut reply)."""
    for key, value in delta.items():
        if key == "estimated":
            if value:
                total[key] = True
        else:
            total[key] = total.get(key, 0) + value


def _amount(key: str, value: float) -> str:
    match key:
        case "cost_usd":
            return f"${value:,.2f}" if value >= 0.01 or value == 0 else f"${value:.6f}"
        case "turn_seconds":
            return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"
        case _:
            return f"{int(value):,}"


_UNITS: Final = {
    "tokens": " tokens",
    "cost_usd": "",
    "turn_seconds": " turn seconds",
    "turns": " turns",
}


def limit_text(key: str, value: float) -> str:
    """A limit as people read it: ``200,000 tokens``, ``$1.50``, ``60 turn seconds``."""
    return f"{_amount(key, value)}{_UNITS[key]}"


def spent_text(key: str, spent: float, limit: float) -> str:
    """``200,412 of 200,000 tokens``, ``$1.02 of $1.00``."""
    return f"{_amount(key, spent)} of {limit_text(key, limit)}"
