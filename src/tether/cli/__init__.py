"""The ``tether`` command: an RPC client of ``tether serve``, the live tree, the demo.

Outside the engine (``tether.runtime``): it talks to a server over HTTP, except the demo,
which embeds a ``Runtime`` through the public API.
"""

from tether.cli.main import main

__all__ = ["main"]
