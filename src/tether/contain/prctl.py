"""Two of Linux's process controls (``prctl``) that containment rests on: a child
subreaper (orphaned tools come back to us, not to PID 1) and a parent-death signal."""

from __future__ import annotations

import ctypes

__all__ = ["set_parent_death_signal", "set_subreaper"]

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def set_subreaper() -> bool:
    """Make this process a child subreaper (Linux); False where unsupported."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux)."""
    return _prctl(_PR_SET_PDEATHSIG, sig)
