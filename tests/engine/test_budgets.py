"""Budgets (semantics §16.2): a governor for every tree, with real workers.

The model tests run ``tether.agents:ChatAgent`` against the model server, which reports
usage with every response; the others run ``drivers:Spender``, which reports usage with
``ctx.add_usage`` at each step, so that a test can steer the spending exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import tether
from drivers import SCRIPTED, TESTS, entries, eventually, steps
from tether import User
from tether.actors.budget import Governor, StateStep, Step, TurnStep
from tether.runtime.store import Store
from tether.testing import ModelServer
from tether.wire.budget import Budget

pytestmark = pytest.mark.timeout(90)

CHAT = "tether.agents:ChatAgent"
SPENDER = "drivers:Spender"
KEY_ENV = "TETHER_TEST_MODEL_KEY"
RESPONSE = 1000  # tokens in each of the model server's responses below


@pytest.fixture(scope="module", autouse=True)
def api_key() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, "sk-tether-test-budget")
        yield


@pytest.fixture(scope="module")
def server() -> Iterator[ModelServer]:
    with ModelServer(process=True, realtime=True) as s:
        # Each response calls a tool and asks for more: a loop that spends until stopped.
        s.script(
            "spend",
            [
                {
                    "tool_calls": [{"name": "run_command", "arguments": {"argv": ["true"]}}],
                    "usage": {"prompt_tokens": 900, "completion_tokens": 100},
                    # a model takes its time: the host's reports keep up even when loaded
                    "delay": 0.05,
                }
            ],
        )
        yield s


def _chat(server: ModelServer, script: str = "spend", **model: Any) -> dict[str, Any]:
    return {
        "model": {
            "base_url": server.url,
            "name": script,
            "api_key_env": KEY_ENV,
            "retries": 0,
            "timeout": 30,
            **model,
        },
        "tools": ["run_command"],
        "max_steps": 10_000,
    }


def _tokens(rt: tether.Runtime, sids: list[str]) -> int:
    """What the turn records of ``sids`` say was spent, in tokens."""
    total = 0
    for sid in sids:
        for turn in rt.turns(sid):
            usage = turn.usage or {}
            total += usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    return total


def _markers(rt: tether.Runtime, sid: str, action: str) -> list[tether.Entry]:
    return [e for e in entries(rt, sid, "marker") if e.action == action]


# ---- the hard limit ------------------------------------------------------------------


@pytest.mark.parametrize("on_hard", ["cancel", "abort", "pause"])
def test_a_tree_over_its_token_budget_has_every_running_turn_stopped_by_budget(
    server: ModelServer, on_hard: str
) -> None:
    limit = 20_000
    with tether.Runtime(workers=4, grace=2.0) as rt:
        cfg = _chat(server)
        root = rt.open_session(
            CHAT, config=cfg, budget={"tokens": limit, "on_hard": on_hard, "on_soft": "none"}
        )
        kids = [str(rt.spawn(root, CHAT, config=cfg, prompt="spend")) for _ in range(3)]
        rt.prompt(root, "spend")
        tree = [root, *kids]
        until = ("paused",) if on_hard == "pause" else ("parked",)
        for sid in tree:
            rt.wait(sid, until=until, timeout=30)
        status = rt.budget(root)
        assert status.state == "exhausted" and status.decided_by == root
        spent = int(status.spent["tokens"])
        # at most one response in flight per running turn past the limit
        assert limit <= spent <= limit + RESPONSE * len(tree)
        outcome = {"cancel": "cancelled", "abort": "aborted", "pause": None}[on_hard]
        action = {"cancel": "cancelled", "abort": "aborted", "pause": "paused"}[on_hard]
        for sid in tree:
            (turn,) = rt.turns(sid)
            assert turn.outcome == outcome
            if outcome is not None:
                assert (turn.cause, turn.by) == ("system", "budget")
            (marker,) = _markers(rt, sid, action)
            assert marker.origin == "budget" and marker.by == "budget"
            assert "of 20,000 tokens spent in" in marker.text
            report = rt.stop_report(turn.id)
            assert report is not None and report.origin == "budget"
            assert "tokens" in report.reason and "20,000" in report.reason
        if on_hard == "pause":
            rt.interrupt(root, authority=User(root), kind="abort", scope="subtree")
            for sid in tree:
                rt.wait(sid, until=("parked",), timeout=15)
        assert _tokens(rt, tree) == int(rt.budget(root).spent["tokens"])


def test_the_soft_step_reaches_the_next_model_request_as_a_steer_of_origin_budget_once(
    server: ModelServer,
) -> None:
    with tether.Runtime(workers=2) as rt:
        sid = rt.open_session(
            CHAT, config=_chat(server, "spend-soft"), budget={"tokens": 6_000, "soft": 0.5}
        )
        server.script(
            "spend-soft",
            [
                {
                    "tool_calls": [{"name": "run_command", "arguments": {"argv": ["true"]}}],
                    "usage": {"prompt_tokens": 900, "completion_tokens": 100},
                    # paced, so a loaded host's reports keep up with the requests: a stop
                    # that overtook the steer would discard it (semantics §5)
                    "delay": 0.1,
                }
            ],
        )
        rt.prompt(sid, "spend")
        rt.wait(sid, until="parked", timeout=30)
        want = '<steer origin="budget" by="budget">50% of 6,000 tokens spent in this tree; wrap up'
        sent = [r for r in server.requests_for("spend-soft") if want in str(r.body["messages"])]
        assert sent, "no model request carried the budget's steer"
        first = server.requests_for("spend-soft").index(sent[0])
        assert first >= 3  # sent once 3,000 tokens were spent, not before
        (steered,) = _markers(rt, sid, "steered")  # once per crossing
        assert steered.origin == "budget"
        (turn,) = rt.turns(sid)
        assert turn.outcome == "cancelled" and turn.by == "budget"


def test_a_cost_limit_acts_with_the_model_price(server: ModelServer) -> None:
    # 900 prompt tokens at $2 and 100 completion tokens at $10 per million: 2,800 µ$
    price = {"input_per_mtok": 2.0, "output_per_mtok": 10.0}
    with tether.Runtime(workers=2) as rt:
        sid = rt.open_session(
            CHAT, config=_chat(server, price=price), budget={"cost_usd": 0.01, "on_soft": "none"}
        )
        rt.prompt(sid, "spend")
        rt.wait(sid, until="parked", timeout=30)
        (turn,) = rt.turns(sid)
        assert turn.outcome == "cancelled" and turn.by == "budget"
        assert turn.usage is not None and turn.usage["cost_microusd"] % 2_800 == 0
        status = rt.budget(sid)
        assert status.spent["cost_usd"] == turn.usage["cost_microusd"] / 1e6
        assert 0.01 <= status.spent["cost_usd"] <= 0.01 + 0.0028
        assert "$0.01" in (turn.reason or "")


# ---- an exhausted tree ---------------------------------------------------------------


def test_an_exhausted_tree_parks_sends_refuses_spawns_and_runs_again_after_set_budget(
    rt: tether.Runtime,
) -> None:
    states: list[tuple[str, str]] = []
    rt.subscribe(
        lambda ev: states.append((ev.session, ev.data["state"])) if ev.name == "budget" else None
    )
    root = rt.open_session(SPENDER, budget={"tokens": 500, "on_soft": "none"})
    owner = User(root)
    rt.prompt(root, "spend", data={"tokens": 100, "steps": 20})
    rt.wait(root, until="parked", timeout=15)
    assert rt.budget(root).state == "exhausted"
    for text in ("first", "second"):
        rt.prompt(root, text, data={"tokens": 1, "steps": 1})
    info = rt.wait(root, until="parked", timeout=5)
    assert info.pending == 2 and len(rt.turns(root)) == 1  # accepted, parked: no turn
    with pytest.raises(tether.BudgetExhausted) as refused:
        rt.spawn(root, SPENDER, prompt="child")
    assert refused.value.code == "budget-exhausted"
    assert rt.list_agents(root) == []  # nothing recorded
    with pytest.raises(tether.Unauthorized):
        rt.set_budget(root, {"tokens": 10_000}, authority=User("someone-else"))
    rt.set_budget(root, {"tokens": 10_000}, authority=owner)
    assert rt.budget(root).state == "ok"
    assert states == [(root, "soft"), (root, "exhausted"), (root, "ok")]  # the console's bar
    assert rt.status(root).state == "parked"  # raised, but parked until a waking send
    rt.prompt(root, "third", data={"tokens": 1, "steps": 1})
    eventually(lambda: len(rt.turns(root)) == 4 or None, timeout=15, what="three turns")
    rt.wait(root, until="idle", timeout=15)
    claimed = [e.text for e in entries(rt, root, "user")]
    assert claimed == ["spend", "first", "second", "third"]  # oldest first
    assert [t.outcome for t in rt.turns(root)[1:]] == ["completed"] * 3


def test_a_child_budget_that_does_not_fit_what_its_ancestors_have_left_is_refused(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session(SPENDER, budget={"tokens": 1_000})
    with pytest.raises(tether.InvalidParams, match="does not fit"):
        rt.spawn(root, SPENDER, budget={"tokens": 2_000})
    rt.prompt(root, "spend", data={"tokens": 300, "steps": 2})
    rt.wait(root, until="idle", timeout=15)
    with pytest.raises(tether.InvalidParams, match="400 tokens"):
        rt.spawn(root, SPENDER, budget={"tokens": 500})
    assert rt.list_agents(root) == []  # nothing recorded
    child = str(rt.spawn(root, SPENDER, budget={"tokens": 400, "cost_usd": 5.0}))
    with pytest.raises(tether.InvalidParams, match="does not fit"):
        rt.spawn(child, SPENDER, budget={"tokens": 401})
    status = rt.budget(child)
    assert status.limits == {"tokens": 400, "cost_usd": 5.0}
    assert status.remaining == {"tokens": 400, "cost_usd": 5.0}
    for bad in ({}, {"tokens": 0}, {"tokens": 10, "soft": 0}, {"tokens": 10, "on_hard": "x"}):
        with pytest.raises(tether.InvalidParams):
            rt.spawn(root, SPENDER, budget=bad)


def test_a_turns_limit_parks_the_next_turn_and_stops_no_running_one(rt: tether.Runtime) -> None:
    root = rt.open_session(SCRIPTED, budget={"turns": 2})
    for text in ("one", "two", "three"):
        rt.prompt(root, text)
    eventually(lambda: rt.status(root).state == "parked" or None, what="parked")
    assert [t.outcome for t in rt.turns(root)] == ["completed", "completed"]
    status = rt.budget(root)
    assert status.spent["turns"] == 2 and status.state == "exhausted"
    assert rt.inbox(root)[0].preview == "three"


def test_a_turn_seconds_limit_cancels_running_turns_once_their_time_is_spent(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session(SCRIPTED, budget={"turn_seconds": 1.0, "on_soft": "none"})
    child = str(rt.spawn(root, SCRIPTED, prompt="hang", data=steps({"op": "hang"})))
    rt.prompt(root, "hang", data=steps({"op": "hang"}))
    for sid in (root, child):
        rt.wait(sid, until="parked", timeout=15)
        (turn,) = rt.turns(sid)
        assert turn.outcome == "cancelled" and turn.by == "budget"
        assert "of 1.0 turn seconds spent in" in (turn.reason or "")
    spent = rt.budget(root).spent["turn_seconds"]
    assert 1.0 <= spent < 3.0  # two turns ran in parallel: about half a second each


def test_a_budget_stop_and_a_watchdog_step_on_one_turn_are_one_stop(rt: tether.Runtime) -> None:
    """The first stop stands, and its report says which cause acted."""
    root = rt.open_session(
        SCRIPTED,
        stall={"after": 0.2, "steps": ["cancel"]},
        budget={"turn_seconds": 0.6, "on_soft": "none"},
    )
    rt.prompt(
        root, "stuck", data=steps({"op": "ignore_cancel"}, {"op": "tool", "argv": ["sleep", "30"]})
    )
    rt.wait(root, until="parked", timeout=15)
    (turn,) = rt.turns(root)
    assert turn.by == "watchdog" and turn.cause == "system"
    stops = [e for e in entries(rt, root, "marker") if e.action in ("cancelled", "aborted")]
    assert [(e.action, e.origin) for e in stops] == [("cancelled", "watchdog")]
    report = rt.stop_report(turn.id)
    assert report is not None and report.origin == "watchdog"


# ---- reading, and durability ---------------------------------------------------------


@pytest.mark.parametrize("said", [False, True], ids=["add_usage", "say_with_usage"])
def test_rt_budget_is_the_sum_of_the_subtree_recorded_usage(rt: tether.Runtime, said: bool) -> None:
    """Usage reported alone (``ctx.add_usage``) or with a reply (``ctx.say(...,
    usage=...)``) counts alike, in the budget and in each turn's record."""
    root = rt.open_session(SPENDER)
    child = str(rt.spawn(root, SPENDER, budget={"tokens": 100_000}))
    grandchild = str(rt.spawn(child, SPENDER))
    for sid, n in ((root, 3), (child, 4), (grandchild, 5)):
        if sid == root:
            rt.prompt(sid, "spend", data={"tokens": 7, "steps": n, "said": said})
        else:
            parent = root if sid == child else child
            data = {"tokens": 7, "steps": n, "said": said}
            rt.send(sid, "spend", authority=User(parent), data=data)
    for sid in (root, child, grandchild):
        rt.wait(sid, until="idle", timeout=15)
    assert rt.budget(root).spent["tokens"] == _tokens(rt, [root, child, grandchild]) == 84
    assert rt.budget(child).spent["tokens"] == _tokens(rt, [child, grandchild]) == 63
    status = rt.budget(grandchild)
    assert status.spent["tokens"] == 35 and status.spent["turns"] == 1
    assert status.limits == {} and status.state == "ok" and status.decided_by is None


