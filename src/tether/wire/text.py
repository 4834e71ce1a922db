"""Untrusted text made safe for the places a model, a page or a terminal reads it.

Reasons and steer texts come from people and from other agents, so they are capped
(with a visible truncation mark) and escaped wherever they are embedded in text. Other
text a model reads beside Tether's own frames (a child's reply in its parent's notice, a
tool's result) keeps its characters, but not Tether's frame tags: a child cannot write a
``<steer origin="user">`` that its parent's model takes for its user's (semantics §5).
"""

from __future__ import annotations

import html
import re
from typing import Any, Final

__all__ = [
    "FRAME_TAGS",
    "REASON_CAP",
    "TERMINAL_CONTROLS",
    "cap",
    "discarded_text",
    "escape",
    "marker_text",
    "neutralize",
    "neutralized",
    "recovery_reason",
    "render_frame",
    "unknown_call_text",
    "who",
]

REASON_CAP = 2000

# The tags Tether wraps text in for a model (``render_frame``); only these are neutralized.
FRAME_TAGS: Final = ("steer", "cancel")
# ``<steer``, ``</steer``, any case, as a whole word: ``<steering>``, ``a < b``, ``<div>``
# and ``List<String>`` are left alone.
_FRAME_TAG: Final = re.compile(r"<(?=/?(?:" + "|".join(FRAME_TAGS) + r")(?![\w-]))", re.IGNORECASE)

# What a terminal acts on rather than shows: C0 but tab and newline (a multi-line text
# prints as such), DEL, C1 (U+009B is a CSI on its own), and the bidi embeddings,
# overrides and isolates, which reorder what follows them on the line.
TERMINAL_CONTROLS: Final = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

_VERBS = {
    "steered": "Steered",
    "cancelled": "Cancelled",
    "aborted": "Aborted",
    "preempted": "Preempted",
    "paused": "Paused",
    "resumed": "Resumed",
}
# A steer guides a turn that goes on: its own sign, not a stop's ``⊘``.
_SIGNS = {"steered": "↪", "paused": "⏸", "resumed": "▶"}


def cap(text: str, limit: int = REASON_CAP) -> str:
    """The first ``limit`` characters, with a visible mark saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[truncated {len(text) - limit} characters]"


def escape(text: str) -> str:
    """Escape ``<``, ``>``, ``&`` and both quotes."""
    return html.escape(text, quote=True)


def neutralize(text: str) -> str:
    """``text`` with the ``<`` of each of Tether's frame tags written ``&lt;``, as a real
    frame writes a ``<`` in its text: nothing else changes, and twice is once."""
    return _FRAME_TAG.sub("&lt;", text)


def neutralized(value: Any) -> Any:
    """A JSON-ready value (a tool's result) with every string in it, keys included,
    neutralized."""
    if isinstance(value, str):
        return neutralize(value)
    if isinstance(value, dict):
        return {
            neutralize(k) if isinstance(k, str) else k: neutralized(v) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [neutralized(v) for v in value]
    return value


def who(origin: str, by: str | None) -> str:
    """Who acted, as every face writes it after "by": ``user alice``, or ``user`` for a
    person who gave no name (never the parent address they presented: on a grandchild that
    is an agent's id, and would read as if the agent did it); ``parent (<id>)`` for an
    agent; ``watchdog`` and ``budget`` for the system's own; ``system (<by>)`` else."""
    if origin in ("watchdog", "budget"):  # the system's own: its origin says who
        return origin
    if origin == "user":
        return "user" if not by or by == "user" else f"user {by}"
    return f"{origin} ({by})" if by else origin


def marker_text(action: str, origin: str, by: str, reason: str) -> str:
    """``⊘ Cancelled by user alice: <reason>``, escaped; no colon part without a reason.

    ``by`` is said as ``who`` says it (``by parent (<id>)``, ``by watchdog``, ``by user``
    for a person with no name). The system's own follow-up markers (``forced``,
    ``escalated``) read ``⊘ Forced: ...``; a steer ``↪ Steered by user alice: ...`` (the
    watchdog's ``↪ Steered by watchdog: ...``); a pause ``⏸ Paused by ...`` and a resume
    ``▶ Resumed by ...``.
    """
    if action == "recovered":  # the system's, and says what was kept
        return f"↻ Recovered {escape(reason)}"
    verb = _VERBS.get(action)
    sign = _SIGNS.get(action, "⊘")
    if verb is None:
        head = f"{sign} {action.capitalize()}"
    else:
        head = f"{sign} {verb} by {escape(who(origin, by))}"
    return f"{head}: {escape(reason)}" if reason else head


def discarded_text(origin: str, by: str, stop: str | None, text: str) -> str:
    """A steer that never reached a boundary: ``⊘ Discarded steer by user alice (the
    cancel came first): <its text>``, escaped; ``stop`` None: the turn ended first."""
    why = "the turn ended first" if stop is None else f"the {stop} came first"
    return f"⊘ Discarded steer by {escape(who(origin, by))} ({why}): {escape(text)}"


def unknown_call_text(cause: str) -> str:
    """What a model reads for a call whose start was durable and its result not, when a
    crash interrupted its turn (semantics §17.1): never that it ran, never that it did not."""
    who_stopped = "the host stopped" if cause == "host" else "its worker died"
    return f"unknown: {who_stopped} while this call ran; it may or may not have taken effect"


def recovery_reason(cause: str, attempt: int, steps: int, unknown: list[str]) -> str:
    """``after the host stopped (attempt 1): 4 steps kept, 1 tool call unknown
    (run_command)``: what a recovered turn's marker says after ``↻ Recovered``."""
    after = "the host stopped" if cause == "host" else "the worker died"
    kept = f"{steps} step{'' if steps == 1 else 's'} kept"
    if unknown:
        n = len(unknown)
        names = ", ".join(unknown)  # escaped with the rest by marker_text
        kept += f", {n} tool call{'' if n == 1 else 's'} unknown ({names})"
    return f"after {after} (attempt {attempt}): {kept}"


def render_frame(tag: str, origin: str, by: str, text: str) -> str:
    """The frame as a model reads it: ``<steer origin="user" by="...">text</steer>``."""
    if tag not in FRAME_TAGS:  # a new frame tag is one ``neutralize`` must know
        raise ValueError(f"{tag!r} is not one of Tether's frame tags {FRAME_TAGS}")
    return f'<{tag} origin="{escape(origin)}" by="{escape(by)}">{escape(text)}</{tag}>'
