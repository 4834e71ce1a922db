"""Shared fixtures: a real runtime per test, and a leak check on every test.

Every test runs with real worker processes and real SQLite. Teardown closes the runtime
and then checks with psutil that no process the test started is left running.

Backends: the ``rt`` fixture runs on ``backend`` (``"local"`` unless a module lists
``BACKENDS = ("local", "ray")``, which runs each of its ``rt`` tests on both). Ray is
started once per test session (``ray_session``); without Ray installed the Ray cases
skip, naming the extra ``tether-runtime[ray]``; with Ray installed but broken they error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import tether
from drivers import SCRIPTED_BY_KIND, TESTS, cgroup_probe, escapee_procs, ray_idle_worker
from tether_server import SHARED, shared_trees

_LEAK_TIMEOUT = 5.0


# The session-wide Ray instance's own processes (its daemons, recorded when it started,
# and the idle workers its raylet keeps and starts at will) are not the test's: they are
# the only allowance. Slot and reaper actors ("ray::Slot", "ray::Reaper") and turn
# children are the test's, and must be gone at teardown like any worker.
_ray_daemons: set[int] = set()


def _ray_own(p: psutil.Process) -> bool:
    return p.pid in _ray_daemons or ray_idle_worker(p)


def _live_children() -> set[int]:
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not (_ray_daemons and _ray_own(p)):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    # The module-wide servers' trees (tests/tether_server.py) are checked by settle() after
    # each test and when the module stops them. Listed after the children, so a process a
    # shared server starts meanwhile is left out too.
    return out - shared_trees() if SHARED else out


class _Spawned(AssertionError):
    """A unit test started a process: it belongs in another suite."""


def _refuse(*_: Any, **__: Any) -> Any:
    raise _Spawned("a unit test may not start a process (mark: unit)")


@pytest.fixture(autouse=True)
def unit_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``unit`` (``make test-unit``) runs in this process alone: every way
    to start another (fork, spawn, exec, a subprocess, a multiprocessing start) raises."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process

    with pytest.MonkeyPatch.context() as mp:
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve"):
            if hasattr(os, name):
                mp.setattr(os, name, _refuse)
        mp.setattr(subprocess.Popen, "__init__", _refuse)
        mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
        yield


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Fail the test if it leaves a child process (worker, tool, launcher) running."""
    before = _live_children()
    yield
    leaked = _live_children() - before
    if leaked:
        procs = []
        for pid in leaked:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
        _, alive = psutil.wait_procs(procs, timeout=_LEAK_TIMEOUT)
        alive = [
            p
            for p in alive
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not _ray_own(p)
        ]
        if alive:
            names = [f"{p.pid}:{' '.join(p.cmdline())[:80]}" for p in alive]
            for p in alive:
                p.kill()
            pytest.fail(f"processes leaked past teardown: {names}")


RAY_MISSING = "the Ray backend needs the extra tether-runtime[ray] (pip install -e '.[ray]')"


