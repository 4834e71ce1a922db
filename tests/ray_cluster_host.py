"""A Tether host on a two-node Ray cluster, in its own process, for
``tests/on_ray/test_ray_cluster.py`` (run as a script).

Usage: ``TOKEN=... python ray_cluster_host.py ADDRESS``. Two slots and no spare, each slot
claiming the one ``tether_slot`` of a node, so each node has exactly one slot. A root
turn says which node it runs on, spawns a child that says the same of its own turn and
runs an escapee tree, then runs an escapee tree itself: both turns stay busy, one on
each node. Every escapee process carries TOKEN in its command line. Prints one JSON line
``{"host": pid, "root": ..., "child": ..., "root_node": ..., "child_node": ...}``, then
waits for a line on stdin: ``close`` closes the runtime and prints ``{"closed": true}``.
The test may SIGKILL it instead.
"""

from __future__ import annotations

import json
import os
import sys

import tether
from drivers import ESCAPEE, eventually

WHERE = {"op": "tool", "argv": ["sh", "-c", 'echo "node=$TETHER_NODE"']}


def _node(rt: tether.Runtime, session: str) -> str | None:
    for e in rt.transcript(session):
        if e.kind == "tool" and "node=" in e.text:
            return e.text.split("node=", 1)[1].split()[0]
    return None


def main() -> None:
    address, token = sys.argv[1], os.environ["TOKEN"]
    escape = {"op": "tool", "argv": [sys.executable, "-c", ESCAPEE, token]}
    rt = tether.Runtime(
        workers=2,
        grace=1.0,
        backend="ray",
        ray_address=address,
        ray_options={"slot_options": {"resources": {"tether_slot": 1}}, "spare": 0},
    )
    root = rt.open_session("tether:Scripted", slug="lead")
    kid = {"steps": [WHERE, escape]}
    rt.prompt(
        root,
        "lead",
        data={"steps": [WHERE, {"op": "spawn", "slug": "kid", "data": kid}, escape]},
    )
    child = eventually(
        lambda: next(iter(a.id for a in rt.list_agents(root, scope="children")), None),
        timeout=30.0,
        what="the child",
    )
    root_node = eventually(lambda: _node(rt, root), timeout=30.0, what="the root's node")
    child_node = eventually(lambda: _node(rt, child), timeout=30.0, what="the child's node")
    out = {
        "host": os.getpid(),
        "root": root,
        "child": child,
        "root_node": root_node,
        "child_node": child_node,
    }
    print(json.dumps(out), flush=True)
    if sys.stdin.readline().strip() == "close":
        rt.close()
        print(json.dumps({"closed": True}), flush=True)


if __name__ == "__main__":
    main()
