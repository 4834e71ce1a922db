"""The host's secrets (semantics §17.4): the variables no worker's tool may see, and the
one use a worker has for some of them, its session's model key.

A secret is the server's token (``TETHER_TOKEN``), a name given in
``Runtime(secret_env=[...])``, or a variable any session's config names as a key
(``api_key_env``, at any depth). Workers start without them (``worker_environ``) and drop
any learnt later before each turn (``for_turn``'s names); a turn carries only its own
session's keys' values, for its model client.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = ["KEY_FIELD", "TOKEN_ENV", "Secrets", "key_names"]

TOKEN_ENV: Final = "TETHER_TOKEN"
KEY_FIELD: Final = "api_key_env"  # a config field naming the variable that holds a key


def key_names(config: Mapping[str, Any] | None) -> list[str]:
    """The variables ``config`` names as keys (``api_key_env`` fields, at any depth)."""
    found: list[str] = []
    stack: list[Any] = [] if config is None else [config]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            for field, value in item.items():
                if field == KEY_FIELD and isinstance(value, str) and value:
                    found.append(value)
                elif isinstance(value, Mapping | list):
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, Mapping | list))
    return found


class Secrets:
    """The secret names one runtime knows; they only grow. Read without the lock: each
    value is replaced whole."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self.names: frozenset[str] = frozenset()
        # the secrets the host's environment holds: what a worker may have inherited
        self._present: list[str] = []
        self.learn_names([TOKEN_ENV, *names])

    def learn_names(self, names: Iterable[str]) -> None:
        new = set(names) - self.names
        if not new:
            return
        with self._lock:
            self.names = self.names | new
            self._present = sorted(n for n in self.names if n in os.environ)

    def learn(self, config: Mapping[str, Any] | None) -> None:
        """Count the keys ``config`` names among the secrets."""
        self.learn_names(key_names(config))

    def worker_environ(self) -> dict[str, str]:
        """The environment a new worker starts with: the host's, less every secret."""
        names = self.names
        return {k: v for k, v in os.environ.items() if k not in names}

    def for_turn(self, config: Mapping[str, Any] | None) -> tuple[dict[str, str] | None, list[str]]:
        """What a turn of a session with ``config`` carries: the values of its keys (for
        its model client; a key not set is left out, and the client says so), and the
        secrets to drop from the worker's environment."""
        if config is None:
            return None, self._present
        names = key_names(config)
        if not names:
            return None, self._present
        self.learn_names(names)
        keys = {n: os.environ[n] for n in names if os.environ.get(n)}
        return keys or None, self._present
