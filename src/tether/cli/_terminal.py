"""Text the CLI prints: what came from a model, a tool or a person shows its control
characters escaped, so it cannot clear the screen, move the cursor or retitle the window.

``shown`` is for the human output (``\\x1b``, ``\\u202e``; tab and newline kept, so a
multi-line reply prints as such); ``json_line`` for ``--json``, whose encoder escapes C0
already and which here escapes DEL, C1 and the bidi controls too (``\\u009b``): the same
JSON value, safe on a terminal. A backslash is left as it is: ``C:\\x1b`` typed by a
person reads the same as an escaped ESC, and ``--json`` tells them apart.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tether.wire.text import TERMINAL_CONTROLS

__all__ = ["json_line", "shown"]


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _unicode_escaped(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def shown(text: str) -> str:
    """``text`` for a terminal: each control character as its escape (``\\x1b``)."""
    return TERMINAL_CONTROLS.sub(_escaped, text)


def json_line(value: Any) -> str:
    """``value`` as one line of JSON with no character a terminal would act on (outside a
    string JSON is ASCII, so every one of them is inside a string, where ``\\uXXXX`` is
    the same character)."""
    return TERMINAL_CONTROLS.sub(_unicode_escaped, json.dumps(value, ensure_ascii=False))
