"""Opaque, sortable ids: a prefix and a ULID (48-bit milliseconds + 80 random bits)."""

from __future__ import annotations

import os
import time

__all__ = ["new_id"]

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_id(prefix: str) -> str:
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        value, rem = divmod(value, 32)
        chars.append(_ALPHABET[rem])
    return prefix + "".join(reversed(chars))
