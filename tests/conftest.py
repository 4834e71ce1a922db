"""Shared fixtures: a real runtime per test, and a leak check on every test.

Every test runs with real worker processes and real SQLite. Teardown closes the runtime
and then checks with psutil that no process the test started is left running.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil
import pytest

import tether

_LEAK_TIMEOUT = 5.0


def _live_children() -> set[int]:
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Fail the test if it leaves a child process (worker, tool, forkserver) running."""
    before = _live_children()
    yield
    leaked = _live_children() - before
    if leaked:
        procs = []
        for pid in leaked:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
        _, alive = psutil.wait_procs(procs, timeout=_LEAK_TIMEOUT)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if alive:
            names = [f"{p.pid}:{' '.join(p.cmdline())[:80]}" for p in alive]
            for p in alive:
                p.kill()
            pytest.fail(f"processes leaked past teardown: {names}")


@pytest.fixture
def rt() -> Iterator[tether.Runtime]:
    """An in-memory runtime with two workers and a short grace."""
    with tether.Runtime(workers=2, grace=1.0) as runtime:
        yield runtime


@pytest.fixture
def db_path(tmp_path: os.PathLike[str]) -> str:
    return os.path.join(os.fspath(tmp_path), "state.db")
