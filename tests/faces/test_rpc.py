"""JSON-RPC and SSE against a real ``tether serve`` on a loopback port."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

from drivers import HANG, all_frozen, none_frozen
from tether.serve.sse import EventHub
from tether_server import (
    TETHER,
    EventReader,
    LiveServer,
    rpc_address,
    rpc_error,
    running_server,
    wait_until,
)


def _tree(server: LiveServer) -> dict[str, str]:
    """root -> a (hangs) -> a1 (hangs); root -> b (idle)."""
    root = server.call("session.open", {"driver": "tether:Scripted", "slug": "root"})["session"]
    spawn = {"parent": root, "driver": "tether:Scripted"}
    a = server.call("subagent.spawn", {**spawn, "slug": "a", "prompt": "work", "data": HANG})
    b = server.call("subagent.spawn", {**spawn, "slug": "b"})
    a1 = server.call(
        "subagent.spawn",
        {**spawn, "parent": a["session"], "slug": "a1", "prompt": "work", "data": HANG},
    )
    ids = {"root": root, "a": a["session"], "b": b["session"], "a1": a1["session"]}
    server.wait_state(ids["a"], "running")
    server.wait_state(ids["a1"], "running")
    return ids


def test_interrupt_over_rpc_reaches_events(server: LiveServer) -> None:
    ids = _tree(server)
    agents = server.call("subagent.list", {"root": ids["root"], "scope": "descendants"})["agents"]
    assert [(x["slug"], x["depth"]) for x in agents] == [("a", 1), ("a1", 2), ("b", 1)]
    fields = {"id", "slug", "parent", "depth", "mode", "state", "pending", "stopping", "turn"}
    assert fields | {"dispatched"} <= set(agents[0])
    running = server.call("subagent.status", {"session": ids["a"]})
    assert running["turn"].startswith("t_") and running["dispatched"] is True
    with EventReader(server, session=ids["root"]) as events:
        assert events.status == 200
        answer = server.call(
            "subagent.interrupt",
            {
                "address": rpc_address(ids["a"], ids["root"]),
                "kind": "cancel",
                "reason": "stop <now>",
            },
        )
        assert answer == {"accepted": True, "turn": running["turn"]}
        marker = events.wait_for(
            lambda e: e["event"] == "marker" and e["data"]["session"] == ids["a"], what="marker"
        )
        entry = marker["data"]["data"]["entry"]
        assert entry["action"] == "cancelled" and entry["reason"] == "stop <now>"
        assert entry["turn"] == running["turn"]
        assert entry["text"].startswith("⊘ Cancelled by user")
        ended = events.wait_for(
            lambda e: e["event"] == "turn.ended" and e["data"]["session"] == ids["a"],
            what="turn.ended",
        )
        assert ended["data"]["data"]["outcome"] == "cancelled"
        assert ended["data"]["data"]["cause"] == "user"
        assert ended["id"] > marker["id"]
    # No cascade: the grandchild keeps running, and the records say what happened.
    assert server.call("subagent.status", {"session": ids["a1"]})["state"] == "running"
    turns = server.call("subagent.turns", {"session": ids["a"]})["turns"]
    assert turns[-1]["id"] == running["turn"]
    assert turns[-1]["outcome"] == "cancelled" and turns[-1]["reason"] == "stop <now>"
    entries = server.call("subagent.transcript", {"session": ids["a"]})["entries"]
    assert [e["kind"] for e in entries][:2] == ["user", "marker"]


def test_authority_and_schema_refusals(server: LiveServer) -> None:
    ids = _tree(server)
    interrupt = "subagent.interrupt"
    # The grandchild's durable parent is a, not root: a User address must name a.
    for parent in (ids["root"], "s_nobody"):
        answer = server.rpc(interrupt, {"address": rpc_address(ids["a1"], parent), "kind": "abort"})
        assert rpc_error(answer) == (-32000, "subagent-unauthorized")
    one_shot = {"address": rpc_address(ids["a"], ids["root"], "one-shot"), "kind": "cancel"}
    assert rpc_error(server.rpc(interrupt, one_shot)) == (-32602, "invalid-params")
    bad_kind = {"address": rpc_address(ids["a"], ids["root"]), "kind": "explode"}
    assert rpc_error(server.rpc(interrupt, bad_kind)) == (-32602, "invalid-params")
    empty_steer = {"address": rpc_address(ids["a"], ids["root"]), "kind": "steer", "reason": ""}
    assert rpc_error(server.rpc(interrupt, empty_steer)) == (-32602, "invalid-params")
    typo = {"address": rpc_address(ids["a"], ids["root"]), "knd": "cancel"}
    assert rpc_error(server.rpc(interrupt, typo)) == (-32602, "invalid-params")
    running = server.call("subagent.status", {"session": ids["a"]})["turn"]
    for bad_turn in (7, "", [running], {"id": running}, True, "t" * 257):
        guarded = {"address": rpc_address(ids["a"], ids["root"]), "kind": "abort", "turn": bad_turn}
        assert rpc_error(server.rpc(interrupt, guarded)) == (-32602, "invalid-params"), bad_turn
    for bad_inbox in ({}, {"session": 7}, {"session": ids["a"], "limit": 1}):
        assert rpc_error(server.rpc("subagent.inbox", bad_inbox)) == (-32602, "invalid-params")
    assert rpc_error(server.rpc("subagent.inbox", {"session": "s_nobody"})) == (-32000, "not-found")
    assert rpc_error(server.rpc("subagent.status", {"session": "s_nobody"})) == (
        -32000,
        "not-found",
    )
    # None of the refused calls touched the target.
    assert server.call("subagent.status", {"session": ids["a1"]})["state"] == "running"
    assert server.call("subagent.status", {"session": ids["a"]})["stopping"] is None


def test_interrupt_guard_never_stops_a_later_turn(server: LiveServer) -> None:
    ids = _tree(server)
    address = rpc_address(ids["a"], ids["root"])
    first = server.call("subagent.status", {"session": ids["a"]})["turn"]
    # A guard naming a turn that never ran here: an accepted no-op, the turn goes on.
    other = "t_" + "0" * 32
    answer = server.call("subagent.interrupt", {"address": address, "turn": other})
    assert answer == {"accepted": True, "turn": None}
    guarded = {"address": address, "kind": "cancel", "turn": first, "reason": "stop 1"}
    assert server.call("subagent.interrupt", guarded) == {"accepted": True, "turn": first}
    server.wait_state(ids["a"], "parked")
    # A waking send starts the next turn; a Stop still aimed at the first one misses it.
    server.call("subagent.send", {"address": address, "content": "again", "data": HANG})
    info = server.wait_state(ids["a"], "running")
    second = info["turn"]
    assert second != first
    for kind in ("cancel", "abort", "steer", "preempt"):
        stale = {"address": address, "kind": kind, "turn": first, "reason": "late click"}
        assert server.call("subagent.interrupt", stale) == {"accepted": True, "turn": None}
    info = server.call("subagent.status", {"session": ids["a"]})
    assert (info["state"], info["turn"], info["stopping"]) == ("running", second, None)
    turns = server.call("subagent.turns", {"session": ids["a"]})["turns"]
    assert [(t["id"], t["outcome"]) for t in turns] == [(first, "cancelled"), (second, None)]
    entries = server.call("subagent.transcript", {"session": ids["a"]})["entries"]
    assert [e["turn"] for e in entries if e["kind"] == "marker"] == [first]
    # An idle target: an accepted no-op too.
    idle = {"address": rpc_address(ids["b"], ids["root"]), "kind": "abort"}
    assert server.call("subagent.interrupt", idle) == {"accepted": True, "turn": None}


def test_a_malformed_turn_guard_is_invalid_params_and_stops_nothing(server: LiveServer) -> None:
    ids = _tree(server)
    address = rpc_address(ids["a"], ids["root"])
    turn = server.call("subagent.status", {"session": ids["a"]})["turn"]
    calls = [
        ("subagent.interrupt", {"address": address, "kind": "abort", "turn": "nope"}),
        ("subagent.interrupt", {"address": address, "kind": "cancel", "turn": "t_nope"}),
        ("subagent.interrupt", {"address": address, "kind": "abort", "turn": turn[2:]}),
        ("subagent.interrupt", {"address": address, "scope": "subtree", "turn": "nope"}),
        ("subagent.pause", {"address": address, "turn": "t_" + "0" * 31 + "g"}),
    ]
    for method, params in calls:
        answer = server.rpc(method, params)
        assert rpc_error(answer) == (-32602, "invalid-params"), (params, answer)
        assert "turn must be a turn id" in answer["error"]["message"]
    info = server.call("subagent.status", {"session": ids["a"]})
    assert (info["state"], info["turn"], info["stopping"]) == ("running", turn, None)
    assert server.call("subagent.status", {"session": ids["a1"]})["state"] == "running"


def test_a_stop_over_rpc_says_who_by_the_name_given_and_refuses_a_bad_one(
    server: LiveServer,
) -> None:
    ids = _tree(server)
    address = rpc_address(ids["a1"], ids["a"])  # a grandchild: its parent a is an agent
    for name in ("x" * 65, "eve\nmallory", "\x1b[2Jeve", 7):
        bad = {"address": address, "kind": "abort", "name": name}
        assert rpc_error(server.rpc("subagent.interrupt", bad)) == (-32602, "invalid-params"), name
    assert server.call("subagent.status", {"session": ids["a1"]})["stopping"] is None
    named = {"address": address, "kind": "cancel", "reason": "enough", "name": "alice"}
    turn = server.call("subagent.interrupt", named)["turn"]
    server.wait_state(ids["a1"], "parked")
    entries = server.call("subagent.transcript", {"session": ids["a1"]})["entries"]
    [marker] = [e for e in entries if e["kind"] == "marker"]
    assert (marker["origin"], marker["by"], marker["text"]) == (
        "user",
        "alice",
        "⊘ Cancelled by user alice: enough",
    )
    [ended] = server.call("subagent.turns", {"session": ids["a1"]})["turns"]
    assert (ended["id"], ended["cause"], ended["by"]) == (turn, "user", "alice")
    # No name: "by user", never the parent agent's id.
    server.call(
        "subagent.interrupt", {"address": rpc_address(ids["a"], ids["root"]), "kind": "abort"}
    )
    server.wait_state(ids["a"], "parked")
    entries = server.call("subagent.transcript", {"session": ids["a"]})["entries"]
    assert [e["text"] for e in entries if e["kind"] == "marker"] == ["⊘ Aborted by user"]


def test_a_turn_waiting_for_a_worker(server: LiveServer) -> None:
    ids = _tree(server)  # a and a1 hang on the server's two workers
    spawn = {"parent": ids["root"], "driver": "tether:Scripted", "prompt": "w", "data": HANG}
    c = server.call("subagent.spawn", {**spawn, "slug": "c"})["session"]
    info = server.wait_state(c, "running")
    assert info["dispatched"] is False and info["turn"].startswith("t_")
    listed = server.call("subagent.list", {"root": ids["root"]})["agents"]
    dispatched = [(x["slug"], x["dispatched"]) for x in listed]
    assert dispatched == [("a", True), ("b", False), ("c", False)]
    # Bound to the claimed turn even though no worker has it yet.
    abort = {"address": rpc_address(c, ids["root"]), "kind": "abort"}
    assert server.call("subagent.interrupt", abort) == {"accepted": True, "turn": info["turn"]}
    server.wait_state(c, "parked")
    turns = server.call("subagent.turns", {"session": c})["turns"]
    assert [(t["id"], t["outcome"]) for t in turns] == [(info["turn"], "aborted")]


def test_send_returns_the_message_id_and_inbox_lists_it(server: LiveServer) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    b = server.call("subagent.spawn", {"parent": root, "driver": "tether:Scripted"})["session"]
    ids = {"root": root, "b": b}
    address = rpc_address(ids["b"], ids["root"])
    assert server.call("subagent.inbox", {"session": ids["b"]}) == {"messages": []}
    sent = []
    for text in ("hi", "x" * 300):
        answer = server.call("subagent.send", {"address": address, "content": text, "wake": False})
        assert set(answer) == {"accepted", "message"} and answer["accepted"] is True
        assert answer["message"].startswith("m_")
        sent.append(answer["message"])
    assert len(set(sent)) == 2
    inbox = server.call("subagent.inbox", {"session": ids["b"]})["messages"]
    assert [(m["id"], m["kind"], m["preview"]) for m in inbox] == [
        (sent[0], "user", "hi"),
        (sent[1], "user", "x" * 200),
    ]
    assert all(m["sender"] and m["created_at"] > 0 for m in inbox)
    assert server.call("subagent.status", {"session": ids["b"]})["pending"] == 2
    # A waking send: the next turn claims the oldest, and its record names it.
    go = server.call("subagent.send", {"address": address, "content": "go"})["message"]
    server.wait_state(ids["b"], "idle")
    turns = server.call("subagent.turns", {"session": ids["b"]})["turns"]
    assert [t["message"] for t in turns] == [*sent, go]
    assert server.call("subagent.inbox", {"session": ids["b"]}) == {"messages": []}
    # session.prompt answers the message id too.
    prompt = server.call("session.prompt", {"session": ids["root"], "content": "hello"})
    assert set(prompt) == {"accepted", "message"} and prompt["message"].startswith("m_")


def test_send_needs_a_live_parent(server: LiveServer) -> None:
    ids = _tree(server)
    address = rpc_address(ids["b"], ids["root"])
    answer = server.call("subagent.send", {"address": address, "content": "hi", "wake": False})
    assert answer["accepted"] is True
    assert server.call("subagent.status", {"session": ids["b"]})["pending"] == 1
    server.call("session.release", {"session": ids["root"]})
    answer = server.rpc("subagent.send", {"address": address, "content": "again"})
    assert rpc_error(answer) == (-32000, "parent-offline")


def test_transcript_pages_with_after(server: LiveServer) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    says = [{"op": "say", "text": f"line {i}"} for i in range(5)]
    server.call("session.prompt", {"session": root, "content": "go", "data": {"steps": says}})
    server.wait_state(root, "idle")
    everything = server.call("subagent.transcript", {"session": root})["entries"]
    assert len(everything) == 6 and everything[0]["kind"] == "user"
    seen: list[dict[str, Any]] = []
    after = 0
    while True:
        page = server.call("subagent.transcript", {"session": root, "after": after, "limit": 2})
        seen += page["entries"]
        after = page["entries"][-1]["seq"]
        if not page["more"]:
            break
    assert seen == everything


def test_session_list_pages_the_roots_newest_first(server: LiveServer) -> None:
    opened = [
        server.call("session.open", {"driver": "tether:Scripted", "slug": f"r{i}"})["session"]
        for i in range(3)
    ]
    child = server.call("subagent.spawn", {"parent": opened[0], "driver": "tether:Scripted"})
    first = server.call("session.list", {"limit": 2})
    assert [r["id"] for r in first["roots"]] == opened[:0:-1] and first["more"] is True
    assert first["roots"][0]["slug"] == "r2" and first["roots"][0]["state"] == "idle"
    assert first["roots"][0]["depth"] == 0 and first["roots"][0]["parent"] is None
    # The next page starts after the last id seen: no root twice, none skipped, and a
    # subagent is never listed.
    seen: list[str] = [r["id"] for r in first["roots"]]
    before = seen[-1]
    while True:
        page = server.call("session.list", {"before": before, "limit": 2})
        seen += [r["id"] for r in page["roots"]]
        if not page["more"]:
            break
        before = seen[-1]
    assert seen[:3] == opened[::-1] and len(seen) == len(set(seen))
    assert child["session"] not in seen
    everything = server.call("session.list", {"limit": 1000})
    assert [r["id"] for r in everything["roots"]] == seen and everything["more"] is False
    # A root opened later comes first; the default page is the newest 100.
    newest = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    assert server.call("session.list")["roots"][0]["id"] == newest
    # A cursor that is no root is refused, as a limit out of range is.
    refused = server.rpc("session.list", {"before": child["session"]})
    assert rpc_error(refused) == (-32602, "invalid-params")
    assert rpc_error(server.rpc("session.list", {"before": "s_nobody"})) == (-32000, "not-found")
    assert rpc_error(server.rpc("session.list", {"limit": 0}))[1] == "invalid-params"
    assert rpc_error(server.rpc("session.list", {"limit": 1001}))[1] == "invalid-params"


def test_protocol_errors(server: LiveServer) -> None:
    unknown = server.rpc("subagent.explode", {})
    assert rpc_error(unknown) == (-32601, "not-found")
    # debug.fail exists only with fault injection on.
    assert rpc_error(server.rpc("debug.fail")) == (-32601, "not-found")

    status, body = server.request("POST", "/rpc", b'{"jsonrpc": "2.0", "method": ')
    assert status == 200 and rpc_error(json.loads(body)) == (-32700, "invalid-params")
    assert rpc_error(server.post({"id": 3, "method": "subagent.list"})) == (
        -32600,
        "invalid-params",
    )
    assert rpc_error(server.post([])) == (-32600, "invalid-params")
    params_array = {"jsonrpc": "2.0", "id": 4, "method": "subagent.status", "params": ["x"]}
    assert rpc_error(server.post(params_array)) == (-32602, "invalid-params")

    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    batch = [
        {"jsonrpc": "2.0", "id": "a", "method": "subagent.status", "params": {"session": root}},
        {"jsonrpc": "2.0", "method": "subagent.status", "params": {"session": root}},
        {"jsonrpc": "2.0", "id": "c", "method": "nope"},
        7,
    ]
    answers = server.post(batch)
    assert [a["id"] for a in answers] == ["a", "c", None]
    assert answers[0]["result"]["id"] == root
    assert rpc_error(answers[1]) == (-32601, "not-found")
    assert rpc_error(answers[2]) == (-32600, "invalid-params")
    only_notifications = [
        {"jsonrpc": "2.0", "method": "subagent.status", "params": {"session": root}}
    ]
    assert server.post(only_notifications) is None  # 204, no body

    status, body = server.request("POST", "/rpc", b"[" + b" " * (2 << 20) + b"]")
    assert status == 413, body
    assert server.call("subagent.status", {"session": root})["id"] == root  # still serving


def test_internal_error_carries_an_id_and_no_text(tmp_path: Path) -> None:
    with running_server(tmp_path, env={"TETHER_RPC_FAULT_INJECTION": "1"}) as server:
        answer = server.rpc("debug.fail")
        code, data_code = rpc_error(answer)
        assert (code, data_code) == (-32000, "internal")
        error_id = answer["error"]["data"]["error_id"]
        assert error_id.startswith("err_")
        assert "injected" not in json.dumps(answer) and "Traceback" not in json.dumps(answer)

        def logged() -> dict[str, Any] | None:
            for line in server.log_text().splitlines():
                if error_id in line:
                    record: dict[str, Any] = json.loads(line)
                    return record
            return None

        record = wait_until(logged, what="the error id in the host log")
        assert record["event"] == "rpc.internal_error" and record["error_id"] == error_id
        assert "injected" in json.dumps(record)  # the details live in the log, only there


def test_non_loopback_bind_without_token_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [TETHER, "serve", "--host", "0.0.0.0", "--port", "0", "--path", str(tmp_path / "s.db")],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "TETHER_TOKEN"},
    )
    assert done.returncode == 2
    assert "--token" in done.stderr
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("blank", ["", "   "])
def test_an_empty_or_blank_token_is_no_token(tmp_path: Path, blank: str) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "TETHER_TOKEN"}
    for how, env in ((["--token", blank], clean), ([], {**clean, "TETHER_TOKEN": blank})):
        far = subprocess.run(
            [
                TETHER,
                "serve",
                "--host",
                "0.0.0.0",
                "--port",
                "0",
                "--path",
                str(tmp_path / "f.db"),
                *how,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert far.returncode == 2 and "--token" in far.stderr  # not a token to bind with
    doc = b'{"jsonrpc": "2.0", "id": 1, "method": "subagent.status", "params": {"session": "x"}}'
    store = tmp_path / "store"
    store.mkdir()
    with running_server(store, "--token", blank) as server:
        made = (store / "token").read_text()
        assert server.token == made and len(made) >= 32  # one the server made, not the blank
        assert (store / "token").stat().st_mode & 0o777 == 0o600
        for sent in ("Bearer ", "Bearer    ", "Bearer", ""):
            headers = {"Authorization": sent} if sent else {}
            assert server.request("POST", "/rpc", doc, headers, auth=False)[0] == 401, sent
        assert rpc_error(server.rpc("subagent.status", {"session": "x"})) == (-32000, "not-found")
    with running_server(store, env={"TETHER_TOKEN": blank}) as again:
        assert again.token == made  # kept across a restart: its clients stay signed in


def test_token_is_required_when_set(tmp_path: Path) -> None:
    with running_server(tmp_path, "--token", "s3cret") as server:
        doc = (
            b'{"jsonrpc": "2.0", "id": 1, "method": "subagent.status", "params": {"session": "x"}}'
        )
        status, _ = server.request("POST", "/rpc", doc, auth=False)
        assert status == 401
        wrong = {"Authorization": "Bearer s3cres"}
        assert server.request("POST", "/rpc", doc, wrong, auth=False)[0] == 401
        assert server.request("GET", "/events", None, auth=False)[0] == 401
        assert rpc_error(server.rpc("subagent.status", {"session": "x"})) == (-32000, "not-found")


def test_a_page_of_another_origin_gets_nothing_without_the_token(server: LiveServer) -> None:
    # A rebinding page or a cross-site POST cannot know the token the server made.
    doc = b'{"jsonrpc": "2.0", "id": 1, "method": "subagent.status", "params": {"session": "x"}}'
    foreign = {"Host": "evil.example:7777", "Origin": "http://evil.example"}
    assert server.request("POST", "/rpc", doc, foreign, auth=False)[0] == 401
    assert server.request("GET", "/events", None, foreign, auth=False)[0] == 401
    same = {"Origin": "http://localhost:3000"}
    assert server.request("POST", "/rpc", doc, same, auth=False)[0] == 401
    assert server.request("POST", "/rpc", doc, same)[0] == 200


def test_event_stream_resumes_with_last_event_id(server: LiveServer) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    prompt = {"session": root, "content": "go", "data": {"steps": [{"op": "say", "text": "x"}]}}
    with EventReader(server, session=root) as reference:
        with EventReader(server, session=root) as first:
            server.call("session.prompt", prompt)
            first.nth("turn.ended", 1)
        got = list(first.events)
        # Two more turns while that client is away; then it resumes from its last id.
        server.call("session.prompt", prompt)
        server.call("session.prompt", prompt)
        final = reference.nth("turn.ended", 3)
        with EventReader(server, session=root, last_id=got[-1]["id"]) as resumed:
            resumed.wait_for(lambda e: e["id"] >= final["id"], what="the replay")
        got += resumed.events
    expected = [e for e in reference.events if e["id"] <= final["id"]]
    assert got[: len(expected)] == expected
    assert all(b["id"] > a["id"] for a, b in itertools.pairwise(got))


def test_event_filter_is_a_subtree(server: LiveServer) -> None:
    ids = _tree(server)
    with EventReader(server, session=ids["a"]) as sub:
        for target, parent in ((ids["b"], ids["root"]), (ids["a1"], ids["a"])):
            server.call(
                "subagent.interrupt", {"address": rpc_address(target, parent), "kind": "abort"}
            )
        sub.wait_for(
            lambda e: e["event"] == "turn.ended" and e["data"]["session"] == ids["a1"],
            what="a1's turn.ended",
        )
        sessions = {e["data"]["session"] for e in sub.events}
        assert sessions <= {ids["a"], ids["a1"]}
    status, _ = server.request("GET", "/events?session=s_nobody")
    assert status == 404


# ---- the event hub on its own: slow consumers and gaps ----------------------------------


def _publish(hub: EventHub, n: int) -> None:
    for i in range(n):
        hub.publish("state", "s_1", (), {"n": i}, 0.0)


def _frames(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        fields = dict(
            line.split(": ", 1) for line in chunk.decode().splitlines() if line and line[0] != ":"
        )
        if fields:
            out.append(
                {"event": fields["event"], "id": fields.get("id"), **json.loads(fields["data"])}
            )
    return out


def test_slow_consumer_is_dropped_with_a_final_event() -> None:
    async def scenario() -> list[dict[str, Any]]:
        hub = EventHub(history=100, client_limit=3)
        sub = hub.subscribe(None, None)
        stream = sub.stream()
        chunks = [await anext(stream)]  # the preamble
        _publish(hub, 1)
        chunks.append(await anext(stream))
        _publish(hub, 10)  # the client reads nothing meanwhile: over its limit of 3
        chunks += [chunk async for chunk in stream]
        _publish(hub, 1)  # a dropped client gets nothing more, and the hub goes on
        return _frames(chunks)

    frames = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [f["event"] for f in frames] == ["state", "closed"]
    assert frames[-1]["reason"] == "slow-consumer"
    assert frames[-1]["last_id"] == int(frames[0]["id"])  # where to resume from


def test_resume_from_an_evicted_id_reports_a_gap() -> None:
    async def scenario() -> list[dict[str, Any]]:
        hub = EventHub(history=4, client_limit=100)
        _publish(hub, 10)
        sub = hub.subscribe(None, hub.last_id - 8)  # 3 of the events it needs are gone
        hub.close()
        return _frames([chunk async for chunk in sub.stream()])

    frames = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [f["event"] for f in frames] == ["gap", "state", "state", "state", "state", "closed"]
    assert [f["data"]["n"] for f in frames[1:5]] == [6, 7, 8, 9]
    assert frames[-1]["reason"] == "shutdown"


def test_sigterm_drains_running_turns_and_leaves_no_process(tmp_path: Path) -> None:
    server = LiveServer(tmp_path).start()
    try:
        root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
        tool = {"steps": [{"op": "tool", "argv": ["sleep", "60"]}]}
        child = server.call(
            "subagent.spawn",
            {"parent": root, "driver": "tether:Scripted", "prompt": "go", "data": tool},
        )["session"]
        server_proc = psutil.Process(server.proc.pid if server.proc else 0)

        def sleeping() -> bool:
            return any(p.name() == "sleep" for p in server_proc.children(recursive=True))

        wait_until(sleeping, what="the tool subprocess")
    finally:
        assert server.stop() == 0, server.log_text()  # stop() also checks no process is left
    # The drain recorded how the turn ended: a restart finds nothing to call crashed.
    with running_server(tmp_path) as again:
        turns = again.call("subagent.turns", {"session": child})["turns"]
        assert turns[-1]["outcome"] in ("cancelled", "aborted"), turns


# ---- pause, resume and the stall policy (semantics §14.4, §14.5) ----------------------------


def _tool_tree(server: LiveServer) -> list[psutil.Process]:
    """The worker running a ``sleep`` tool, and its processes (a snapshot)."""
    assert server.proc is not None
    top = psutil.Process(server.proc.pid)

    def sleeping() -> psutil.Process | None:
        return next((p for p in top.children(recursive=True) if p.name() == "sleep"), None)

    worker = wait_until(sleeping, what="the sleep tool").parent()
    assert worker is not None
    return [worker, *worker.children(recursive=True)]


@pytest.mark.timeout(60)
def test_pause_over_rpc_freezes_the_tree_and_resume_thaws_it(server: LiveServer) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted", "slug": "root"})["session"]
    tool = {"steps": [{"op": "tool", "argv": ["sleep", "60"]}]}
    kid = server.call(
        "subagent.spawn",
        {"parent": root, "driver": "tether:Scripted", "prompt": "go", "data": tool},
    )["session"]
    procs = _tool_tree(server)
    turn = server.wait_state(kid, "running")["turn"]
    me = rpc_address(kid, root)

    # An idle target (the root) is an accepted no-op, and so is resuming what runs.
    idle = rpc_address(root, root)
    assert server.call("subagent.pause", {"address": idle}) == {"accepted": True, "turns": []}
    assert server.call("subagent.resume", {"address": me}) == {"accepted": True, "turns": []}
    # Authority as for an interrupt: the address's parent must be the target's parent.
    for method in ("subagent.pause", "subagent.resume"):
        for parent in (kid, "s_nobody"):
            answer = server.rpc(method, {"address": rpc_address(kid, parent)})
            assert rpc_error(answer) == (-32000, "subagent-unauthorized"), (method, parent)
        bad_scope = {"address": me, "scope": "everything"}
        assert rpc_error(server.rpc(method, bad_scope)) == (-32602, "invalid-params")
    one_shot = {"address": rpc_address(kid, root, "one-shot")}
    assert rpc_error(server.rpc("subagent.pause", one_shot)) == (-32602, "invalid-params")
    assert none_frozen(procs)

    with EventReader(server, session=root) as events:
        paused = server.call("subagent.pause", {"address": me, "reason": "let me <look>"})
        assert paused == {"accepted": True, "turns": [turn]}
        wait_until(lambda: all_frozen(procs), what="every process of the tree stopped")
        assert server.call("subagent.status", {"session": kid})["state"] == "paused"
        events.wait_for(
            lambda e: (
                e["event"] == "state"
                and e["data"]["session"] == kid
                and e["data"]["data"]["state"] == "paused"
            ),
            what="state paused",
        )
        marker = events.wait_for(
            lambda e: e["event"] == "marker" and e["data"]["session"] == kid, what="marker"
        )["data"]["data"]["entry"]
        assert (marker["action"], marker["reason"], marker["turn"]) == (
            "paused",
            "let me <look>",
            turn,
        )
        assert marker["text"].startswith("⏸ Paused by user: ")

        resumed = server.call("subagent.resume", {"address": me})
        assert resumed == {"accepted": True, "turns": [turn]}
        wait_until(lambda: none_frozen(procs), what="every process of the tree thawed")
        assert server.call("subagent.status", {"session": kid})["state"] == "running"
        events.nth("marker", 2)

    # A subtree pause from the root freezes the running child; a subtree resume thaws it.
    subtree = {"address": idle, "scope": "subtree"}
    assert server.call("subagent.pause", subtree) == {"accepted": True, "turns": [turn]}
    wait_until(lambda: all_frozen(procs), what="the subtree's processes stopped")
    assert server.call("subagent.resume", subtree) == {"accepted": True, "turns": [turn]}
    wait_until(lambda: none_frozen(procs), what="the subtree's processes thawed")
    assert server.call("subagent.interrupt", {"address": me, "kind": "abort"})["turn"] == turn
    server.wait_state(kid, "parked")
    actions = [
        e["action"]
        for e in server.call("subagent.transcript", {"session": kid})["entries"]
        if e["kind"] == "marker"
    ]
    assert actions == ["paused", "resumed", "paused", "resumed", "aborted"]


def _ended(events: EventReader, session: str) -> dict[str, Any]:
    found: dict[str, Any] = events.wait_for(
        lambda e: e["event"] == "turn.ended" and e["data"]["session"] == session,
        timeout=20.0,
        what=f"turn.ended of {session}",
    )["data"]["data"]
    return found


@pytest.mark.timeout(60)
def test_stall_on_open_and_spawn_aborts_a_stalled_turn_and_shows_on_events(
    server: LiveServer,
) -> None:
    policy = {"after": 0.4, "steps": ["abort"]}
    stalled = {"steps": [{"op": "sleep", "seconds": 30}]}
    with EventReader(server) as events:
        root = server.call("session.open", {"driver": "tether:Scripted", "stall": policy})
        root = root["session"]
        server.call("session.prompt", {"session": root, "content": "go", "data": stalled})
        ended = _ended(events, root)
        assert (ended["outcome"], ended["cause"], ended["by"]) == ("aborted", "system", "watchdog")

        plain = server.call("session.open", {"driver": "tether:Scripted"})["session"]
        spawn = {"parent": plain, "driver": "tether:Scripted", "prompt": "go", "data": stalled}
        kid = server.call("subagent.spawn", {**spawn, "stall": policy})["session"]
        ended = _ended(events, kid)
        assert (ended["outcome"], ended["cause"], ended["by"]) == ("aborted", "system", "watchdog")

        steps = [e["data"] for e in events.events if e["event"] == "watchdog.step"]
        assert [(s["session"], s["data"]["kind"]) for s in steps] == [
            (root, "abort"),
            (kid, "abort"),
        ]
        for step in steps:
            assert set(step["data"]) == {"turn", "step", "kind", "idle"}
            assert step["data"]["idle"] >= 0.4
    turns = server.call("subagent.turns", {"session": kid})["turns"]
    assert [(t["outcome"], t["by"]) for t in turns] == [("aborted", "watchdog")]


@pytest.mark.timeout(60)
def test_a_bad_stall_policy_is_invalid_params_and_creates_nothing(server: LiveServer) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    for bad in (
        "soon",
        [0.4],
        {},
        {"after": 0},
        {"after": -1},
        {"after": "soon"},
        {"after": 1, "steps": []},
        {"after": 1, "steps": ["explode"]},
        {"after": 1, "repeat": 1},
        {"after": 1, "nudge": " "},
        {"after": 1, "surprise": True},
    ):
        opened = server.rpc("session.open", {"driver": "tether:Scripted", "stall": bad})
        assert rpc_error(opened) == (-32602, "invalid-params"), bad
        spawn = {"parent": root, "driver": "tether:Scripted", "stall": bad}
        assert rpc_error(server.rpc("subagent.spawn", spawn)) == (-32602, "invalid-params"), bad
    assert server.call("subagent.list", {"root": root})["agents"] == []
