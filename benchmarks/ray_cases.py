"""Tether on Ray (issue 12): a trivial turn, and an abort of a tree with a `setsid` escapee.

Optional: without Ray (the extra `tether-runtime[ray]`) the case is skipped with a note. The case
starts its own local Ray (`ray.init` takes seconds; not timed) and runs the same
`tether.Runtime` API as the local cases, with `backend="ray"`: two slots and a spare.
Read next to `peer.ray_cancel_force_p50_ms`, Ray's own stop, measured in the same run.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from typing import Any

import tether
from benchmarks import _procs
from benchmarks._case import Cfg, Samples, Skip, ms_since
from benchmarks.tether_cases import SCRIPTED, WAIT, Events, _on, _pool_steady, _quiet_child


def escapee_wedge(tag: str) -> dict[str, Any]:
    """`sh` with one sleep in its group and one that escaped with `setsid`."""
    argv = ["sh", "-c", f"setsid sleep {tag} & sleep {tag}; wait"]
    return {"steps": [{"op": "tool", "argv": argv}]}


def ray_backend(cfg: Cfg) -> Iterator[Samples]:
    """turn_ms: a send → its turn's end event (a one-step turn on a Ray slot).
    abort_ms: `interrupt(kind="abort")` → the worker, sh and both sleeps (one a `setsid`
    escapee) dead (pidfds) and the turn ended `aborted` (event); the later of the two.
    The walk (containment="walk"); `ray_backend_cgroup` is the same under cgroup."""
    return _ray_case(cfg, "walk")


def ray_backend_cgroup(cfg: Cfg) -> Iterator[Samples]:
    """`ray_backend` under containment="cgroup": each slot's turn in a leaf of its node,
    an abort is the node reaper's `cgroup.kill` (issue 19)."""
    return _ray_case(cfg, "cgroup")


def _ray_case(cfg: Cfg, containment: str) -> Iterator[Samples]:
    if importlib.util.find_spec("ray") is None:
        raise Skip("Ray is not installed; the extra tether-runtime[ray] includes it")
    options = {"init_options": {"num_cpus": 2}}
    try:
        rt = tether.Runtime(workers=2, backend="ray", containment=containment, ray_options=options)
    except tether.InvalidParams as exc:  # no writable cgroup v2 here: say why
        raise Skip(exc.message) from None
    with rt:
        child, auth = _quiet_child(rt, SCRIPTED)
        events = Events(rt, {"turn.ended"})
        _pool_steady(rt, 2)
        for _ in range(5):  # warm: the first turns import the driver in each slot's child
            mark = events.mark()
            rt.send(child, "warm", authority=auth)
            events.wait(mark, _on(child, "turn.ended"))
        while True:
            turns = []
            for _ in range(cfg.n(30, 100)):
                mark = events.mark()
                t0 = time.perf_counter_ns()
                rt.send(child, "hi", authority=auth)
                ended, _ev = events.wait(mark, _on(child, "turn.ended"))
                turns.append(ms_since(t0, ended))
            aborts = []
            for _ in range(cfg.n(15, 50)):
                tag = _procs.wedge_tag()
                rt.send(child, "wedge", data=escapee_wedge(tag), authority=auth)
                tree = _procs.find_tree(tag, WAIT)
                mark = events.mark()
                with _procs.DeathWatch(tree.pids(with_starter=True)) as watch:
                    t0 = time.perf_counter_ns()
                    rt.interrupt(child, authority=auth, kind="abort", reason="bench")
                    dead = watch.wait(WAIT)
                    ended, ev = events.wait(mark, _on(child, "turn.ended"))
                if ev.data["outcome"] != "aborted":
                    raise RuntimeError(f"the wedged turn ended {ev.data['outcome']}, not aborted")
                aborts.append(ms_since(t0, max(dead, ended)))
                _pool_steady(rt, 2)
            yield {"turn_ms": turns, "abort_ms": aborts}
