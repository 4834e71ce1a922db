"""Other runtimes, measured in the same run: pykka, Thespian, anyio's process runner, Ray.

Each peer's package but pykka (a Tether dependency) is optional (the `bench` extra; Ray
is not in it at all): a missing one skips its case with a note, so those imports live
inside the case functions.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pykka

from benchmarks import _procs
from benchmarks._case import Cfg, Samples, Skip, ms_since, us_since


class Survivors:
    """Counts, over a whole case, the tree processes a peer's hard stop left running."""

    def __init__(self, cfg: Cfg, peer: str) -> None:
        self.cfg, self.peer, self.left, self.samples = cfg, peer, 0, 0

    def add(self, tree: _procs.Tree) -> None:
        """Count the tree's survivors right after the stop returned, then kill them."""
        survivors = _procs.alive(tree.pids(with_starter=False))
        self.left += len(survivors) + len(_procs.alive([tree.starter]))
        self.samples += 1
        _procs.kill_all(survivors)
        self.cfg.note(
            f"{self.peer}: when its hard stop returned, {self.left} of "
            f"{4 * self.samples} tree processes (worker, sh, 2 sleeps) were still "
            f"running, over {self.samples} samples; the benchmark kills the tool "
            f"tree",
            key=self.peer,
        )


# ---------------------------------------------------------------- anyio


def run_wedge(argv: list[str]) -> int:
    """Runs in an anyio worker process (pickled by reference, so module level)."""
    return subprocess.run(argv, check=False).returncode


def anyio_hard_stop(cfg: Cfg) -> Iterator[Samples]:
    """`anyio.to_process.run_sync(cancellable=True)` running the wedged tree, cancelled:
    time from cancel to the awaiting task seeing the cancellation (anyio SIGKILLs and
    reaps its worker first). anyio kills only its worker, never the tree under it."""
    try:
        import anyio
        import anyio.to_process
    except ImportError as e:
        raise Skip(f"anyio not installed ({e})") from e

    survivors = Survivors(cfg, "anyio")

    async def sample(tag: str) -> float:
        stopped: list[int] = []

        async def target() -> None:
            try:
                await anyio.to_process.run_sync(run_wedge, _procs.wedge_argv(tag), cancellable=True)
            except anyio.get_cancelled_exc_class():
                stopped.append(time.perf_counter_ns())
                raise

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(target)
                tree = await anyio.to_thread.run_sync(_procs.find_tree, tag, 20.0)
                t0 = time.perf_counter_ns()
                tg.cancel_scope.cancel()
        survivors.add(tree)
        return ms_since(t0, stopped[0])

    async def rep(n: int) -> list[float]:
        return [await sample(_procs.wedge_tag()) for _ in range(n)]

    while True:
        yield {"cancel_ms": anyio.run(rep, cfg.n(10, 30))}


# ---------------------------------------------------------------- pykka


def pykka_peer(cfg: Cfg) -> Iterator[Samples]:
    """In-process actor: `ask` round trip latency and `tell` throughput (flushed by an ask)."""

    class Echo(pykka.ThreadingActor):
        def on_receive(self, message: Any) -> Any:
            return message

    ref = Echo.start()
    try:
        for i in range(500):
            ref.ask(i, timeout=10)
        while True:
            asks = []
            for i in range(cfg.n(5000, 20000)):
                t0 = time.perf_counter_ns()
                ref.ask(i, timeout=10)
                asks.append(us_since(t0, time.perf_counter_ns()))
            n = cfg.n(20000, 100000)
            t0 = time.perf_counter_ns()
            for i in range(n):
                ref.tell(i)
            ref.ask(-1, timeout=60)  # FIFO: when this returns, every tell was handled
            yield {"ask_us": asks, "tells_per_s": [n / ((time.perf_counter_ns() - t0) / 1e9)]}
    finally:
        ref.stop(timeout=10)


# ---------------------------------------------------------------- Thespian


def thespian_peer(cfg: Cfg) -> Iterator[Samples]:
    """Thespian's `multiprocQueueBase`: an actor in another process, `ask` round trip."""
    try:
        from thespian.actors import ActorSystem  # type: ignore[import-untyped]

        from benchmarks._thespian_actor import Echo
    except ImportError as e:
        raise Skip(f"thespian not installed ({e})") from e
    asys = ActorSystem("multiprocQueueBase")
    try:
        actor = asys.createActor(Echo)
        for i in range(100):
            asys.ask(actor, i, 10)
        while True:
            rtts = []
            for i in range(cfg.n(1000, 5000)):
                t0 = time.perf_counter_ns()
                if asys.ask(actor, i, 10) != i:
                    raise RuntimeError("thespian ask timed out or answered wrong")
                rtts.append(us_since(t0, time.perf_counter_ns()))
            yield {"rtt_us": rtts}
    finally:
        asys.shutdown()


# ---------------------------------------------------------------- Ray


def ray_peer(cfg: Cfg) -> Iterator[Samples]:
    """Ray actor call throughput, and `ray.cancel(force=True)` on a task wedged in the
    same `sh -c "sleep & sleep; wait"` tree (time until `ray.get` raises)."""
    try:
        import ray
        import ray.exceptions
    except ImportError as e:
        raise Skip(f"ray not installed ({e}); `pip install ray` to include it") from e

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        # Defined here, so that Ray ships them by value and its workers need not import us.
        @ray.remote
        class Echo:
            def f(self, x: int) -> int:
                return x

        @ray.remote(max_retries=0)  # type: ignore[untyped-decorator]  # Ray's are Any here
        def wedge(argv: list[str]) -> int:
            return subprocess.run(argv, check=False).returncode

        survivors = Survivors(cfg, "ray")
        echo = Echo.remote()  # type: ignore[attr-defined]
        ray.get([echo.f.remote(i) for i in range(200)], timeout=120)
        while True:
            n = cfg.n(2000, 10000)
            t0 = time.perf_counter_ns()
            ray.get([echo.f.remote(i) for i in range(n)], timeout=120)
            calls = n / ((time.perf_counter_ns() - t0) / 1e9)
            cancels = []
            for _ in range(cfg.n(3, 8)):
                tag = _procs.wedge_tag()
                ref = wedge.remote(_procs.wedge_argv(tag))
                tree = _procs.find_tree(tag, timeout=60)
                t0 = time.perf_counter_ns()
                ray.cancel(ref, force=True)
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(ref, timeout=30)
                cancels.append(ms_since(t0, time.perf_counter_ns()))
                # The orphaned tool tree is ours to clean up; Ray's worker is not: killing
                # it under Ray leaks its CPU slot and later tasks never start.
                survivors.add(tree)
                with _procs.DeathWatch([tree.starter]) as watch:
                    watch.wait(timeout=20)
            yield {"calls_per_s": [calls], "cancel_ms": cancels}
    finally:
        ray.shutdown()
