"""Opaque ids that sort by creation: a prefix, 12 hex digits of milliseconds, 20 random.

Cheap to make (one hot path makes one per turn) and unique across restarts.
"""

from __future__ import annotations

import os
import re
import time
from typing import Final

__all__ = ["is_id", "new_id"]

# What ``new_id`` makes after its prefix: at least 32 hex digits (12 of time, 20 random).
_DIGITS: Final = re.compile("[0-9a-f]{32,64}")


def new_id(prefix: str, now: float | None = None) -> str:
    """``now``: the wall time to stamp it with (a session passes its own clock's)."""
    stamp = time.time() if now is None else now
    return f"{prefix}{int(stamp * 1000):012x}{os.urandom(10).hex()}"


def is_id(text: str, prefix: str) -> bool:
    """Whether ``text`` has the shape of an id ``new_id(prefix)`` made (not that it exists)."""
    return text.startswith(prefix) and _DIGITS.fullmatch(text, len(prefix)) is not None
