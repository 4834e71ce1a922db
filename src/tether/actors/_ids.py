"""Opaque ids that sort by creation: a prefix, 12 hex digits of milliseconds, 20 random.

Cheap to make (one hot path makes one per turn) and unique across restarts.
"""

from __future__ import annotations

import os
import time

__all__ = ["new_id"]


def new_id(prefix: str, now: float | None = None) -> str:
    """``now``: the wall time to stamp it with (a session passes its own clock's)."""
    stamp = time.time() if now is None else now
    return f"{prefix}{int(stamp * 1000):012x}{os.urandom(10).hex()}"
