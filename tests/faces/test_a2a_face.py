"""The A2A face, driven by the official ``a2a-sdk`` client against ``tether serve``."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import pytest
from a2a.client import Client, ClientConfig, create_client
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import (
    ContentTypeNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
)
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.struct_pb2 import Struct, Value

from drivers import eventually
from tether_server import LiveServer, await_until, running_server, shared_server, wait_until

pytestmark = pytest.mark.timeout(90)

T = TypeVar("T")
HANG = [{"op": "hang"}]
_ids = iter(range(1, 1 << 30))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with shared_server(tmp_path_factory.mktemp("a2a"), "--cancel-deadline", "2") as live:
        yield live


@asynccontextmanager
async def a2a(
    server: LiveServer, *, streaming: bool = False, token: str | None = None
) -> AsyncIterator[Client]:
    token = token or server.token  # the server's own, made or given, unless another
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=30) as http:
        config = ClientConfig(httpx_client=http, streaming=streaming)
        client = await create_client(server.url, client_config=config)
        try:
            yield client
        finally:
            await client.close()


def message(
    text: str,
    *,
    steps: list[dict[str, Any]] | None = None,
    context: str = "",
    task: str = "",
    steer: bool = False,
) -> Message:
    parts = [Part(text=text)]
    if steps is not None:
        parts.append(Part(data=ParseDict({"steps": steps}, Value())))
    out = Message(
        message_id=f"m{next(_ids)}",
        role=Role.ROLE_USER,
        parts=parts,
        context_id=context,
        task_id=task,
    )
    if steer:
        meta = Struct()
        meta.update({"tether": {"steer": True}})
        out.metadata.CopyFrom(meta)
    return out


async def send(client: Client, msg: Message, *, immediately: bool = False) -> list[StreamResponse]:
    config = SendMessageConfiguration(return_immediately=immediately)
    request = SendMessageRequest(message=msg, configuration=config)
    return [r async for r in client.send_message(request)]


def raw(server: LiveServer, method: str, params: dict[str, Any], path: str = "/a2a") -> Any:
    """One JSON-RPC call over plain HTTP: the decoded answer, error or result."""
    doc = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    headers = {"A2A-Version": "1.0"}
    status, body = server.request("POST", path, json.dumps(doc).encode(), headers)
    assert status == 200, (status, body)
    return json.loads(body)


def text_message(text: str, **fields: Any) -> dict[str, Any]:
    return {"messageId": f"m{next(_ids)}", "role": "ROLE_USER", "parts": [{"text": text}], **fields}


async def get(client: Client, task: str) -> Task:
    return await client.get_task(GetTaskRequest(id=task))


def texts(task: Task) -> list[tuple[str, str]]:
    return [(Role.Name(m.role), m.parts[0].text) for m in task.history]


async def working_with(client: Client, task: str, text: str) -> Task:
    async def look() -> Task | None:
        t = await get(client, task)
        return t if any(text in said for _, said in texts(t)) else None

    found = await await_until(look, f"{text!r} in task {task}")
    assert found.status.state == TaskState.TASK_STATE_WORKING
    return found


def test_an_a2a_message_creates_a_task_that_completes_with_its_history(
    server: LiveServer,
) -> None:
    async def body() -> None:
        async with a2a(server) as client:
            steps = [{"op": "say", "text": "first words"}]
            (answer,) = await send(client, message("hello", steps=steps))
            task = answer.task
            assert task.status.state == TaskState.TASK_STATE_COMPLETED
            assert task.id.startswith("t_") and task.context_id.startswith("s_")
            assert texts(task) == [("ROLE_USER", "hello"), ("ROLE_AGENT", "first words")]
            assert [a.parts[0].text for a in task.artifacts] == ["first words"]
            # The context is a root session; the task is its turn.
            info = server.call("subagent.status", {"session": task.context_id})
            assert info["parent"] is None and info["state"] == "idle"
            turns = server.call("subagent.turns", {"session": task.context_id})["turns"]
            assert [t["id"] for t in turns] == [task.id]
            assert MessageToDict(await get(client, task.id)) == MessageToDict(task)
            # A second message in the same context is the next turn of that session.
            (again,) = await send(client, message("more", context=task.context_id))
            assert again.task.context_id == task.context_id and again.task.id != task.id
            assert texts(again.task) == [("ROLE_USER", "more"), ("ROLE_AGENT", "ok: more")]
            with pytest.raises(TaskNotFoundError):
                await get(client, "t_nobody")

    anyio.run(body)


def test_a_streaming_a2a_message_yields_the_turns_events(server: LiveServer) -> None:
    async def body() -> None:
        steps: list[dict[str, Any]] = [
            {"op": "work", "steps": 2, "every": 0.05},
            {"op": "say", "text": "one"},
            {"op": "work", "steps": 3, "every": 0.05},
            {"op": "say", "text": "two"},
        ]
        async with a2a(server, streaming=True) as client:
            events = await send(client, message("go", steps=steps))
        kinds = [e.WhichOneof("payload") for e in events]
        assert kinds[0] == "task" and kinds[-1] == "status_update", kinds
        task = events[0].task
        said = [
            e.status_update.status.message.parts[0].text
            for e in events
            if e.HasField("status_update") and e.status_update.status.HasField("message")
        ]
        # The first event is the task as it stood; every later entry of the turn comes
        # as a status update, each once, in order.
        assert [text for _, text in texts(task)] + said == ["go", "one", "two"], said
        assert said, "no entry came as an event"
        artifacts = [e.artifact_update.artifact for e in events if e.HasField("artifact_update")]
        assert [a.parts[0].text for a in artifacts] == ["two"]
        for event in events[1:]:
            update = getattr(event, event.WhichOneof("payload"))
            assert (update.task_id, update.context_id) == (task.id, task.context_id)
        assert events[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED

    anyio.run(body)


def test_cancel_task_ends_a_working_task_canceled_with_its_partial_output(
    server: LiveServer,
) -> None:
    async def body() -> None:
        async with a2a(server) as client:
            steps = [{"op": "say", "text": "half done"}, *HANG]
            (answer,) = await send(client, message("work", steps=steps), immediately=True)
            task = answer.task.id
            await working_with(client, task, "half done")
            ended = await client.cancel_task(CancelTaskRequest(id=task))
            assert ended.status.state == TaskState.TASK_STATE_CANCELED
            said = texts(ended)
            assert ("ROLE_AGENT", "half done") in said
            assert said[-1][1].startswith("cancelled after") and "cancelled over A2A" in said[-1][1]
            assert [m.metadata["tether"]["action"] for m in ended.history if m.metadata] == [
                "cancelled"
            ]
            assert ended.artifacts[0].parts[0].text == said[-1][1]  # the partial output
            turns = server.call("subagent.turns", {"session": ended.context_id})["turns"]
            assert turns[-1]["outcome"] == "cancelled" and turns[-1]["cause"] == "user"
            # A task that has ended cannot be cancelled, whether by a stop or by finishing.
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(CancelTaskRequest(id=task))
            (done,) = await send(client, message("quick", context=ended.context_id))
            assert done.task.status.state == TaskState.TASK_STATE_COMPLETED
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(CancelTaskRequest(id=done.task.id))

    anyio.run(body)


def test_cancel_task_escalates_to_an_abort_when_no_boundary_comes_by_the_deadline(
    server: LiveServer, tmp_path: Path
) -> None:
    running = tmp_path / "running"

    async def body() -> None:
        async with a2a(server) as client:
            steps: list[dict[str, Any]] = [
                {"op": "say", "text": "sleeping"},
                {"op": "tool", "argv": ["sh", "-c", f"touch {running}; exec sleep 60"]},
            ]
            (answer,) = await send(client, message("work", steps=steps), immediately=True)
            task = answer.task.id
            await working_with(client, task, "sleeping")
            # the tool runs: no boundary comes before the deadline (a cancel that came
            # before the tool's start would be taken there)
            eventually(running.exists, timeout=30.0, what="the tool running")
            ended = await client.cancel_task(CancelTaskRequest(id=task))  # --cancel-deadline 2
            assert ended.status.state == TaskState.TASK_STATE_CANCELED
            turns = server.call("subagent.turns", {"session": ended.context_id})["turns"]
            assert (turns[-1]["outcome"], turns[-1]["escalated"]) == ("aborted", True)
            assert [m.metadata["tether"]["action"] for m in ended.history if m.metadata] == [
                "cancelled",
                "escalated",
            ]

    anyio.run(body)


def test_a_steer_message_reaches_the_running_turn_and_a_plain_one_queues_behind_it(
    server: LiveServer,
) -> None:
    async def body() -> None:
        async with a2a(server) as client:
            (answer,) = await send(client, message("work", steps=HANG), immediately=True)
            task, context = answer.task.id, answer.task.context_id
            (steered,) = await send(
                client, message("go left", context=context, task=task, steer=True)
            )
            assert steered.task.id == task
            found = await working_with(client, task, "go left</steer>")
            steer = next(text for _, text in texts(found) if "</steer>" in text)
            assert steer.startswith('<steer origin="user"')
            # Without the steer flag the message waits behind the running turn.
            (queued,) = await send(client, message("next", context=context), immediately=True)
            assert queued.message.metadata["tether"]["behind"] == task
            inbox = server.call("subagent.inbox", {"session": context})["messages"]
            assert [m["preview"] for m in inbox] == ["next"]
            # Stopping the turn holds that message: the session is parked and the task
            # says so (input-required) until a new message comes.
            stopped = await client.cancel_task(CancelTaskRequest(id=task))
            assert stopped.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
            assert "1 message(s) wait" in stopped.status.message.parts[0].text
            info = server.call("subagent.status", {"session": context})
            assert info["state"] == "parked" and info["pending"] == 1
            assert (await get(client, task)).status.state == TaskState.TASK_STATE_INPUT_REQUIRED

    anyio.run(body)


def test_subscribe_to_task_streams_a_working_task_until_it_ends(server: LiveServer) -> None:
    async def body() -> None:
        async with a2a(server, streaming=True) as client:
            steps = [{"op": "say", "text": "early"}, *HANG]
            request = SendMessageRequest(
                message=message("work", steps=steps),
                configuration=SendMessageConfiguration(return_immediately=True),
            )
            stream = client.send_message(request)
            assert isinstance(stream, AsyncGenerator)  # declared an AsyncIterator; closed below
            first = await anext(stream)
            await stream.aclose()
            task = first.task.id
            seen: list[StreamResponse] = []

            async def follow() -> None:
                async for event in client.subscribe(SubscribeToTaskRequest(id=task)):
                    seen.append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(follow)
                await await_until(lambda: _async(bool(seen)), "the subscription's first event")
                await client.cancel_task(CancelTaskRequest(id=task))
            assert seen[0].task.id == task
            assert seen[-1].status_update.status.state == TaskState.TASK_STATE_CANCELED
            with pytest.raises(Exception, match="terminal"):
                async for _ in client.subscribe(SubscribeToTaskRequest(id=task)):
                    pass

    anyio.run(body)


async def _async(value: T) -> T:
    return value


def test_a2a_needs_the_token_when_one_is_set(tmp_path: Path) -> None:
    async def body(server: LiveServer) -> None:
        async with a2a(server, token="s3cret") as client:
            (answer,) = await send(client, message("hi"))
            assert answer.task.status.state == TaskState.TASK_STATE_COMPLETED
        with pytest.raises(Exception):  # noqa: B017 - the card cannot be read without it
            async with a2a(server, token="wrong"):
                pass

    with running_server(tmp_path, "--token", "s3cret", "--driver", "tether:Scripted") as server:
        assert server.request("GET", "/.well-known/agent-card.json", auth=False)[0] == 401
        assert server.request("POST", "/a2a", b"{}", auth=False)[0] == 401
        status, body_ = server.request("GET", "/.well-known/agent-card.json")
        assert status == 200
        card = httpx.Response(200, content=body_).json()
        assert [s["id"] for s in card["skills"]] == ["tether:Scripted"]
        assert card["supportedInterfaces"][0]["url"].endswith("/a2a")
        assert "bearer" in card["securitySchemes"]
        anyio.run(body, server)


def test_a_blocking_send_whose_caller_hangs_up_stops_waiting_and_the_turn_goes_on(
    tmp_path: Path,
) -> None:
    env = {"TETHER_LOG": "info", "TETHER_LOG_FORMAT": "json"}
    with running_server(tmp_path, env=env) as server:
        doc = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "SendMessage",
            "params": {
                "message": {
                    "messageId": "m1",
                    "role": "ROLE_USER",
                    "parts": [{"text": "work"}, {"data": {"steps": HANG}}],
                }
            },
        }
        headers = {"A2A-Version": "1.0", **server.auth}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/a2a", json=doc, headers=headers, timeout=2.0)

        def gone() -> dict[str, Any] | None:
            for line in server.log_text().splitlines():
                if line.startswith("{") and '"a2a.caller_gone"' in line:
                    found: dict[str, Any] = json.loads(line)
                    return found
            return None

        event = wait_until(gone, timeout=20, what="the server to notice the caller left")
        info = server.call("subagent.status", {"session": event["session"]})
        assert info["state"] == "running" and info["turn"] == event["task"]


def test_a2a_answers_at_its_path_with_a_trailing_slash_too(server: LiveServer) -> None:
    # A client whose base URL is .../a2a may post to /a2a/; a redirect it does not
    # follow would lose the call.
    answer = raw(server, "SendMessage", {"message": text_message("slash")}, path="/a2a/")
    task = answer["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    again = raw(server, "GetTask", {"id": task["id"]}, path="/a2a/")
    assert again["result"]["id"] == task["id"]


def test_a2a_answers_a_body_declared_as_not_json_with_415_and_runs_nothing(
    server: LiveServer,
) -> None:
    # The JSON-RPC binding is application/json: a body declared otherwise is refused at
    # the HTTP level (not a parse error blaming the body), and no turn starts.
    def tasks() -> int:
        total: int = raw(server, "ListTasks", {}).get("result", {}).get("totalSize", 0)
        return total

    before = tasks()
    doc = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {}}
    for kind in ("text/plain", "application/x-www-form-urlencoded"):
        status, body = server.request(
            "POST", "/a2a", json.dumps(doc).encode(), {"Content-Type": kind, "A2A-Version": "1.0"}
        )
        assert status == 415, (kind, status, body)
        error = json.loads(body)["error"]
        assert error["code"] == CONTENT_TYPE and "application/json" in error["message"]
    assert tasks() == before
    # JSON with a charset parameter is JSON
    answer = raw(server, "SendMessage", {"message": text_message("charset ok")})
    assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    status, body = server.request(
        "POST",
        "/a2a/",
        json.dumps(
            {"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {"id": "nope"}}
        ).encode(),
        {"Content-Type": "application/json; charset=utf-8", "A2A-Version": "1.0"},
    )
    assert status == 200 and _code(json.loads(body)) == -32001, body


def _code(answer: Any) -> int:
    assert "error" in answer, answer
    code: int = answer["error"]["code"]
    return code


INVALID_PARAMS, TASK_NOT_FOUND, UNSUPPORTED, CONTENT_TYPE = -32602, -32001, -32004, -32005


def test_a_send_message_missing_or_malformed_parameters_is_invalid_params(
    server: LiveServer,
) -> None:
    # Each is refused before anything runs (it used to run a turn on empty content).
    bad: list[dict[str, Any]] = [
        {},
        {"message": {"messageId": "m-no-parts", "role": "ROLE_USER", "parts": []}},
        {"message": {"role": "ROLE_USER", "parts": [{"text": "no id"}]}},
        {"message": {**text_message("from the agent"), "role": "ROLE_AGENT"}},
        {"message": text_message("   ")},
        {"message": text_message("hi"), "configuration": {"historyLength": -1}},
    ]
    for params in bad:
        assert _code(raw(server, "SendMessage", params)) == INVALID_PARAMS, params
        assert _code(raw(server, "SendStreamingMessage", params)) == INVALID_PARAMS, params


def test_a_file_or_an_unsupported_media_type_is_content_type_not_supported(
    server: LiveServer,
) -> None:
    parts: list[dict[str, Any]] = [
        {"raw": "dGNr", "mediaType": "application/x-unsupported"},
        {"url": "https://example.com/a.txt", "mediaType": "text/plain"},
        {"text": "<p>hi</p>", "mediaType": "text/html"},
        {"data": {"a": 1}, "mediaType": "application/xml"},
    ]
    for part in parts:
        params = {"message": {**text_message("x"), "parts": [part]}}
        assert _code(raw(server, "SendMessage", params)) == CONTENT_TYPE, part
    # The card's input modes, named, are fine.
    ok = [
        {"text": "typed", "mediaType": "text/plain"},
        {"data": {}, "mediaType": "application/json"},
    ]
    answer = raw(server, "SendMessage", {"message": {**text_message("x"), "parts": ok}})
    assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", answer


def test_the_official_client_sending_a_file_the_agent_does_not_take_gets_content_type_not_supported(
    server: LiveServer,
) -> None:
    """A2A 1.0, section 3.1.1 (the TCK's CORE-SEND-003): a part of a media type the agent
    does not take is ContentTypeNotSupportedError, blocking or streaming, and nothing runs."""

    status, card = server.request("GET", "/.well-known/agent-card.json")
    assert status == 200
    assert json.loads(card)["defaultInputModes"] == ["text/plain", "application/json"]

    async def body() -> None:
        before = raw(server, "ListTasks", {})["result"]["totalSize"]
        files = [
            Part(raw=b"tck", media_type="application/x-unsupported-tck-type"),
            Part(url="https://example.com/chart.png", media_type="image/png"),
        ]
        for streaming in (False, True):
            async with a2a(server, streaming=streaming) as client:
                for file in files:
                    ask = Message(
                        message_id=f"m{next(_ids)}",
                        role=Role.ROLE_USER,
                        parts=[Part(text="see the attachment"), file],
                    )
                    with pytest.raises(ContentTypeNotSupportedError):
                        await send(client, ask)
        assert raw(server, "ListTasks", {})["result"]["totalSize"] == before

    anyio.run(body)


def test_a_message_naming_a_task_that_does_not_exist_is_task_not_found(
    server: LiveServer,
) -> None:
    for method in ("SendMessage", "SendStreamingMessage"):
        params = {"message": text_message("to nobody", taskId="t_nobody")}
        assert _code(raw(server, method, params)) == TASK_NOT_FOUND


def test_a_message_to_an_ended_task_is_unsupported_and_starts_no_turn(
    server: LiveServer,
) -> None:
    done = raw(server, "SendMessage", {"message": text_message("first")})["result"]["task"]
    assert done["status"]["state"] == "TASK_STATE_COMPLETED"
    again = {"message": text_message("more", taskId=done["id"])}
    assert _code(raw(server, "SendMessage", again)) == UNSUPPORTED
    with_context = {"message": text_message("more", taskId=done["id"], contextId=done["contextId"])}
    assert _code(raw(server, "SendMessage", with_context)) == UNSUPPORTED
    turns = server.call("subagent.turns", {"session": done["contextId"]})["turns"]
    assert [t["id"] for t in turns] == [done["id"]]
    assert server.call("subagent.inbox", {"session": done["contextId"]})["messages"] == []
    # Its context takes the next message, which is a new task.
    nxt = raw(server, "SendMessage", {"message": text_message("next", contextId=done["contextId"])})
    assert nxt["result"]["task"]["id"] != done["id"]


def test_a_message_naming_only_its_task_goes_to_that_tasks_context(server: LiveServer) -> None:
    async def body() -> None:
        async with a2a(server) as client:
            (answer,) = await send(client, message("work", steps=HANG), immediately=True)
            task, context = answer.task.id, answer.task.context_id
            # A steer and a plain message, each naming the task alone.
            (steered,) = await send(client, message("go right", task=task, steer=True))
            assert (steered.task.id, steered.task.context_id) == (task, context)
            await working_with(client, task, "go right</steer>")
            (queued,) = await send(client, message("later", task=task), immediately=True)
            assert queued.message.context_id == context
            inbox = server.call("subagent.inbox", {"session": context})["messages"]
            assert [m["preview"] for m in inbox] == ["later"]
        # The task and another context: refused, and nothing is sent.
        other = raw(server, "SendMessage", {"message": text_message("elsewhere")})
        wrong = other["result"]["task"]["contextId"]
        params = {"message": text_message("mixed", taskId=task, contextId=wrong)}
        assert _code(raw(server, "SendMessage", params)) == INVALID_PARAMS
        steer = {**params["message"], "metadata": {"tether": {"steer": True}}}
        assert _code(raw(server, "SendMessage", {"message": steer})) == INVALID_PARAMS
        assert len(server.call("subagent.inbox", {"session": context})["messages"]) == 1
        assert len(server.call("subagent.turns", {"session": wrong})["turns"]) == 1

    anyio.run(body)


def test_a_message_to_a_context_this_server_never_opened_is_invalid_params(
    server: LiveServer,
) -> None:
    params = {"message": text_message("hello", contextId="s_made_up")}
    assert _code(raw(server, "SendMessage", params)) == INVALID_PARAMS


def test_a_root_opened_over_rpc_is_no_a2a_context_and_its_turns_are_no_a2a_tasks(
    server: LiveServer,
) -> None:
    """An A2A caller holding another face's root id can neither send to it nor read it,
    and is told no more than for an id that does not exist."""
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    server.call("session.prompt", {"session": root, "content": "the operator's private plan"})
    server.wait_state(root, "idle")
    (turn,) = [t["id"] for t in server.call("subagent.turns", {"session": root})["turns"]]
    made_up_context, made_up_task = "s_" + "0" * (len(root) - 2), "t_" + "0" * (len(turn) - 2)

    def refusal(method: str, params: dict[str, Any], given: str) -> tuple[int, str]:
        answer = raw(server, method, params)
        assert "result" not in answer, (method, answer)
        return answer["error"]["code"], answer["error"]["message"].replace(given, "ID")

    for context in (root, made_up_context):
        assert refusal(
            "SendMessage", {"message": text_message("let me in", contextId=context)}, context
        ) == (INVALID_PARAMS, "no context 'ID' here: leave contextId out to open one")
    steer = {"tether": {"steer": True}}
    for method, params in [
        ("SendMessage", {"message": text_message("go", taskId="ID")}),
        ("SendMessage", {"message": text_message("go", taskId="ID", metadata=steer)}),
        ("SendStreamingMessage", {"message": text_message("go", taskId="ID")}),
        ("GetTask", {"id": "ID"}),
        ("CancelTask", {"id": "ID"}),
        ("SubscribeToTask", {"id": "ID"}),
    ]:
        answers = set()
        for task in (turn, made_up_task):
            doc = json.loads(json.dumps(params).replace('"ID"', json.dumps(task)))
            answers.add(refusal(method, doc, task))
        assert len(answers) == 1 and answers.pop()[0] == TASK_NOT_FOUND, (method, answers)
    listed = raw(server, "ListTasks", {"contextId": root})["result"]
    assert listed["tasks"] == [] and listed["totalSize"] == 0
    everything = raw(server, "ListTasks", {"pageSize": 100})["result"]
    assert "private plan" not in json.dumps(everything)
    assert root not in {t["contextId"] for t in everything["tasks"]}
    # Nothing reached the root: its one turn, and no message waiting.
    assert [t["id"] for t in server.call("subagent.turns", {"session": root})["turns"]] == [turn]
    assert server.call("subagent.inbox", {"session": root})["messages"] == []


def test_list_tasks_pages_a_contexts_tasks_newest_first(server: LiveServer) -> None:
    first = raw(server, "SendMessage", {"message": text_message("one")})["result"]["task"]
    context = first["contextId"]
    ids = [first["id"]]
    for text in ("two", "three"):
        params: dict[str, Any] = {"message": text_message(text, contextId=context)}
        ids.append(raw(server, "SendMessage", params)["result"]["task"]["id"])
    page = raw(server, "ListTasks", {"contextId": context, "pageSize": 2})["result"]
    assert [t["id"] for t in page["tasks"]] == ids[::-1][:2]
    assert (page["totalSize"], page["pageSize"]) == (3, 2) and page["nextPageToken"]
    assert all("artifacts" not in t for t in page["tasks"])  # includeArtifacts defaults false
    stamps = [t["status"]["timestamp"] for t in page["tasks"]]
    assert stamps == sorted(stamps, reverse=True)
    params = {"contextId": context, "pageSize": 2, "pageToken": page["nextPageToken"]}
    last = raw(server, "ListTasks", params)["result"]
    assert [t["id"] for t in last["tasks"]] == ids[:1]
    assert last["nextPageToken"] == "" and last["totalSize"] == 3  # present, and empty
    full = raw(server, "ListTasks", {"contextId": context, "includeArtifacts": True})["result"]
    assert [t["artifacts"][0]["parts"][0]["text"] for t in full["tasks"]] == [
        "ok: three",
        "ok: two",
        "ok: one",
    ]
    assert full["nextPageToken"] == ""
    bare = raw(server, "ListTasks", {"contextId": context, "historyLength": 0})["result"]
    assert [t.get("history", []) for t in bare["tasks"]] == [[], [], []]
    one = raw(server, "ListTasks", {"contextId": context, "historyLength": 1})["result"]
    assert [len(t["history"]) for t in one["tasks"]] == [1, 1, 1]
    nobody = raw(server, "ListTasks", {"contextId": "s_nobody"})["result"]
    assert nobody["tasks"] == [] and nobody["nextPageToken"] == ""


def test_list_tasks_filters_by_state_and_by_time(server: LiveServer) -> None:
    async def body() -> None:
        async with a2a(server) as client:
            (answer,) = await send(client, message("work", steps=HANG), immediately=True)
            task, context = answer.task.id, answer.task.context_id
            await await_until(lambda: get(client, task), "the task")
            done = raw(server, "SendMessage", {"message": text_message("quick")})["result"]["task"]
            working = raw(server, "ListTasks", {"status": "TASK_STATE_WORKING"})["result"]
            listed = {t["id"] for t in working["tasks"]}
            assert task in listed and done["id"] not in listed
            assert all(t["status"]["state"] == "TASK_STATE_WORKING" for t in working["tasks"])
            params = {"contextId": context, "status": "TASK_STATE_COMPLETED"}
            assert raw(server, "ListTasks", params)["result"]["tasks"] == []
            since = {"statusTimestampAfter": done["status"]["timestamp"]}
            recent = {t["id"] for t in raw(server, "ListTasks", since)["result"]["tasks"]}
            assert done["id"] in recent and task not in recent

    anyio.run(body)


def test_list_tasks_refuses_a_bad_page_size_history_length_or_page_token(
    server: LiveServer,
) -> None:
    for params in (
        {"pageSize": 0},
        {"pageSize": 101},
        {"historyLength": -1},
        {"pageToken": "not a token"},
    ):
        assert _code(raw(server, "ListTasks", params)) == INVALID_PARAMS, params


def test_blocking_sends_queued_behind_a_turn_stop_waiting_when_their_callers_hang_up(
    tmp_path: Path,
) -> None:
    env = {"TETHER_LOG": "info", "TETHER_LOG_FORMAT": "json"}
    with running_server(tmp_path, env=env) as server:
        parts = [{"text": "work"}, {"data": {"steps": HANG}}]
        params = {
            "message": {**text_message("work"), "parts": parts},
            "configuration": {"returnImmediately": True},
        }
        first = raw(server, "SendMessage", params)["result"]["task"]
        context, task = first["contextId"], first["id"]
        callers = 5

        def hang_up(i: int) -> None:
            doc = {
                "jsonrpc": "2.0",
                "id": i,
                "method": "SendMessage",
                "params": {"message": text_message(f"behind {i}", contextId=context)},
            }
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes
                httpx.post(
                    server.url + "/a2a",
                    json=doc,
                    headers={"A2A-Version": "1.0", **server.auth},
                    timeout=1.5,
                )

        for i in range(callers):
            hang_up(i)

        def gone() -> list[dict[str, Any]] | None:
            lines = [
                json.loads(line)
                for line in server.log_text().splitlines()
                if line.startswith("{") and '"a2a.caller_gone"' in line
            ]
            found = [e for e in lines if e.get("session") == context and "message" in e]
            return found if len(found) == callers and found[-1]["waiting"] == 0 else None

        # Each wait ends when its caller leaves (it used to poll until the turn ahead
        # ended), and the last leaves no waiter behind; the messages stay queued.
        wait_until(gone, timeout=20, what="every caller's wait to end")
        inbox = server.call("subagent.inbox", {"session": context})["messages"]
        assert [m["preview"] for m in inbox] == [f"behind {i}" for i in range(callers)]
        info = server.call("subagent.status", {"session": context})
        assert info["state"] == "running" and info["turn"] == task
