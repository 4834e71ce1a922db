"""Budgets from outside (semantics §16.2): RPC ``budget`` params, ``subagent.budget`` and
``subagent.setBudget``, ``tether budget`` and ``--budget``, and the agent tools
(``spawn_agent``'s ``budget``, the model tool ``budget``)."""

from __future__ import annotations

import json

import pytest

import tether
from drivers import SCRIPTED, entries, eventually, steps
from tether_server import LiveServer, tether_cli

pytestmark = pytest.mark.timeout(90)


def test_rpc_opens_reads_and_raises_a_budget(server: LiveServer) -> None:
    root = server.call(
        "session.open", {"driver": SCRIPTED, "budget": {"turns": 1, "on_soft": "none"}}
    )["session"]
    for text in ("one", "two"):
        server.call("session.prompt", {"session": root, "content": text})
    server.wait_state(root, "parked")
    status = server.call("subagent.budget", {"session": root})["budget"]
    assert status["state"] == "exhausted" and status["decided_by"] == root
    assert status["limits"] == {"turns": 1} and status["spent"]["turns"] == 1
    refused = server.rpc("subagent.spawn", {"parent": root, "driver": SCRIPTED, "prompt": "x"})
    assert refused["error"]["data"]["code"] == "budget-exhausted"
    bad = server.rpc("subagent.spawn", {"parent": root, "driver": SCRIPTED, "budget": {}})
    assert bad["error"]["data"]["code"] in ("invalid-params", "budget-exhausted")
    for wrong in ({"turns": 0}, {"tokens": 5, "on_hard": "explode"}, {"tokens": 5, "x": 1}):
        answer = server.rpc("session.open", {"driver": SCRIPTED, "budget": wrong})
        assert answer["error"]["data"]["code"] == "invalid-params", wrong
    address = {"session": root, "parent": root}
    stranger = {"session": root, "parent": "s_nobody"}
    denied = server.rpc("subagent.setBudget", {"address": stranger, "budget": {"turns": 9}})
    assert denied["error"]["data"]["code"] == "subagent-unauthorized"
    accepted = server.call("subagent.setBudget", {"address": address, "budget": {"turns": 3}})
    assert accepted == {"accepted": True}
    assert server.call("subagent.budget", {"session": root})["budget"]["state"] == "ok"
    server.call("session.prompt", {"session": root, "content": "three"})  # the waking send
    eventually(
        lambda: len(server.call("subagent.turns", {"session": root})["turns"]) == 3 or None,
        timeout=15,
        what="the parked message and the new one ran",
    )


def test_the_cli_sets_and_shows_a_budget(server: LiveServer) -> None:
    opened = tether_cli(server, "open", "--budget", "turns=1,on_soft=none")
    assert opened.returncode == 0, opened.stderr
    root = opened.stdout.strip()
    assert tether_cli(server, "prompt", root, "one").returncode == 0
    server.wait_state(root, "idle")
    shown = tether_cli(server, "budget", root)
    assert shown.returncode == 0, shown.stderr
    assert f"budget of {root}: exhausted" in shown.stdout
    assert "1 of 1 turns" in shown.stdout
    spawned = tether_cli(server, "spawn", root, "--prompt", "hi")
    assert spawned.returncode == 1 and "budget-exhausted" in spawned.stderr
    raised = tether_cli(server, "budget", root, "--set", "turns=10,tokens=5000", "--json")
    assert raised.returncode == 0, raised.stderr
    status = json.loads(raised.stdout)["budget"]
    assert status["state"] == "ok" and status["limits"] == {"tokens": 5000, "turns": 10}
    wrong = tether_cli(server, "open", "--budget", "tokens=lots")
    assert wrong.returncode == 2 and "tokens" in wrong.stderr


def test_an_agent_spawns_a_child_with_a_budget_only_where_it_fits(rt: tether.Runtime) -> None:
    root = rt.open_session(SCRIPTED, budget={"tokens": 1_000})
    rt.prompt(
        root,
        "spawn",
        data=steps(
            {"op": "spawn", "slug": "small", "budget": {"tokens": 400}},
            {"op": "spawn", "slug": "big", "budget": {"tokens": 4_000}},
        ),
    )
    rt.wait(root, until="idle", timeout=15)
    tools = [e.text for e in entries(rt, root, "tool")]
    assert tools[0].startswith("spawned s_")
    assert tools[1].startswith("spawn_agent failed: invalid-params") and "fit" in tools[1]
    (child,) = rt.list_agents(root)
    assert child.slug == "small"
    assert rt.budget(child.id).limits == {"tokens": 400}
