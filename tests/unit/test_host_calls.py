"""A worker's calls to its host, checked at the host's edge (``wire.tool_calls``): a
driver that hands its context the wrong thing gets a refusal that names it, for that call
alone, and its turn goes on."""

from __future__ import annotations

import pytest

import tether
from drivers import SCRIPTED, texts
from tether.wire.errors import InvalidParams
from tether.wire.tool_calls import HistoryCall, InterruptCall, SendCall, SpawnCall, host_call


@pytest.mark.unit
def test_a_call_is_typed_once_at_the_edge_and_a_left_out_value_takes_its_default() -> None:
    assert host_call("history", {}) == HistoryCall(after=0)
    assert host_call("send_message", {"to": "kid", "text": "hi", "wake": None}) == SendCall(
        to="kid", text="hi", wake=True
    )
    call = host_call("interrupt_agent", {"agent_id": "kid", "kind": None, "reason": None})
    assert call == InterruptCall(agent_id="kid", kind="cancel", reason="", scope="session")
    assert host_call("spawn_agent", {"prompt": "go"}) == SpawnCall(prompt="go")
    assert host_call("delete_everything", {}) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "args", "where"),
    [
        ("history", {"after": -1}, "$.after"),
        ("history", {"after": True}, "$.after"),  # a bool is no sequence number
        ("send_message", {"to": "kid", "text": 7}, "$.text"),
        ("send_message", {"to": "kid", "wake": "no"}, "$.wake"),  # was taken as True
        ("interrupt_agent", {"agent_id": "kid", "kind": "explode"}, "$.kind"),
        ("interrupt_agent", {"agent_id": "kid", "scope": "everyone"}, "$.scope"),
        ("pause_agent", {"agent_id": "kid", "scope": "tree"}, "$.scope"),
        ("list_agents", {"scope": "all"}, "$.scope"),
        ("spawn_agent", {"permissions": {"spawn": 1}}, "$.permissions"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_with_the_field_it_is_in(
    name: str, args: dict[str, object], where: str
) -> None:
    with pytest.raises(InvalidParams) as exc:
        host_call(name, args)
    assert exc.value.message.startswith(f"{name}: ")
    assert where in exc.value.message


def test_a_drivers_bad_call_is_refused_alone_and_its_turn_goes_on(rt: tether.Runtime) -> None:
    root = rt.open_session("drivers:HostCalls")
    kid = rt.spawn(root, SCRIPTED, slug="kid")
    calls = [
        ["interrupt_agent", {"agent_id": "kid", "scope": "everyone"}],  # was a session stop
        ["send_message", {"to": "kid", "text": "x", "wake": "no"}],  # was a waking send
        ["spawn_agent", {"driver": "tether:Scripted", "prompt": "go"}],
        ["no_such_tool", {}],
        ["send_message", {"to": "kid", "text": "after the refusals", "wake": False}],
    ]
    rt.prompt(root, "go", data={"calls": calls})
    rt.wait(root, until="idle")
    said = texts(rt, root, "assistant")
    assert said[0].startswith("invalid-params: interrupt_agent: ") and "$.scope" in said[0]
    assert said[1].startswith("invalid-params: send_message: ") and "$.wake" in said[1]
    assert said[2] == "invalid-params: a tool call cannot choose the child's driver"
    assert said[3] == "not-found: no tool named 'no_such_tool'"
    assert said[4].startswith("ok ")
    assert said[-1] == "done"
    # nothing the refused calls named happened: one message, the last call's, parked
    assert [m.preview for m in rt.inbox(kid)] == ["after the refusals"]
    assert rt.status(kid).state != "running"
