"""The model-facing tools: schemas that are valid JSON Schema, and a validating dispatcher."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from jsonschema import Draft202012Validator, ValidationError

import tether
from drivers import all_frozen, eventually, none_frozen, tree_of, worker_with_tool

NAMES = [
    "spawn_agent",
    "send_message",
    "list_agents",
    "interrupt_agent",
    "pause_agent",
    "resume_agent",
    "stop_report",
    "list_approvals",
    "decide_approval",
    "run_command",
    "budget",
]


def _results(rt: tether.Runtime, session: str) -> list[dict[str, Any]]:
    return [json.loads(e.text) for e in rt.transcript(session) if e.kind == "assistant"]


@pytest.mark.unit
@pytest.mark.parametrize("style", ["openai", "anthropic"])
def test_schemas_are_valid_json_schema(style: Literal["openai", "anthropic"]) -> None:
    tools = tether.tools.schemas(style)
    if style == "openai":
        assert all(t["type"] == "function" for t in tools)
        functions = [t["function"] for t in tools]
        params = [f["parameters"] for f in functions]
    else:
        functions = tools
        params = [t["input_schema"] for t in tools]
    assert [f["name"] for f in functions] == NAMES
    for fn, schema in zip(functions, params, strict=True):
        Draft202012Validator.check_schema(schema)
        assert fn["description"] and "\n" not in fn["description"]
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert "title" not in schema and "$ref" not in json.dumps(schema)
    by_name = {f["name"]: s for f, s in zip(functions, params, strict=True)}
    assert by_name["run_command"]["required"] == ["argv"]
    kinds = by_name["interrupt_agent"]["properties"]["kind"]["enum"]
    assert sorted(kinds) == ["abort", "cancel", "preempt", "steer"]
    # A model's well-formed arguments pass the very schema it was given.
    Draft202012Validator(by_name["spawn_agent"]).validate({"slug": "x", "prompt": "go"})
    for name in ("pause_agent", "resume_agent"):
        schema = by_name[name]
        assert schema["required"] == ["agent"]
        assert sorted(schema["properties"]["scope"]["enum"]) == ["session", "subtree"]
        Draft202012Validator(schema).validate({"agent": "kid", "scope": "subtree"})
        with pytest.raises(ValidationError):
            Draft202012Validator(schema).validate({"agent": "kid", "scope": "everything"})
        with pytest.raises(ValidationError):
            Draft202012Validator(schema).validate({"scope": "session"})
    assert "reason" in by_name["pause_agent"]["properties"]
    assert "reason" not in by_name["resume_agent"]["properties"]
    with pytest.raises(ValueError, match="style"):
        tether.tools.schemas("gemini")  # type: ignore[arg-type]


def test_call_tool_rejects_malformed_arguments_without_side_effect(rt: tether.Runtime) -> None:
    root = rt.open_session("drivers:ToolCaller")
    malformed: list[list[Any]] = [
        ["spawn_agent", '{"slug": "kid", '],  # truncated JSON
        ["spawn_agent", '["kid"]'],  # not an object
        ["spawn_agent", {"slug": 5}],  # wrong type
        ["spawn_agent", {"slug": "kid", "model": "big"}],  # unknown argument
        ["spawn_agent", {"slug": "kid", "mode": "forever"}],  # not in the enum
        ["send_message", {"to": "kid"}],  # missing text
        ["run_command", {"argv": "rm -rf /tmp/x"}],  # a string, not a list
        ["run_command", {"argv": []}],  # empty
        ["interrupt_agent", {"agent": "kid", "kind": "explode"}],
        ["delete_everything", {}],  # no such tool
    ]
    rt.prompt(root, "go", data={"calls": malformed})
    rt.wait(root, until="idle")
    results = _results(rt, root)
    assert [r["error"] for r in results] == ["invalid-params"] * 9 + ["unknown-tool"]
    assert all(r["message"] for r in results)
    assert "not valid JSON" in results[0]["message"]
    assert "$.slug" in results[2]["message"]
    assert "model" in results[3]["message"]
    assert "text" in results[5]["message"]
    assert rt.list_agents(root, scope="descendants") == []  # nothing was spawned

    # The same calls, well formed, do act; a refusal from the runtime comes back typed.
    good: list[list[Any]] = [
        ["spawn_agent", '{"slug": "kid", "prompt": null}'],  # null means "left out"
        ["list_agents", ""],  # no arguments at all
        ["send_message", {"to": "kid", "text": "hello", "wake": False}],
        ["interrupt_agent", {"agent": "s_nobody", "kind": "cancel"}],
    ]
    rt.prompt(root, "again", data={"calls": good})
    rt.wait(root, until="idle")
    spawned, listed, sent, refused = _results(rt, root)[len(malformed) :]
    kid = spawned["agent"]
    assert [a["id"] for a in listed["agents"]] == [kid]
    assert sent == {"sent": True, "message": sent["message"]}
    assert [m.id for m in rt.inbox(kid)] == [sent["message"]]
    assert refused["error"] in {"not-found", "subagent-unauthorized"}


@pytest.mark.timeout(60)
def test_a_drivers_pause_agent_call_freezes_its_child_and_resume_agent_thaws_it(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session("drivers:ToolCaller")
    # The child runs its parent's driver: its one call is a long command.
    sleep = {"calls": [["run_command", {"argv": ["sleep", "30"]}]]}
    rt.prompt(
        root,
        "spawn",
        data={"calls": [["spawn_agent", {"slug": "kid", "data": sleep, "prompt": "sleep"}]]},
    )
    rt.wait(root, until="idle")
    kid = _results(rt, root)[-1]["agent"]
    worker = worker_with_tool(rt, "sleep")
    procs = tree_of(worker)
    turn = rt.status(kid).turn

    rt.prompt(root, "pause", data={"calls": [["pause_agent", {"agent": "kid", "reason": "look"}]]})
    rt.wait(root, until="idle")
    assert _results(rt, root)[-1] == {"accepted": True, "turns": [turn]}
    assert rt.status(kid).state == "paused"
    eventually(lambda: all_frozen(procs), what="the child's processes stopped")
    [marker] = [e for e in rt.transcript(kid) if e.kind == "marker"]
    assert (marker.action, marker.origin, marker.by, marker.reason) == (
        "paused",
        "parent",
        root,
        "look",
    )

    rt.prompt(root, "resume", data={"calls": [["resume_agent", {"agent": "kid"}]]})
    rt.wait(root, until="idle")
    assert _results(rt, root)[-1] == {"accepted": True, "turns": [turn]}
    assert rt.status(kid).state == "running"
    eventually(lambda: none_frozen(procs), what="the processes thawed")
    rt.interrupt(kid, authority=tether.User(parent=root), kind="abort")
    rt.wait(kid)

    # Gated by the interrupt permission, like interrupt_agent.
    denied = rt.open_session("drivers:ToolCaller", permissions={"interrupt": "deny"})
    calls = [["pause_agent", {"agent": "kid"}], ["resume_agent", {"agent": "kid"}]]
    rt.prompt(denied, "try", data={"calls": calls})
    rt.wait(denied, until="idle")
    assert [r["error"] for r in _results(rt, denied)] == ["subagent-unauthorized"] * 2
