"""The turn table every backend shares, and the one tree walk both backends kill with.

The table's behaviour (queue, held signals, one report per turn, kill only once the tree
is dead) is what every interrupt, pause, fault and race test runs through, on both
backends; here: that both backends really do stand on it, and that the tree reaping
Ray's reaper actor does (``_procs.reap_tree``) holds on real processes without Ray.
"""

from __future__ import annotations

import ast
import contextlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from drivers import ROOT, eventually
from tether.contain.procs import TREE_ENV, alive, reap, reap_pass, reap_tree

SRC = ROOT / "src" / "tether" / "runtime"

# The root of a worker-like tree: a subreaper in its own session that starts a child in
# its group, and an escapee that leaves the session through a double fork (its parent
# exits, so it re-parents to the root). It prints their pids, then waits.
_ROOT = r"""
import ctypes, os, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
kids = []
pid = os.fork()
if pid == 0:
    time.sleep(600); os._exit(0)
kids.append(pid)
r, w = os.pipe()
mid = os.fork()
if mid == 0:
    os.setsid()
    esc = os.fork()
    if esc == 0:
        time.sleep(600); os._exit(0)
    os.write(w, str(esc).encode()); os._exit(0)
os.waitpid(mid, 0)
kids.append(int(os.read(r, 32)))
print(" ".join(map(str, kids)), flush=True)
time.sleep(600)
"""


def _tree(token: str) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    root = subprocess.Popen(
        [sys.executable, "-c", _ROOT],
        env={**os.environ, TREE_ENV: token},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert root.stdout is not None
    with root.stdout:
        kids = [psutil.Process(int(p)) for p in root.stdout.readline().split()]
    assert len(kids) == 2
    return root, kids


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.unit
def test_both_backends_run_their_turns_on_the_one_turn_table_and_ray_never_imports_the_pool() -> (
    None
):
    ray = _imports(SRC / "backends" / "ray.py")
    pool = _imports(SRC / "backends" / "pool.py")
    assert "tether.runtime.backends.pool" not in ray
    assert "tether.runtime.backends._turns" in ray
    assert "tether.runtime.backends._turns" in pool
    # and Ray's reaper actor kills with the walk the pool's reaper uses
    assert "tether.contain.procs" in _imports(SRC / "backends" / "_ray_actors.py")
    from tether.runtime.backends._turns import TableBackend
    from tether.runtime.backends.pool import Pool

    assert issubclass(Pool, TableBackend)


def test_reaping_a_living_tree_kills_the_escapee_that_left_its_session() -> None:
    token = secrets.token_hex(8)
    root, kids = _tree(token)
    try:
        assert os.getsid(kids[1].pid) != os.getsid(root.pid)  # it did escape the session
        assert reap_tree(root.pid, token, 5.0)
        root.wait(5.0)
        assert not any(alive(p) for p in kids)
    finally:
        root.kill()
        root.wait(5.0)
        reap(p.pid for p in kids)


@contextlib.contextmanager
def _dispersed(token: str) -> Iterator[tuple[subprocess.Popen[str], list[psutil.Process]]]:
    """A tree whose root died on its own (its orphans re-parented); what is left of it is
    killed at the end."""
    root, kids = _tree(token)
    try:
        root.kill()
        root.wait(5.0)
        eventually(lambda: all(p.ppid() != root.pid for p in kids), what="orphans re-parented")
        yield root, kids
    finally:
        for p in kids:
            if alive(p):
                p.send_signal(signal.SIGKILL)
        reap(p.pid for p in kids)


def test_reaping_a_tree_whose_root_died_finds_the_rest_by_its_tag() -> None:
    token = secrets.token_hex(8)
    with _dispersed(token) as (root, kids):
        assert all(alive(p) for p in kids)
        assert reap_tree(root.pid, token, 5.0)
        assert not any(alive(p) for p in kids)


def test_a_pass_from_a_root_that_died_meanwhile_proves_nothing() -> None:
    """The pool picks a worker's living root, then walks it: a root that died in between
    has handed its tree on, so an empty walk of it is no proof (it was taken for one: a
    turn ended crashed with the escapee of its worker's own SIGKILL still running)."""
    token = secrets.token_hex(8)
    with _dispersed(token) as (root, kids):
        assert not reap_pass(root.pid, group=root.pid, token=token, wait=0.0)
        assert alive(kids[1])  # the escapee, out of the group the pass kills too
        assert reap_tree(root.pid, token, 5.0)  # the unrooted pass finds them by their tag
        assert not any(alive(p) for p in kids)
