"""A two-node Ray cluster (``ray.cluster_utils.Cluster``) in its own process, for
``tests/on_ray/test_ray_cluster.py`` (run as a script).

Kept out of the test process, which may already be the driver of the test session's own
Ray. Each node has one CPU and one unit of the custom resource ``tether_slot``. Prints
one JSON line once both nodes are up: ``{"address": ..., "nodes": [head, worker],
"daemons": [pids]}`` (node ids as Ray gives them to a worker; the daemons are every
process of the cluster at that moment). Runs until its stdin closes, then shuts the
cluster down and exits.
"""

from __future__ import annotations

import json
import os
import sys

import psutil
from ray.cluster_utils import Cluster

SLOT = {"tether_slot": 1}


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Ray prints to stdout: only our one line goes there
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 1, "resources": SLOT, "include_dashboard": False},
    )
    try:
        worker = cluster.add_node(num_cpus=1, resources=SLOT)
        cluster.wait_for_nodes()
        assert cluster.head_node is not None
        daemons = [p.pid for p in psutil.Process().children(recursive=True)]
        out.write(
            json.dumps(
                {
                    "address": cluster.address,
                    "nodes": [cluster.head_node.node_id, worker.node_id],
                    "daemons": daemons,
                }
            )
            + "\n"
        )
        out.flush()
        sys.stdin.read()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
