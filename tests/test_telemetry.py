"""OpenTelemetry traces (SPEC §16.3) against a real OTLP/HTTP receiver on loopback.

The spans are exported by the real SDK from the host and from the workers, and decoded
by the receiver (``otlp_receiver``) with the official protobuf definitions. Agents are
``tether.agents:ChatAgent`` against the scripted model server over real HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import tether
from drivers import HANG, SCRIPTED, Recorder, entries, eventually, steps, worker_with_tool
from otlp_receiver import OtlpReceiver, Receiver, Span
from tether import User
from tether.testing import ModelServer

pytestmark = pytest.mark.timeout(90)

CHAT = "tether.agents:ChatAgent"
THREADS = "telemetry_drivers:Threads"
PROMPT = "a prompt nobody may read in a trace"


@pytest.fixture(scope="module")
def server() -> Iterator[ModelServer]:
    with ModelServer(process=True, realtime=True) as s:
        yield s


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture
def traced(receiver: Receiver) -> Iterator[tether.Runtime]:
    with tether.Runtime(workers=2, grace=1.0, telemetry={"endpoint": receiver.url}) as rt:
        yield rt


def _config(server: ModelServer, script: str, tools: list[str]) -> dict[str, Any]:
    model = {"base_url": server.url, "name": script, "retries": 0, "timeout": 30}
    return {"model": model, "system": "You are a traced agent.", "tools": tools}


def _agent(
    rt: tether.Runtime,
    server: ModelServer,
    script: str,
    replies: list[dict[str, Any]],
    tools: list[str],
) -> tuple[str, str, User]:
    server.script(script, replies)
    root = rt.open_session(SCRIPTED)
    child = rt.spawn(root, CHAT, slug="agent", config=_config(server, script, tools))
    assert isinstance(child, str)
    return root, child, User(parent=root)


def _one(spans: list[Span], name: str, **attrs: Any) -> Span:
    found = [
        s for s in spans if s.name == name and all(s.attrs.get(k) == v for k, v in attrs.items())
    ]
    assert len(found) == 1, (name, attrs, [(s.name, s.attrs) for s in spans])
    return found[0]


def _turn_span(receiver: Receiver, turn: str) -> Span:
    def find(spans: list[Span]) -> Span | None:
        return next(
            (
                s
                for s in spans
                if s.name.startswith("invoke_agent") and s.attrs.get("tether.turn.id") == turn
            ),
            None,
        )

    found: Span = receiver.wait(find, what=f"the span of turn {turn}")
    return found


def _control(receiver: Receiver, verb: str, target: str) -> Span:
    def find(spans: list[Span]) -> Span | None:
        return next(
            (
                s
                for s in spans
                if s.name == f"tether.control {verb}"
                and s.attrs.get("tether.control.target") == target
            ),
            None,
        )

    found: Span = receiver.wait(find, what=f"the {verb} span of {target}")
    return found


def test_a_chat_agent_turn_with_a_tool_call_is_one_trace_and_its_spawned_childs_turn_is_below_the_call(
    traced: tether.Runtime, receiver: Receiver, server: ModelServer
) -> None:
    rt = traced
    rec = Recorder(rt)
    replies = [
        {
            "tool_calls": [
                {
                    "name": "spawn_agent",
                    "arguments": {"slug": "helper", "prompt": "help"},
                    "id": "call_spawn",
                }
            ]
        },
        {"text": "done"},
    ]
    root, agent, me = _agent(rt, server, "traced-spawn", replies, ["spawn_agent"])
    rt.send(agent, PROMPT, authority=me)
    assert rec.turn_ended(agent, timeout=60.0)["outcome"] == "completed"
    [helper] = rt.list_agents(agent)
    assert rec.turn_ended(helper.id, timeout=60.0)["outcome"] == "completed"
    turn = rt.turns(agent)[0]
    [child_turn] = rt.turns(helper.id)

    top = _turn_span(receiver, turn.id)
    below = _turn_span(receiver, child_turn.id)
    assert top.name == "invoke_agent agent"
    assert top.attrs["gen_ai.operation.name"] == "invoke_agent"
    assert top.attrs["gen_ai.agent.name"] == "agent"
    assert top.attrs["gen_ai.agent.id"] == agent
    assert top.attrs["gen_ai.conversation.id"] == root
    assert top.attrs["tether.outcome"] == "completed"
    assert not top.error
    assert top.resource["tether.process"] == "host"
    assert below.attrs["gen_ai.agent.name"] == "helper"
    assert below.attrs["gen_ai.conversation.id"] == root

    def trace_complete(spans: list[Span]) -> bool:
        ours = [s for s in spans if s.trace_id == top.trace_id]
        return sum(s.name == "chat traced-spawn" for s in ours) >= 3 and any(
            s.name == "execute_tool spawn_agent" for s in ours
        )

    receiver.wait(trace_complete, what="the workers' chat and execute_tool spans")
    spans = [s for s in receiver.spans if s.trace_id == top.trace_id]
    tool = _one(spans, "execute_tool spawn_agent")
    assert tool.attrs["gen_ai.operation.name"] == "execute_tool"
    assert tool.attrs["gen_ai.tool.name"] == "spawn_agent"
    assert tool.attrs["gen_ai.tool.call.id"] == "call_spawn"
    assert tool.parent == top.span_id
    assert tool.resource["tether.process"] == "worker"
    chats = [s for s in spans if s.name == "chat traced-spawn" and s.parent == top.span_id]
    assert len(chats) == 2
    for chat in chats:
        assert chat.attrs["gen_ai.operation.name"] == "chat"
        assert chat.attrs["gen_ai.provider.name"] == "openai"
        assert chat.attrs["gen_ai.request.model"] == "traced-spawn"
        assert chat.attrs["gen_ai.usage.input_tokens"] > 0
        assert chat.attrs["gen_ai.usage.output_tokens"] > 0
        assert chat.attrs["gen_ai.response.finish_reasons"] in (["tool_calls"], ["stop"])
        assert not chat.error
    # the child's turn: in the same trace, a descendant of the spawn call
    assert below.trace_id == top.trace_id
    assert tool in receiver.ancestors(below)
    # the helper's end notice woke the agent again: that turn follows the helper's
    after = _turn_span(
        receiver,
        rec.wait_for(
            lambda e: e.name == "turn.ended" and e.session == agent, count=2, timeout=60.0
        )[1].data["turn"],
    )
    assert after.trace_id == top.trace_id and below in receiver.ancestors(after)
    # no content was asked for: no prompt, reply or tool argument in any attribute
    for s in receiver.spans:
        flat = json.dumps(s.attrs)
        assert (
            PROMPT not in flat
            and "You are a traced agent" not in flat
            and "helper" not in flat.replace('"helper"', "")
        )
