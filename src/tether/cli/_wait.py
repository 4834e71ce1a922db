"""The demos' one wait: poll a condition until it holds, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["wait"]


def wait(what: str, done: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``done()``'s first true value; a demo step that never comes is a failed demo."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo step timed out: {what}")
        time.sleep(0.02)
