"""Opaque, sortable ids: a prefix and 26 base32 characters (48-bit ms time + 80 random bits).

The time leads, so ids sort by creation; Crockford's alphabet keeps them unambiguous.
"""

from __future__ import annotations

import base64
import os
import time

__all__ = ["new_id"]

_TO_CROCKFORD = bytes.maketrans(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", b"0123456789ABCDEFGHJKMNPQRSTVWXYZ"
)


def new_id(prefix: str) -> str:
    raw = int(time.time() * 1000).to_bytes(6, "big") + os.urandom(10)
    return prefix + base64.b32encode(raw)[:26].translate(_TO_CROCKFORD).decode()
