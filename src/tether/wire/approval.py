"""Approvals (semantics §17.2): a tool call that waits for a person or an ancestor to
decide it, as it is stored, listed and sent (``Approval``), and its texts: the markers a
transcript shows and the tool results a model reads.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from tether.wire.text import cap, escape, neutralize, who

__all__ = [
    "DECIDED",
    "Approval",
    "ApprovalState",
    "Approver",
    "Decided",
    "Decision",
    "approval_marker",
    "call_text",
    "decided_marker",
    "parse_arguments",
    "result_text",
]

ApprovalState = Literal["pending", "approved", "denied", "cancelled", "expired"]
DECIDED: tuple[ApprovalState, ...] = ("approved", "denied", "cancelled", "expired")
Approver = Literal["any", "user"]  # who may decide: a person or a live ancestor, or a person
Decision = Literal["approve", "deny"]

_SHOWN = 500  # characters of a call's arguments a marker shows


class Approval(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call that waits for a decision (``Runtime.approvals``, ``Runtime.decide``).

    ``arguments`` are the call's as the model wrote them (a JSON value; the raw text when
    it was no JSON), ``arguments_used`` those the tool ran with once approved (an edit's,
    else the same). ``decided_by`` names who decided (a person's name, ``user``, an
    ancestor's id, ``timeout``, or the stop's ``by``) and ``origin`` what they were
    (``user``, ``parent``, ``system``)."""

    id: str  # a_…
    session: str
    turn: str
    tool: str
    arguments: Any = None
    requested_at: float = 0.0
    state: ApprovalState = "pending"
    decided_by: str | None = None
    origin: str | None = None
    reason: str | None = None
    arguments_used: Any = None
    decided_at: float | None = None
    approver: Approver = "any"
    timeout: float | None = None  # seconds (``approval_timeout``); None: no expiry
    tool_call_id: str | None = None  # the model's own id for the call
    # The tool's JSON Schema for its arguments, which an edit is checked against.
    schema: dict[str, Any] | None = None


class Decided(msgspec.Struct, frozen=True, kw_only=True):
    """How a call that asked for approval was decided, as its driver is told
    (``ctx.ask_approval``): approved, with its call key and the arguments to run it with
    (an edit's, else the model's, as JSON text); else the text the model reads instead of
    a result."""

    state: ApprovalState
    approval: str
    key: str | None = None
    arguments: str | None = None
    text: str = ""


def parse_arguments(text: str) -> Any:
    """A call's arguments as a JSON value (empty: ``{}``); text that is no JSON stays as
    it is."""
    if not text.strip():
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_text(tool: str, arguments: Any) -> str:
    """``run_command ["rm", "-rf", "build"]``: a call as a person reads it (the one
    argument's value alone when there is one, else the arguments), capped."""
    shown = arguments
    if isinstance(arguments, dict) and len(arguments) == 1:
        shown = next(iter(arguments.values()))
    text = shown if isinstance(shown, str) and shown is arguments else _json(shown)
    return f"{tool} {cap(text, _SHOWN)}"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def approval_marker(a: Approval) -> str:
    """``Approval needed: run_command ["rm", "-rf", "build"] (a_…)``. The call is the
    model's own text, shown as it is but for Tether's frame tags."""
    return neutralize(f"Approval needed: {call_text(a.tool, a.arguments)} ({a.id})")


def decided_marker(a: Approval) -> str:
    """The marker of a decision: ``✓ Approved by user alice``, ``✗ Denied by parent (s_…):
    <reason>``, ``✗ Expired: no decision within 30 s``, ``✗ Cancelled: <why>``; each
    names the approval."""
    by = escape(who(a.origin or "user", a.decided_by))
    match a.state:
        case "approved":
            head = f"✓ Approved by {by}"
            if a.arguments_used != a.arguments:
                head += " with edited arguments"
        case "denied":
            head = f"✗ Denied by {by}"
        case "expired":
            head = f"✗ Expired: no decision within {_seconds(a.timeout)}"
        case _:
            head = "✗ Cancelled"
    head += f" ({a.id})"
    return f"{head}: {escape(a.reason)}" if a.reason else head


def result_text(a: Approval) -> str:
    """What the model reads as the result of a call that did not run: ``denied by user
    alice: <reason>``, ``timed out after 30 s``, ``cancelled: <why>``."""
    match a.state:
        case "denied":
            head = f"denied by {who(a.origin or 'user', a.decided_by)}"
        case "expired":
            head = f"timed out after {_seconds(a.timeout)}"
        case _:
            head = "cancelled"
    return neutralize(f"{head}: {a.reason}" if a.reason else head)


def _seconds(value: float | None) -> str:
    return f"{value or 0:g} s"