def _installed(name: str) -> bool:
    """Whether the package ``name`` is installed: a module with an origin (a folder on
    sys.path named like it, with no __init__.py, is a namespace package without one).
    The test folders are named so that none is (tests/on_ray, tests/agent)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One Ray instance for the whole test session (ray.init takes seconds)."""
    if not _installed("ray"):
        pytest.skip(RAY_MISSING)
    import ray  # installed: an error here is a broken install, and fails the test

    from tether.runtime.backends.ray import ensure_ray, shutdown_ray

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # The test drivers (tests/drivers.py) must import on the cluster too, as a user's
    # drivers must: here through the job's runtime_env.
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    started = ensure_ray(
        runtime_env={"env_vars": {"PYTHONPATH": path}},
        init_options={"num_cpus": 2, "object_store_memory": 100 * 2**20},
    )
    _ray_daemons.update(p.pid for p in psutil.Process().children(recursive=True))
    _ray_daemons.difference_update(before)
    yield ray
    if started:
        shutdown_ray()
    _ray_daemons.clear()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[dict[str, Any]]:
    """A two-node ``ray.cluster_utils.Cluster`` (tests/cluster_child.py, in its own
    process): ``{"address", "nodes": [head, worker], "launcher": pid}``. Each node has one
    unit of the resource ``tether_slot``."""
    if not _installed("ray"):
        pytest.skip(RAY_MISSING)
    script = str(TESTS / "cluster_child.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdin is not None and proc.stdout is not None
    daemons: set[int] = set()
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the Ray cluster did not start (see stderr)")
        info: dict[str, Any] = json.loads(line)
        daemons = set(info["daemons"]) | {proc.pid}
        _ray_daemons.update(daemons)
        yield {**info, "launcher": proc.pid}
    finally:
        proc.stdin.close()
        proc.wait(60.0)
        proc.stdout.close()
        _ray_daemons.difference_update(daemons)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        names = getattr(metafunc.module, "BACKENDS", ("local",))
        if len(names) > 1 or names[0] != "local":
            params = [pytest.param(n, marks=pytest.mark.ray) if n == "ray" else n for n in names]
            metafunc.parametrize("backend", params, indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On Ray, the tests run with the sync driver kind only: how a driver of either kind
    takes a stop is the worker's business, the same code in a Ray slot's child as in a
    local worker, while what Ray changes (how frames reach the child, how its tree dies)
    is the same for both kinds. The tests marked ``host_decides`` (authority, no-ops,
    validation, notices: decided by the host alone, whatever the backend) do not run on
    Ray at all. Every test still runs with both kinds on the local backend. (Each Ray
    runtime costs seconds of process starts: this keeps CI's Ray suite to what the
    backend can change.)"""
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        on_ray = params.get("backend") == "ray"
        if on_ray and (
            item.get_closest_marker("host_decides") is not None
            or params.get("driver_kind") == "async"
        ):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    # The tests marked ``long`` (minutes each) start first: pytest-xdist's workers then
    # share out the short ones behind them and end together, instead of one worker
    # starting a long test when the others are nearly done. (Each is alone in its module:
    # moving it shares no module fixture out of order.)
    keep.sort(key=lambda item: item.get_closest_marker("long") is None)
    items[:] = keep


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The worker backend of ``rt``: "local", or "ray" (Ray started once per session)."""
    name: str = getattr(request, "param", "local")
    if name == "ray":
        request.getfixturevalue("ray_session")
    return name


@pytest.fixture
def rt(backend: str) -> Iterator[tether.Runtime]:
    """An in-memory runtime with two workers and a short grace."""
    with tether.Runtime(workers=2, grace=1.0, backend=backend) as runtime:
        yield runtime


@pytest.fixture(params=sorted(SCRIPTED_BY_KIND, reverse=True))
def driver_kind(request: pytest.FixtureRequest) -> str:
    """``sync`` or ``async``: which kind of driver the test's scripted sessions run (a
    test that takes ``scripted`` runs once with each: semantics §11, §15.1)."""
    return str(request.param)


@pytest.fixture
def scripted(driver_kind: str) -> str:
    """The import string of the scripted driver of ``driver_kind``."""
    return SCRIPTED_BY_KIND[driver_kind]


@pytest.fixture
def db_path(tmp_path: os.PathLike[str]) -> str:
    return os.path.join(os.fspath(tmp_path), "state.db")


# ---- the containment paths and issue 19's escapee (test_containment, test_ray_containment) ----


@pytest.fixture(params=["cgroup", "walk"])
def containment(request: pytest.FixtureRequest) -> str:
    """Each containment path (semantics §15.5); the cgroup one skips, with why, where none is."""
    name: str = request.param
    missing = cgroup_probe()[0]
    if name == "cgroup" and missing is not None:
        pytest.skip(f"no cgroup containment here: {missing}")
    return name


@pytest.fixture
def token() -> Iterator[str]:
    """A name no other process has: what the escapee renames itself to."""
    tok = f"tether-escapee-{uuid.uuid4().hex[:10]}"
    yield tok
    for p in escapee_procs(tok):  # only after a failure: nothing of it may outlive the test
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
