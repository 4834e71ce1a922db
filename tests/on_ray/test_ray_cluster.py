"""Issue 12 on a real two-node Ray cluster (``ray.cluster_utils.Cluster``): turns of one
host run on both nodes, and nothing of the host's outlives it on either.

Both nodes are processes of this machine (a head and a worker node, each with its own
raylet), so psutil sees every process on either. The cluster runs in its own process
(``ray_cluster`` in conftest.py) and so does the host (``ray_cluster_host.py``), since
this test process may be the driver of the session's own Ray already, and the second
test SIGKILLs the host. The host has two slots and no spare, each slot claiming the one
``tether_slot`` of a node: one slot per node, so a child's turn that starts while its
parent's turn runs can only run on the other node. The last test runs ``tether serve
--backend ray --ray-address`` on the cluster, as a user would.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from drivers import TESTS, alive, eventually, kill_token, ray_idle_worker, token_procs
from tether_server import TETHER, running_server

pytestmark = [pytest.mark.ray_cluster, pytest.mark.timeout(180)]

HOST = str(TESTS / "ray_cluster_host.py")


def _of_a_turn(p: psutil.Process, nodes: list[str]) -> bool:
    """Part of a turn's tree (its tag) or of a turn on one of ``nodes`` (a keeper)."""
    with contextlib.suppress(psutil.Error):
        env = p.environ()
        return "TETHER_TREE" in env or env.get("TETHER_NODE") in nodes
    return False


def leftovers(cluster: dict[str, Any], token: str | None = None) -> list[str]:
    """What of the host's is alive on either node: its slot and reaper actors, their
    turn children and every tool below them, anything carrying a turn tree's tag (an
    escapee) or naming one of the cluster's nodes (a keeper, which carries no tag), and
    the processes marked ``token`` in their command line."""
    daemons = set(cluster["daemons"])
    procs = psutil.Process(cluster["launcher"]).children(recursive=True)
    ours = [p for p in procs if p.pid not in daemons and alive(p) and not ray_idle_worker(p)]
    # and what left every tree (an escapee, a keeper)
    tagged = [p for p in psutil.process_iter() if _of_a_turn(p, cluster["nodes"]) and alive(p)]
    out = []
    marked = token_procs(token) if token is not None else []
    for p in {p.pid: p for p in [*ours, *marked, *tagged]}.values():
        with contextlib.suppress(psutil.Error):
            out.append(f"{p.pid}:{' '.join(p.cmdline())[:100]}")
    return out


@pytest.fixture
def host(ray_cluster: dict[str, Any]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The host process on the cluster, with the token of its escapees."""
    token = f"tether-cluster-{uuid.uuid4().hex}"
    # the token goes by the environment: in the host's own argv it would mark the host
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TOKEN": token}
    proc = subprocess.Popen(
        [sys.executable, HOST, ray_cluster["address"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield proc, token
    finally:
        proc.kill()
        proc.wait(10.0)
        kill_token(token)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def _started(proc: subprocess.Popen[str], cluster: dict[str, Any], token: str) -> dict[str, Any]:
    """The host's report once both turns run, one per node, each with its escapee tree."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the host exited with {proc.wait(10.0)} before both turns ran"
    info: dict[str, Any] = json.loads(line)
    # ESCAPEE is two processes (setsid, then fork) per tree, one tree per turn
    info["escapee_nodes"] = eventually(
        lambda: _nodes_of(token_procs(token)), timeout=30.0, what="both escapee trees"
    )
    return info


def _nodes_of(escapees: list[psutil.Process]) -> set[str | None] | None:
    """The nodes the four escapee processes run on (their TETHER_NODE), once all four
    exist and each has its environment (a process that has just forked may not yet)."""
    nodes: set[str | None] = set()
    for p in escapees:
        with contextlib.suppress(psutil.Error):
            nodes.add(p.environ().get("TETHER_NODE"))
    return nodes if len(escapees) == 4 and None not in nodes else None


def test_a_child_spawned_from_a_turn_on_one_node_runs_on_the_other_and_close_leaves_nothing(
    ray_cluster: dict[str, Any], host: tuple[subprocess.Popen[str], str]
) -> None:
    proc, token = host
    info = _started(proc, ray_cluster, token)
    nodes = set(ray_cluster["nodes"])
    assert info["root_node"] != info["child_node"]
    assert {info["root_node"], info["child_node"]} == nodes
    assert info["escapee_nodes"] == nodes  # each turn's tools ran on its own node

    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("close\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"closed": True}
    assert proc.wait(30.0) == 0
    # A keeper acts on its worker's death, so it may still be exiting as close() returns
    # (a CI run caught one mid-exit, its command line already gone); the other nodes'
    # keepers are not the host's children to wait for.
    eventually(
        lambda: leftovers(ray_cluster, token) == [] or None, timeout=2.0, what="nothing left"
    )


def test_a_host_sigkill_leaves_nothing_on_either_node_within_two_seconds(
    ray_cluster: dict[str, Any], host: tuple[subprocess.Popen[str], str]
) -> None:
    proc, token = host
    info = _started(proc, ray_cluster, token)
    assert {info["root_node"], info["child_node"]} == set(ray_cluster["nodes"])
    assert leftovers(ray_cluster, token)  # the slots, reapers, turn children and tools

    start = time.monotonic()
    proc.kill()
    proc.wait(5.0)
    eventually(
        lambda: not leftovers(ray_cluster, token),
        timeout=10.0,
        what="the host's processes on both nodes to die",
    )
    took = time.monotonic() - start
    assert took < 2.0, f"the host's processes took {took:.2f} s to die"


def test_tether_serve_on_the_cluster_runs_turns_there_and_keeps_its_stdout_clean(
    ray_cluster: dict[str, Any], tmp_path: Path
) -> None:
    where = json.dumps([{"op": "tool", "argv": ["sh", "-c", 'echo "node=$TETHER_NODE"']}])
    args = ("--backend", "ray", "--ray-address", ray_cluster["address"], "--workers", "2")
    with running_server(tmp_path, *args) as server:

        def cli(*argv: str) -> str:
            done = subprocess.run(
                [TETHER, *argv, "--url", server.url], capture_output=True, text=True, timeout=30
            )
            assert done.returncode == 0, (argv, done.stderr)
            return done.stdout.strip()

        root = cli("open", "--slug", "lead")
        child = cli("spawn", root, "--slug", "w", "--prompt", "where", "--steps", where)
        server.wait_state(child, "idle", timeout=30.0)
        node = cli("transcript", child).split("node=", 1)[1].split()[0]
        assert node in ray_cluster["nodes"]
    # Ray's own output went to stderr: stdout has the one line a script reads
    assert server.out_path.read_text().splitlines() == [
        f"tether: serving {server.url} (store {tmp_path / 'state.db'},"
        f" token in {tmp_path / 'token'})"
    ]
    eventually(lambda: not leftovers(ray_cluster), timeout=5.0, what="the server's actors")
