"""Containment (semantics §15.5): how a turn's processes are held, killed, frozen and
limited, by the host (a cgroup v2 leaf per worker, or the process-tree walk) and inside
a worker (its tools' tree). It stands on nothing of ours but the wire's records, so the
worker, the agent kit and the adapters use it as the host does.

- ``procs``: the process tree: walk, freeze, kill, reap, the tree tag.
- ``cgroup``: a host's cgroup v2 group and its workers' leaves.
- ``guard``: the script that kills a dead host's leaves.
- ``hooks``: the pool's kill and freeze, by cgroup or by walk, and what each did.
- ``limits``: a turn that reaches its pids limit ends there.
- ``prctl``: the subreaper and parent-death signal.
"""
