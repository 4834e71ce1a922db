"""OpenTelemetry traces (semantics §16.3) against a real OTLP/HTTP receiver on loopback.

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
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tether
from drivers import HANG, SCRIPTED, Recorder, family, local_pool, worker_with_tool
from otlp_receiver import OtlpReceiver, Receiver, Span
from tether import User
from tether.testing import ModelServer

pytestmark = pytest.mark.timeout(90)

CHAT = "tether.agents:ChatAgent"
THREADS = "telemetry_drivers:Threads"
PROMPT = "a prompt nobody may read in a trace"
KEY_ENV = "TETHER_TEST_TRACE_KEY"
SECRET = "sk-tether-trace-0123456789abcdef"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture
def traced(receiver: Receiver) -> Iterator[tether.Runtime]:
    with tether.Runtime(workers=2, grace=1.0, telemetry={"endpoint": receiver.url}) as rt:
        yield rt


def _config(
    server: ModelServer, script: str, tools: list[str], key: str | None = None
) -> dict[str, Any]:
    model = {"base_url": server.url, "name": script, "retries": 0, "timeout": 30}
    if key is not None:
        model["api_key_env"] = key
    return {"model": model, "system": "You are a traced agent.", "tools": tools}


def _agent(
    rt: tether.Runtime,
    server: ModelServer,
    script: str,
    replies: list[dict[str, Any]],
    tools: list[str],
    key: str | None = None,
) -> tuple[str, str, User]:
    server.script(script, replies)
    return family(
        rt, CHAT, root_driver=SCRIPTED, slug="agent", config=_config(server, script, tools, key)
    )


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


def test_a_chat_agent_turn_with_a_tool_call_is_one_trace_with_its_spawned_childs_turn_below_it(
    traced: tether.Runtime, receiver: Receiver, server: ModelServer
) -> None:
    rt = traced
    rec = Recorder(rt)
    replies: list[dict[str, Any]] = [
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
    assert top.resource["tether.process"] == "worker"  # the worker makes a turn's span
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
    # no content was asked for: no prompt, system prompt or reply in any attribute
    for s in receiver.spans:
        flat = json.dumps(s.attrs)
        assert PROMPT not in flat and "traced agent" not in flat and "done" not in flat


def _linked(control: Span, turn: Span) -> bool:
    return (turn.trace_id, turn.span_id) in control.links


def test_a_cancel_ends_the_turn_and_its_cut_request_as_cancelled_and_its_control_span_lands(
    traced: tether.Runtime, receiver: Receiver, server: ModelServer
) -> None:
    rt = traced
    rec = Recorder(rt)
    _root, agent, me = _agent(
        rt, server, "traced-cancel", [{"text": "thinking " * 50, "chunk": 4, "hang": True}], []
    )
    rt.send(agent, "go", authority=me)
    server.wait_requests(1, script="traced-cancel", timeout=30.0)
    server.wait_for(lambda s: s.requests_for("traced-cancel")[0].hanging, what="the hang")
    turn = rt.interrupt(agent, authority=me, kind="cancel", reason="enough of that")
    assert rec.turn_ended(agent, timeout=30.0)["outcome"] == "cancelled"
    assert turn is not None
    span = _turn_span(receiver, turn)
    assert span.error and span.attrs["error.type"] == "cancelled"
    assert span.description == "enough of that"
    assert span.attrs["tether.outcome"] == "cancelled"
    chat = receiver.wait(
        lambda spans: next((s for s in spans if s.name == "chat traced-cancel"), None),
        what="the cut request's span",
    )
    assert chat.parent == span.span_id
    assert chat.error and chat.attrs["error.type"] == "cancelled"
    assert chat.description == "enough of that"
    control = _control(receiver, "cancel", agent)
    assert _linked(control, span)
    assert control.attrs["tether.control.verb"] == "cancel"
    assert control.attrs["tether.control.origin"] == "user"
    assert control.attrs["tether.control.by"] == "user"  # a person with no name
    assert control.attrs["tether.control.expected_turn"] == turn
    assert control.attrs["tether.control.outcome"] == "landed"
    report = rt.stop_report(turn)
    assert report is not None
    assert control.attrs["tether.control.latency_ms"] == report.latency_ms
    assert control.attrs["tether.control.report"] == turn


def test_an_abort_ends_the_turn_as_aborted_and_its_control_span_lands_with_the_kill(
    traced: tether.Runtime, receiver: Receiver
) -> None:
    rt = traced
    rec = Recorder(rt)
    root = rt.open_session(SCRIPTED, slug="boss")
    child = rt.spawn(root, SCRIPTED, slug="stuck", prompt="hang", data=HANG)
    me = User(parent=root)
    rec.wait_for(lambda e: e.name == "turn.started" and e.session == child, timeout=30.0)
    turn = rt.interrupt(child, authority=me, kind="abort", reason="kill it")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "aborted"
    assert turn is not None
    span = _turn_span(receiver, turn)
    assert span.name == "invoke_agent stuck"
    assert span.error and span.attrs["error.type"] == "aborted"
    assert span.description == "kill it"
    control = _control(receiver, "abort", child)
    assert _linked(control, span)
    assert control.parent == span.span_id  # no caller's context: inside the turn it stops
    assert control.attrs["tether.control.outcome"] == "landed"
    report = rt.stop_report(turn)
    assert report is not None and report.latency_ms is not None
    assert control.attrs["tether.control.latency_ms"] == report.latency_ms


# test_interrupts holds an abort to this without telemetry (its tree dead, the turn ended)
ABORT_BOUND = 2.0


def test_an_abort_sigkills_the_worker_without_waiting_for_an_export_and_the_host_sends_the_turn_span(  # noqa: E501
    receiver: Receiver, server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's batch processor exports its finished spans every 0.1 s while the turn
    # is wedged in its command (the SDK's own variable, inherited by the workers).
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    wedge = {"argv": ["sh", "-c", "echo started; sleep 30"]}
    replies = [{"tool_calls": [{"name": "run_command", "arguments": wedge, "id": "call_wedge"}]}]
    with tether.Runtime(workers=2, grace=1.0, telemetry={"endpoint": receiver.url}) as rt:
        rec = Recorder(rt)
        _root, agent, me = _agent(rt, server, "traced-abort", replies, ["run_command"])
        rt.send(agent, "wedge", authority=me)
        # The chat span first (its wait is the receiver's, 20 s): a fresh worker's first
        # traced turn loads the SDK and the agent, seconds under load; the sleep follows.
        chat = receiver.wait(
            lambda spans: next((s for s in spans if s.name == "chat traced-abort"), None),
            what="the wedged turn's exported chat span",
        )
        worker = worker_with_tool(rt, "sleep")
        start = time.monotonic()
        turn = rt.interrupt(agent, authority=me, kind="abort", reason="kill it")
        ended = rec.turn_ended(agent, timeout=ABORT_BOUND)
        elapsed = time.monotonic() - start
        assert turn is not None
        report = rt.stop_report(turn)
    assert ended["outcome"] == "aborted"
    assert elapsed < ABORT_BOUND, "the abort waited for the worker's export"
    assert report is not None and report.latency_ms is not None
    assert report.latency_ms < ABORT_BOUND * 1000
    if report.via is not None:  # the worker itself was SIGKILLed, not asked to go
        [fate] = [p for p in report.processes if p.pid == worker.pid]
        assert (fate.signal, fate.fate) == ("SIGKILL", "dead")
    # The worker never ended the turn's span: the host made it, with the worker's ids.
    span = receiver.turn(turn)
    assert span.resource["tether.process"] == "host"
    assert span.name == "invoke_agent agent"
    assert span.error and span.attrs["error.type"] == "aborted"
    assert span.description == "kill it" and span.attrs["tether.outcome"] == "aborted"
    assert (chat.trace_id, chat.parent) == (span.trace_id, span.span_id)
    assert chat.resource["tether.process"] == "worker" and not chat.error
    assert len([s for s in receiver.spans if s.span_id == span.span_id]) == 1


def test_a_preempt_ends_the_cut_tool_call_as_preempted_and_the_turn_goes_on(
    traced: tether.Runtime, receiver: Receiver, server: ModelServer
) -> None:
    rt = traced
    rec = Recorder(rt)
    hung = {"argv": ["sh", "-c", "echo started; sleep 30"]}
    replies: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "run_command", "arguments": hung, "id": "call_hung"}]},
        {"text": "moving on"},
    ]
    _root, agent, me = _agent(rt, server, "traced-preempt", replies, ["run_command"])
    rt.send(agent, "run it", authority=me)
    server.wait_requests(1, script="traced-preempt", timeout=30.0)
    worker_with_tool(rt, "sleep")
    turn = rt.interrupt(agent, authority=me, kind="preempt", reason="too slow")
    assert rec.turn_ended(agent, timeout=30.0)["outcome"] == "completed"
    assert turn is not None
    span = _turn_span(receiver, turn)
    assert not span.error and span.attrs["tether.outcome"] == "completed"
    tool = receiver.wait(
        lambda spans: next((s for s in spans if s.name == "execute_tool run_command"), None),
        what="the preempted call's span",
    )
    assert tool.parent == span.span_id
    assert tool.attrs["gen_ai.tool.call.id"] == "call_hung"
    assert tool.error and tool.attrs["error.type"] == "preempted"
    assert tool.description == "too slow"
    control = _control(receiver, "preempt", agent)
    assert _linked(control, span)
    assert control.attrs["tether.control.outcome"] == "landed"
    assert control.attrs["tether.control.latency_ms"] > 0
    assert control.attrs["tether.control.report"] == turn


def test_a_budget_stop_ends_the_turn_as_budget_and_its_control_span_says_budget(
    traced: tether.Runtime, receiver: Receiver, server: ModelServer
) -> None:
    rt = traced
    rec = Recorder(rt)
    call = {"name": "run_command", "arguments": {"argv": ["true"]}}
    spend = {"prompt_tokens": 900, "completion_tokens": 100}
    replies: list[dict[str, Any]] = [
        {"tool_calls": [call], "usage": spend},
        {"text": "more " * 40, "hang": True},
    ]
    server.script("traced-budget", replies)
    root = rt.open_session(SCRIPTED)
    config = _config(server, "traced-budget", ["run_command"])
    agent = rt.spawn(root, CHAT, slug="agent", config=config, budget={"tokens": 500})
    rt.send(agent, "spend", authority=User(parent=root))
    ended = rec.turn_ended(agent, timeout=30.0)
    assert ended["outcome"] == "cancelled" and ended["by"] == "budget"
    [turn] = rt.turns(agent)
    span = _turn_span(receiver, turn.id)
    assert span.error and span.attrs["error.type"] == "budget"
    assert "of 500 tokens spent" in span.description
    control = _control(receiver, "cancel", agent)
    assert _linked(control, span)
    assert control.attrs["tether.control.origin"] == "budget"
    assert control.attrs["tether.control.by"] == "budget"
    assert control.attrs["tether.control.outcome"] == "landed"


def test_pause_and_resume_are_events_on_the_turn_and_a_refused_stop_is_a_refused_control(
    traced: tether.Runtime, receiver: Receiver
) -> None:
    rt = traced
    rec = Recorder(rt)
    root = rt.open_session(SCRIPTED)
    child = rt.spawn(root, SCRIPTED, prompt="hang", data=HANG)
    me = User(parent=root)
    rec.wait_for(lambda e: e.name == "turn.started" and e.session == child, timeout=30.0)
    [turn] = rt.pause(child, authority=me, reason="hold on")
    assert rt.resume(child, authority=me) == [turn]
    with pytest.raises(tether.Unauthorized):
        rt.interrupt(child, authority=User(parent="s_nobody"), kind="cancel")
    rt.interrupt(child, authority=me, kind="cancel", reason="done")
    assert rec.turn_ended(child, timeout=30.0)["outcome"] == "cancelled"
    span = _turn_span(receiver, turn)
    assert [name for name, _ in span.events] == ["paused", "resumed"]
    assert span.events[0][1]["tether.control.reason"] == "hold on"
    for verb in ("pause", "resume"):
        control = _control(receiver, verb, child)
        assert _linked(control, span) and control.attrs["tether.control.outcome"] == "landed"
    refused = receiver.wait(
        lambda spans: next(
            (s for s in spans if s.attrs.get("tether.control.outcome") == "refused"), None
        ),
        what="the refused control",
    )
    assert refused.name == "tether.control cancel" and refused.error
    # a no-op: a steer of a session with no running turn
    rt.interrupt(child, authority=me, kind="steer", reason="anyone?")
    noop = receiver.wait(
        lambda spans: next((s for s in spans if s.name == "tether.control steer"), None),
        what="the no-op steer",
    )
    assert noop.attrs["tether.control.outcome"] == "no-op"
    assert "tether.control.latency_ms" not in noop.attrs


def test_a_control_that_finds_no_turn_running_joins_the_sessions_last_trace_or_none(
    traced: tether.Runtime, receiver: Receiver
) -> None:
    # Phoenix lists traces: a no-op must not be a trace of one span of its own.
    rt = traced
    rec = Recorder(rt)
    root = rt.open_session(SCRIPTED)
    me = User(parent=root)
    ran = rt.spawn(root, SCRIPTED, prompt="hello")
    fresh = rt.spawn(root, SCRIPTED)  # never ran a turn: no trace to join
    assert isinstance(ran, str) and isinstance(fresh, str)
    span = _turn_span(receiver, rec.turn_ended(ran, timeout=30.0)["turn"])
    rt.interrupt(fresh, authority=me, kind="cancel", reason="nothing runs")
    rt.interrupt(ran, authority=me, kind="cancel", reason="idle now")
    noop = _control(receiver, "cancel", ran)
    assert noop.attrs["tether.control.outcome"] == "no-op"
    assert (noop.trace_id, noop.parent) == (span.trace_id, span.span_id)
    assert _linked(noop, span)
    assert noop.attrs["openinference.span.kind"] == "CHAIN"
    # The host exports its spans in the order they ended: the first no-op's would be in.
    assert not [s for s in receiver.spans if s.attrs.get("tether.control.target") == fresh]
    turns = {s.trace_id for s in receiver.named("invoke_agent")}
    assert {s.trace_id for s in receiver.named("tether.control")} <= turns


def _below(top: Span, count: int) -> Callable[[list[Span]], list[Span] | None]:
    """A wait for ``count`` spans (at least) whose parent is ``top``."""

    def found(spans: list[Span]) -> list[Span] | None:
        children = [s for s in spans if s.parent == top.span_id]
        return children if len(children) >= count else None

    return found


def test_phoenix_lists_a_turns_prompt_and_reply_only_when_content_is_on(
    receiver: Receiver, server: ModelServer
) -> None:
    reply = "the model's own reply"
    call = {"name": "run_command", "arguments": {"argv": ["true"]}, "id": "call_true"}
    replies: list[dict[str, Any]] = [{"tool_calls": [call]}, {"text": reply}]
    for content in (True, False):
        settings = {"endpoint": receiver.url, "content": content}
        with tether.Runtime(workers=1, grace=1.0, telemetry=settings) as rt:
            rec = Recorder(rt)
            script = f"phoenix-{content}"
            _root, agent, me = _agent(rt, server, script, replies, ["run_command"])
            rt.send(agent, PROMPT, authority=me)
            turn = rec.turn_ended(agent, timeout=60.0)["turn"]
            span = _turn_span(receiver, turn)
            ours = receiver.wait(_below(span, 3), what="the turn's chat and tool spans")
        if content:
            assert span.attrs["input.value"] == PROMPT
            assert span.attrs["output.value"] == reply
        else:
            assert "input.value" not in span.attrs and "output.value" not in span.attrs
        # the kind Phoenix draws each span's icon from
        assert span.attrs["openinference.span.kind"] == "AGENT"
        kinds = {s.name: s.attrs.get("openinference.span.kind") for s in ours}
        assert kinds == {f"chat {script}": "LLM", "execute_tool run_command": "TOOL"}, kinds


def test_a_turn_prompted_inside_a_callers_span_is_that_spans_child(
    traced: tether.Runtime, receiver: Receiver
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import use_span

    rt = traced
    rec = Recorder(rt)
    mine = TracerProvider().get_tracer("caller")  # the caller's own SDK, not exporting
    root = rt.open_session(SCRIPTED, slug="caller-root")
    caller = mine.start_span("my request")
    with use_span(caller, end_on_exit=True):
        rt.prompt(root, "hello")
    turn = rec.turn_ended(root, timeout=30.0)["turn"]
    span = _turn_span(receiver, turn)
    ctx = caller.get_span_context()
    assert span.trace_id == f"{ctx.trace_id:032x}"
    assert span.parent == f"{ctx.span_id:016x}"
    # and one prompted outside any span starts a trace of its own
    rt.prompt(root, "again")
    second = _turn_span(receiver, rec.turn_ended(root, count=2, timeout=30.0)["turn"])
    assert second.parent == "" and second.trace_id != span.trace_id


def test_content_is_recorded_only_when_asked_for(receiver: Receiver, server: ModelServer) -> None:
    server.script("traced-content", [{"text": "the model's own reply"}])
    settings = {"endpoint": receiver.url, "content": True}
    with tether.Runtime(workers=1, grace=1.0, telemetry=settings) as rt:
        rec = Recorder(rt)
        _root, agent, me = _agent(
            rt, server, "traced-content", [{"text": "the model's own reply"}], []
        )
        rt.send(agent, PROMPT, authority=me)
        turn = rec.turn_ended(agent, timeout=60.0)["turn"]
        span = _turn_span(receiver, turn)
    assert PROMPT in span.attrs["gen_ai.input.messages"]
    assert "the model's own reply" in span.attrs["gen_ai.output.messages"]
    chat = _one(receiver.named("chat"), "chat traced-content")
    assert PROMPT in chat.attrs["gen_ai.input.messages"]
    assert "You are a traced agent." in chat.attrs["gen_ai.system_instructions"]
    assert "the model's own reply" in chat.attrs["gen_ai.output.messages"]
    for span in receiver.spans:
        assert SECRET not in json.dumps([span.attrs, span.resource, span.events])


def _launcher_maps_protobuf(rt: tether.Runtime) -> bool:
    """The pool's launcher has the protobuf runtime's extension mapped (the OTLP
    exporter's encoder): what it imported, as the OS sees it."""
    pid = local_pool(rt).launcher.pid
    assert pid is not None
    with open(f"/proc/{pid}/maps") as f:
        return "_upb" in f.read()


def test_without_telemetry_nothing_is_imported_exported_or_threaded_in_host_or_worker(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host: a process of its own, so that nothing this test process imported counts.
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    code = f"""
import json, sys, threading, tether
with tether.Runtime(workers=1) as rt:
    root = rt.open_session({THREADS!r})
    rt.prompt(root, "go")
    rt.wait(root, timeout=30.0)
    worker = json.loads(rt.transcript(root)[-1].text)
    host = {{
        "threads": sorted(t.name for t in threading.enumerate()),
        "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
    }}
print(json.dumps({{"host": host, "worker": worker}}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    for where in ("host", "worker"):
        assert seen[where]["otel"] == [], where
        assert not [t for t in seen[where]["threads"] if "otel" in t.lower()], where
    # Off beats the environment: with the endpoint set and telemetry=False, nothing goes.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    with tether.Runtime(workers=1, telemetry=False) as rt:
        root = rt.open_session(SCRIPTED)
        rt.prompt(root, "hello")
        rt.wait(root, timeout=30.0)
        assert not [t for t in threading.enumerate() if t.name.startswith("OtelBatch")]
        assert not _launcher_maps_protobuf(rt)
    # and with it left to the environment, the same turn is traced, from the endpoint
    with tether.Runtime(workers=1) as rt:
        root = rt.open_session(THREADS)
        rt.prompt(root, "go")
        rt.wait(root, timeout=30.0)
        worker = json.loads(rt.transcript(root)[-1].text)
        [turn] = rt.turns(root)
        _turn_span(receiver, turn.id)
        # its workers' launcher loaded the SDK's exporter before forking them (they share
        # it), and started no thread: each worker makes its own provider and thread
        launcher = local_pool(rt).launcher.pid
        assert _launcher_maps_protobuf(rt)
        assert os.listdir(f"/proc/{launcher}/task") == [str(launcher)]
    assert "tether-otel-export" in worker["threads"]  # the worker's one exporter thread
    assert not [t for t in worker["threads"] if t.startswith("OtelBatch")]
    assert receiver.requests >= 1
    assert all(s.attrs.get("tether.turn.id") != "" for s in receiver.spans)


def test_a_stream_of_quick_traced_turns_shares_exports_rather_than_one_request_per_turn(
    receiver: Receiver,
) -> None:
    # Each turn's end asks its worker for an export; asks made while one runs, or within
    # the gap after it, share the next. (The SDK's own flush exports until its queue is
    # empty: under a stream of turns, request after request of a few spans each.)
    from tether.telemetry._provider import _FLUSH_GAP

    turns, sessions = 600, 8  # queued on 8 sessions: the worker takes one after another
    with tether.Runtime(workers=1, telemetry={"endpoint": receiver.url}) as rt:
        roots = [rt.open_session(SCRIPTED) for _ in range(sessions)]
        rt.prompt(roots[0], "warm up")  # the worker loads the SDK and connects
        rt.wait(roots[0], timeout=30.0)
        [first] = rt.turns(roots[0])
        _turn_span(receiver, first.id)
        before, start = receiver.requests, time.monotonic()
        for i in range(turns):
            rt.prompt(roots[i % sessions], f"quick {i}")
        for root in roots:
            rt.wait(root, timeout=60.0)
        receiver.wait(
            lambda spans: len([s for s in spans if s.name.startswith("invoke_agent")]) > turns,
            what=f"{turns} more turn spans",
        )
        elapsed = time.monotonic() - start
        made = receiver.requests - before
    # at most one export per gap, and the one that covers the last turn's end
    assert made <= elapsed / _FLUSH_GAP + 2, (made, elapsed)
