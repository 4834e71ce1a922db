"""Worker backends: where a turn's worker process lives and how its frames travel.

The agents need an :class:`~tether.actors.ports.Executor` (submit, signal, kill, freeze,
thaw, accepting, dispatched); the ``Runtime`` facade needs four more things of the same
object (probe a driver, drain, close, list worker pids). That is a :class:`Backend`. A
backend is built with ``(workers, host)``: ``host`` answers the worker's ``say`` and tool
calls (the store and authority stay in the host process whatever the backend).

Two ship: ``"local"``, the process :class:`~tether.runtime.backends.pool.Pool` (the default),
and ``"ray"``, :class:`~tether.runtime.backends.ray.RayBackend` (the optional extra
``tether-runtime[ray]``, imported only when asked for). Every backend keeps the contract of
semantics §14.6: a turn's end is reported only once its whole process tree is dead. Both keep
that contract in one place, the turn table (``backends._turns``): each drives its workers
and leaves every turn's life, from the queue to its one report, to the table.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, Protocol

from tether.actors.ports import Executor
from tether.contain.cgroup import Cgroups
from tether.runtime.backends._turns import WorkerHost
from tether.runtime.backends.pool import Pool
from tether.wire.errors import InvalidParams, TetherError

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendFactory",
    "WorkerHost",
    "check_backend",
    "make_backend",
]

BACKENDS = ("local", "ray")


class Backend(Executor, Protocol):
    """An :class:`Executor` the ``Runtime`` can also probe, drain, close and list."""

    def probe(self, driver: str, config: dict[str, Any] | None = None) -> bool:
        """Check that a worker can load ``driver`` (DriverNotFound otherwise) and, where
        its class has ``check_config``, that it takes ``config`` (that check's error
        otherwise); the host never imports driver code itself. Returns whether its class
        continues a crashed turn (``recoverable``, semantics §17.1)."""

    def drain(self) -> None:
        """Take no new turns (the runtime is closing); running ones go on."""

    def close(self) -> None:
        """Stop every worker: no process and nothing remote is left when it returns;
        whatever is still queued is reported as ended."""

    def worker_pids(self) -> list[int]:
        """The pids of the processes that run turns (for tests and benchmarks)."""


BackendFactory = Callable[[int, WorkerHost], Backend]


def _local(
    workers: int, host: WorkerHost, cgroups: Cgroups | None = None, preload: tuple[str, ...] = ()
) -> Backend:
    # mypy checks here that the pool is a Backend
    return Pool(workers, host, cgroups=cgroups, preload=preload)


def check_backend(backend: str | BackendFactory, ray_address: str | None) -> None:
    """Refuse a backend that cannot be built, before anything is started."""
    if callable(backend):
        return
    if backend not in BACKENDS:
        raise InvalidParams(f"backend must be one of {', '.join(BACKENDS)} or a factory")
    if backend == "local" and ray_address is not None:
        raise InvalidParams("ray_address needs backend='ray'")
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise TetherError(
            "backend='ray' needs Ray, which is not installed: install the extra "
            "tether-runtime[ray] (pip install 'tether-runtime[ray]')"
        )


def make_backend(
    backend: str | BackendFactory,
    workers: int,
    host: WorkerHost,
    *,
    ray_address: str | None = None,
    ray_options: dict[str, Any] | None = None,
    cgroups: Cgroups | None = None,
    containment: str = "walk",
    preload: tuple[str, ...] = (),
) -> Backend:
    """Build the backend named by ``backend`` (or call a factory). ``cgroups``: the
    host's cgroup group for cgroup containment (the local backend); ``containment``: the
    mode the Ray backend's slots use on their nodes (``"auto"``, ``"cgroup"``, ``"walk"``);
    ``preload``: modules the local workers' launcher imports before it forks them."""
    check_backend(backend, ray_address)
    if callable(backend):
        return backend(workers, host)
    if backend == "local":
        return _local(workers, host, cgroups, preload)
    if backend == "ray":
        # Ray is present: an error importing it is a broken install, and says so itself.
        from tether.runtime.backends.ray import RayBackend

        options: dict[str, Any] = {"containment": containment, **(ray_options or {})}
        ray_backend: Backend = RayBackend(workers, host, address=ray_address, **options)
        return ray_backend
    raise InvalidParams(f"backend must be one of {', '.join(BACKENDS)} or a factory")