_HOST = """
import sys, time
import tether
rt = tether.Runtime(sys.argv[1], workers=1)
root = rt.open_session("drivers:Spender", budget={"tokens": 100000})
child = rt.spawn(root, "drivers:Spender", prompt="spend", data={"tokens": 3, "steps": 2})
rt.wait(child, until="idle", timeout=20)
rt.prompt(root, "spend", data={"tokens": 5, "steps": 4})
rt.wait(root, until="idle", timeout=20)
rt.prompt(root, "spend again", data={"tokens": 11, "every": 0.05})
print(root, child, flush=True)
time.sleep(60)
"""


def test_spent_counters_are_the_same_after_a_host_restart_a_crashed_turn_included(
    db_path: str,
) -> None:
    tests = str(TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    host = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOST), db_path],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert host.stdout is not None
        root, child = host.stdout.readline().decode().split()

        def crashed_turn_spent() -> int | None:
            with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
                rows = db.execute(
                    "SELECT usage FROM turns WHERE outcome IS NULL AND usage IS NOT NULL"
                ).fetchall()
            return len(rows) or None

        eventually(crashed_turn_spent, timeout=20, what="the running turn's usage stored")
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
        if host.stdout is not None:
            host.stdout.close()
    with tether.Runtime(db_path, workers=1) as rt:
        turns = rt.turns(root)
        assert [t.outcome for t in turns][:1] == ["completed"]  # then the notice's turn
        crashed = [t for t in turns if t.outcome == "crashed"]
        assert crashed and crashed[0].usage is not None
        assert crashed[0].usage["prompt_tokens"] >= 11
        status = rt.budget(root)
        assert status.spent["tokens"] == _tokens(rt, [root, child]) >= 6 + 20 + 11
        assert status.spent["turns"] == len(turns) + 1 and status.limits == {"tokens": 100000}
    with tether.Runtime(db_path, workers=1) as rt:
        assert rt.budget(root).spent == status.spent  # and the same again


