"""The ``agent`` factory an adapter's config names (``"pkg.module:function"``), checked
when the session is opened: a worker imports it then (``check_config``), so a factory
that cannot be imported is refused at ``open_session``/``spawn`` as ``driver-not-found``,
not found out at the first turn."""

from __future__ import annotations

import importlib
from typing import Any

from tether.wire.errors import DriverNotFound, InvalidParams

__all__ = ["check_factory"]

# Where the workers look: they have the host's import path and directory.
_WHERE = (
    "the workers import what the host can: a script's own directory, the directory "
    "`tether serve` was started in, PYTHONPATH, the installed packages"
)


def check_factory(config: dict[str, Any]) -> None:
    """DriverNotFound, naming the factory and what to do, when ``config["agent"]`` cannot
    be imported; InvalidParams when what it names is not callable. A malformed or missing
    ``agent`` is left to the adapter's own config check, which says so."""
    spec = config.get("agent")
    if not isinstance(spec, str) or ":" not in spec:
        return
    module, _, name = spec.partition(":")
    try:
        found = importlib.import_module(module)
    except Exception as exc:  # any failure of the user's module to import: say which
        raise DriverNotFound(
            f"config.agent: cannot import {module!r} (for {spec}): "
            f"{type(exc).__name__}: {exc}; {_WHERE}"
        ) from None
    if not hasattr(found, name):
        raise DriverNotFound(
            f"config.agent: {module!r} has no function {name!r} (for {spec}); "
            "name a function that takes the config and returns the agent"
        )
    if not callable(getattr(found, name)):  # there, but a mistake in the config
        raise InvalidParams(f"config.agent: {spec} is not callable")
