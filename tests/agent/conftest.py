"""The agent tests' model server and key.

``server``: the scripted model server (``tether.testing.ModelServer``) for the whole
module, in a process of its own: it notices a client's disconnect at once, never waiting
for this process's GIL behind the runtime's threads (the tests compare the two times).

``api_key``: the module's ``SECRET`` under its ``KEY_ENV`` in this process's environment
(so every worker's) while the module's tests run; a module asks for it with
``pytest.mark.usefixtures("api_key")``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tether.testing import ModelServer


@pytest.fixture(scope="module")
def server() -> Iterator[ModelServer]:
    with ModelServer(process=True, realtime=True) as s:
        yield s


@pytest.fixture(scope="module")
def api_key(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.module.KEY_ENV
    secret: str = request.module.SECRET
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(name, secret)
        yield secret