# ---- the governor under load ---------------------------------------------------------


STATE = "state"  # a flat step's kind for a tree's state change


def _flat(step: Step) -> tuple[str, str, str, str]:
    """(session, turn, kind, text) of a governor's step; a state change is ("", STATE)."""
    match step:
        case TurnStep(session=session, turn=turn, kind=kind, text=text):
            return session, turn, kind, text
        case StateStep(session=session, state=state):
            return session, "", STATE, state


def _race(store: Store, attempt: int) -> None:
    stopped: dict[str, int] = {}
    crossings: set[str] = set()
    lock = threading.Lock()

    def act(it: Step) -> None:
        step = _flat(it)
        if step[2] == STATE:
            return  # the tree's state, for observers
        with lock:
            stopped[step[1]] = stopped.get(step[1], 0) + 1
            crossings.add(step[3].split(" spent in ")[0])

    gov = Governor(store=store, act=act, subtree=lambda sid: [])
    root = f"s_root{attempt}"
    limit, delta, n = 10_000, 37, 20
    gov.admit(root, (), Budget(tokens=limit, on_soft="none"))
    turns = []
    for i in range(n):
        sid, turn = f"s_{attempt}_{i}", f"t_{attempt}_{i}"
        assert gov.start(sid, (root,), turn)
        turns.append((sid, turn))
    go = threading.Barrier(n)

    def spend(sid: str, turn: str) -> None:
        go.wait()
        while turn not in stopped:
            gov.usage(sid, turn, {"prompt_tokens": delta})

    threads = [threading.Thread(target=spend, args=t) for t in turns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert stopped == {turn: 1 for _, turn in turns}
    (crossing,) = crossings  # one crossing, seen by one report
    at = int(crossing.split(" of ")[0].replace(",", ""))
    assert limit <= at < limit + delta
    assert gov.status(root, ()).spent["tokens"] >= at
    assert not gov.start(f"s_late{attempt}", (root,), f"t_late{attempt}")


def test_hundreds_of_usage_reports_at_once_never_pass_the_bound_nor_stop_a_turn_twice() -> None:
    """Twenty sessions' turns report usage at once from their own threads, each going on
    until a stop reaches it (as a worker stops at its next boundary): the crossing is
    decided once, by the one report that made it (so the spent it names passes the limit
    by less than one report), and every turn is stopped once."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    store = Store()
    try:
        for attempt in range(30):
            _race(store, attempt)
    finally:
        sys.setswitchinterval(old)
        store.close()


def test_each_threshold_acts_on_the_report_that_reaches_it_however_far_below_the_rest() -> None:
    """The governor skips the walk of a tree's limits while its spent is below every
    threshold still to cross: the step still comes with the report that reaches it
    (tokens, cost, turns), never one report late, and a budget changed meanwhile
    (a lowered limit) is acted on at once."""
    steps: list[tuple[str, str, str, str]] = []
    store = Store()
    gov = Governor(store=store, act=lambda step: steps.append(_flat(step)), subtree=lambda sid: [])
    try:
        budget = Budget(tokens=1000, cost_usd=0.001, turns=3, soft=0.5, on_hard="cancel")
        gov.admit("s_r", (), budget)
        assert gov.start("s_r", (), "t_1")

        def taken(*delta: tuple[str, int]) -> list[tuple[str, str]]:
            mark = len(steps)
            gov.usage("s_r", "t_1", dict(delta))
            return [(kind, text) for _, _, kind, text in steps[mark:]]

        assert taken(("prompt_tokens", 499)) == []
        assert taken(("completion_tokens", 1)) == [
            (STATE, "soft"),
            ("steer", "50% of 1,000 tokens spent in this tree; wrap up"),
        ]
        assert taken(("cost_microusd", 499)) == []
        assert taken(("cost_microusd", 1))[0] == (STATE, "soft")  # cost's own soft step
        assert taken(("prompt_tokens", 499)) == []
        stop = taken(("prompt_tokens", 1))
        assert stop[0] == (STATE, "exhausted") and stop[1][0] == "cancel"
        assert stop[1][1].startswith("1,000 of 1,000 tokens")
        assert gov.status("s_r", ()).state == "exhausted"
        gov.ended("t_1")

        # raised: ok again; the turns limit acts at the start that reaches it
        gov.set_budget("s_r", (), Budget(tokens=10**6, cost_usd=1.0, turns=3, soft=0.5))
        assert gov.status("s_r", ()).state == "ok"
        mark = len(steps)
        assert gov.start("s_r", (), "t_2")  # 2 of 3 turns: past the soft half
        assert [(t, k) for _, t, k, _ in steps[mark:]] == [("", STATE), ("t_2", "steer")]
        assert gov.start("s_r", (), "t_3")
        assert not gov.start("s_r", (), "t_4")  # the third turn reached the limit
        # lowered to what was spent: exhausted at once, the running turns stopped
        gov.set_budget("s_r", (), Budget(tokens=10**6, turns=10, soft=0.5))
        mark = len(steps)
        gov.set_budget("s_r", (), Budget(tokens=1000, turns=10, soft=0.5))
        stopped = sorted(t for _, t, kind, _ in steps[mark:] if kind == "cancel")
        assert stopped == ["t_2", "t_3"]
    finally:
        store.close()


def test_the_model_tool_budget_tells_an_agent_what_its_tree_has_left(server: ModelServer) -> None:
    server.script(
        "ask-budget",
        [
            {
                "tool_calls": [{"name": "budget", "arguments": {}}],
                "usage": {"prompt_tokens": 90, "completion_tokens": 10},
            },
            {"text": "noted", "usage": {"prompt_tokens": 1, "completion_tokens": 1}},
        ],
    )
    with tether.Runtime(workers=2) as rt:
        cfg = {**_chat(server, "ask-budget"), "tools": ["budget"]}
        root = rt.open_session(SPENDER, budget={"tokens": 5_000})
        child = str(rt.spawn(root, CHAT, config=cfg, budget={"tokens": 2_000}, prompt="how much?"))
        rt.wait(child, until="idle", timeout=30)
        second = server.requests_for("ask-budget")[-1]
        (result,) = [m for m in second.body["messages"] if m.get("role") == "tool"]
        told = json.loads(result["content"])["budget"]
        assert told["state"] == "ok"
        assert told["left"] == {"tokens": 1_900}  # the tightest: the child's own
        assert told["spent"]["tokens"] == 100
