"""Untrusted text made safe for the places a model or a page reads it.

Reasons and steer texts come from people and from other agents, so they are capped
(with a visible truncation mark) and escaped wherever they are embedded in text.
"""

from __future__ import annotations

import html

__all__ = ["REASON_CAP", "cap", "escape", "marker_text", "render_frame"]

REASON_CAP = 2000

_VERBS = {
    "steered": "Steered",
    "cancelled": "Cancelled",
    "aborted": "Aborted",
    "preempted": "Preempted",
    "paused": "Paused",
    "resumed": "Resumed",
}
_SIGNS = {"paused": "⏸", "resumed": "▶"}


def cap(text: str, limit: int = REASON_CAP) -> str:
    """The first ``limit`` characters, with a visible mark saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[truncated {len(text) - limit} characters]"


def escape(text: str) -> str:
    """Escape ``<``, ``>``, ``&`` and both quotes."""
    return html.escape(text, quote=True)


def marker_text(action: str, origin: str, by: str, reason: str) -> str:
    """``⊘ Cancelled by user (<by>): <reason>``, escaped; no colon part without a reason.

    The system's own follow-up markers (``forced``, ``escalated``) read ``⊘ Forced: ...``;
    the watchdog's read ``⊘ Steered by watchdog: ...``; a pause ``⏸ Paused by ...`` and a
    resume ``▶ Resumed by ...``.
    """
    verb = _VERBS.get(action)
    sign = _SIGNS.get(action, "⊘")
    if verb is None:
        head = f"{sign} {action.capitalize()}"
    elif origin in ("watchdog", "budget"):  # the system's own: its origin says who
        head = f"{sign} {verb} by {origin}"
    else:
        head = f"{sign} {verb} by {origin} ({escape(by)})"
    return f"{head}: {escape(reason)}" if reason else head


def render_frame(tag: str, origin: str, by: str, text: str) -> str:
    """The frame as a model reads it: ``<steer origin="user" by="...">text</steer>``."""
    return f'<{tag} origin="{escape(origin)}" by="{escape(by)}">{escape(text)}</{tag}>'
