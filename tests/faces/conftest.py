"""The face tests' server: one ``tether serve`` per module (``tests/tether_server.py``).

A module whose server needs flags of its own defines its own ``shared``; ``server`` then
settles that one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tether_server import LiveServer, settle, shared_server


@pytest.fixture(scope="module")
def shared(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """A plain ``tether serve`` for the whole module."""
    name = request.module.__name__.removeprefix("test_")
    with shared_server(tmp_path_factory.mktemp(name)) as live:
        yield live


@pytest.fixture
def server(shared: LiveServer) -> Iterator[LiveServer]:
    """The module's server; each test opens its own sessions, and what it leaves running
    is aborted (and the server's processes checked) before the next."""
    yield shared
    settle(shared)
