"""``tether tui``: the terminal UI of ``tether serve`` (SPEC §17.3; extra ``tether-runtime[tui]``).

A client like the CLI and the web console: it drives a server over its JSON-RPC and its
event stream, and imports nothing of the engine. ``run`` is what the ``tether tui``
command calls; ``TetherTui`` is the Textual app (its tests drive it with Textual's pilot).
"""

from __future__ import annotations

from tether.cli.client import Client
from tether.tui.app import TetherTui

__all__ = ["TetherTui", "run"]


def run(client: Client, *, root: str | None = None, name: str | None = None) -> int:
    """Run the UI on this terminal until ``q``; 0."""
    TetherTui(client, root=root, name=name).run()
    return 0
