"""Opaque ids that sort by creation: a prefix, 12 hex digits of milliseconds, 20 random.

Cheap to make (one hot path makes one per turn) and unique across restarts.
"""

from __future__ import annotations

import os
import time

__all__ = ["new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}{int(time.time() * 1000):012x}{os.urandom(10).hex()}"
