"""``tether.adapters.pydantic_ai:PydanticAIAgent``: a Pydantic AI agent under Tether.

An async driver that runs a ``pydantic_ai.Agent`` through ``agent.iter()``. Config and
behaviour: docs/adapters-pydantic_ai.md; where steers, cancels and preempts enter the
framework's loop: docs/design.md, section 12.3.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pydantic_ai  # noqa: F401  # the framework: a worker without it refuses the driver
import structlog

from tether.adapters._factory import check_factory
from tether.adapters._steers import SteerRelay
from tether.agents import chat

# ChatAgent's bookkeeping, one home for each piece: its error, its one-line errors, its
# host tool schemas and results, its honest preempted text, its MCP tools and policies,
# its check of a model config's keys.
from tether.agents.chat import (
    ModelError,
    _describe,
    _host_schemas,
    _idempotent,
    _max_duration,
    _mcp_call,
    _mcp_tools,
    _one_line,
    _preempted_text,
    _result_text,
)
from tether.agents.drain import drained
from tether.agents.mcp import McpTools
from tether.driver.async_context import AsyncTurnContext
from tether.driver.calls import calling
from tether.telemetry import spans
from tether.wire.errors import InvalidParams, Preempted, TetherError
from tether.wire.frames import Steer
from tether.wire.records import Entry, Recovered
from tether.wire.text import render_frame, unknown_call_text

__all__ = ["PydanticAIAgent"]

log = structlog.get_logger("tether.adapters.pydantic_ai")

_KEY = "pydantic_ai"  # an assistant entry's data: the framework's messages up to that reply
_NO_RESULT = "(no result: stopped)"


@dataclass
class _Model:
    base_url: str | None = None
    name: str = "default"
    api_key_env: str | None = None
    timeout: float = 600.0
    retries: int = 3
    price: dict[str, float] | None = None  # the budget's (semantics §16.2): see add_usage


@dataclass
class _Config:
    factory: str
    model: _Model | None
    tools: list[str] = field(default_factory=list)
    chat: chat._Config | None = None  # its mcp and tool_policy, as ChatAgent reads them


def _config(raw: dict[str, Any]) -> _Config:
    """The session config, checked: a mistake is a one-line ``InvalidParams``."""
    factory = raw.get("agent")
    if not isinstance(factory, str) or ":" not in factory:
        raise InvalidParams("config.agent: give the factory as 'pkg.module:function'")
    model = None if raw.get("model") is None else chat._model(raw["model"], _Model)
    # Tether's tools, MCP servers and tool policies as ChatAgent reads them (semantics §15.3)
    tools_cfg = chat._config(
        {"tools": raw.get("tools"), "mcp": raw.get("mcp"), "tool_policy": raw.get("tool_policy")}
    )
    tools = tools_cfg.tools
    return _Config(factory=factory, model=model, tools=tools, chat=tools_cfg)


def _model_of(model: _Model) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = chat.openai_client(
        base_url=model.base_url,
        api_key_env=model.api_key_env,
        timeout=model.timeout,
        retries=model.retries,
    )
    return OpenAIChatModel(model.name, provider=OpenAIProvider(openai_client=client))


class PydanticAIAgent:
    """A Pydantic AI agent: ``rt.open_session("tether.adapters.pydantic_ai:PydanticAIAgent",
    config={"agent": "pkg.mod:factory", "model": {...}, "tools": [...]})``."""

    # A turn a crash interrupted runs on from its message history (semantics §17.1).
    recoverable = True

    @staticmethod
    def check_config(config: dict[str, Any]) -> None:
        """At open and spawn, in a worker: the config the turn will read (its _config),
        and the ``agent`` factory imports (else ``driver-not-found``, before any turn)."""
        _config(config)
        check_factory(config)

    async def run(self, ctx: AsyncTurnContext) -> str | None:
        try:
            cfg = _config(ctx.config)
            agent = _agent_of_config(cfg, ctx.config)
            model = None if cfg.model is None else _model_of(cfg.model)
        except TetherError as exc:
            raise ModelError(_one_line(exc.message)) from None
        turn = _Turn(ctx, cfg)
        try:
            return await turn.run(agent, model)
        except asyncio.CancelledError:
            if ctx.cancel is None:
                raise  # not this turn's cancel
            turn.cut()
            return None
        except TetherError:
            raise
        except Exception as exc:  # the framework's own errors: one line, never a traceback
            raise ModelError(_describe(exc, 0)) from None


def _agent_of_config(cfg: _Config, raw: dict[str, Any]) -> Any:
    from pydantic_ai.agent import AbstractAgent

    module, _, name = cfg.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise InvalidParams(f"config.agent: cannot import {cfg.factory}: {exc}") from None
    if not callable(factory):
        raise InvalidParams(f"config.agent: {cfg.factory} is not callable")
    if cfg.model is None:
        agent = factory(raw)
    else:
        with _model_names_kept():
            agent = factory(raw)
    if not isinstance(agent, AbstractAgent):
        raise InvalidParams(f"config.agent: {cfg.factory} returned {type(agent).__name__}")
    return agent


_infer_lock = threading.Lock()


@contextlib.contextmanager
def _model_names_kept() -> Iterator[None]:
    """While a factory runs whose model ``config.model`` replaces: an ``Agent("openai:…")``
    keeps its model as a name, as ``defer_model_check=True`` would, so building it needs
    no provider and so no key (Pydantic AI builds the provider, which insists on its
    key, when the agent is made). A model object the factory builds itself is untouched.
    """
    from pydantic_ai import models

    with _infer_lock:
        infer = models.infer_model

        def keep_name(model: Any, *args: Any, **kwargs: Any) -> Any:
            return model if isinstance(model, str) else infer(model, *args, **kwargs)

        models.infer_model = keep_name
        try:
            yield
        finally:
            models.infer_model = infer


class _Turn:
    """One turn's bookkeeping: what was said and stored, what is streaming."""

    def __init__(self, ctx: AsyncTurnContext, cfg: _Config) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.run_: Any = None
        self.saved = 0  # how many of the run's new messages are stored in entries
        self.partial = ""  # the text of the reply streaming now
        self.preempted: set[str] = set()  # tool call ids stopped by a preempt
        self.recorded: set[str] = set()  # tool call ids whose tool entry is written
        self.calls: dict[str, Any] = {}  # the last reply's tool calls, by id
        self.offered: list[dict[str, Any]] = []  # the MCP tools' schemas this turn
        self.steers = SteerRelay(ctx)
        self.enqueued: dict[str, Steer] = {}  # the framework's enqueue id -> its steer
        # The request whose reply is not said yet: what it sent, and its stream (opened)
        self.open: tuple[list[Any], Any] | None = None
        self.mcp: McpTools | None = None
        self.keys: dict[str, str] = {}  # tool call id -> its call key (its durable start)
        self.rerun: dict[str, str] = {}  # an idempotent unknown call run again: its old key
        # A recovered run's last request, sent as the run's first: stored with its reply
        self.resent: Any = None

    async def _mcp(self) -> McpTools | None:
        """The config's MCP servers, opened by Tether (kept across the worker's turns)."""
        assert self.cfg.chat is not None
        mcp = self.mcp = await _mcp_tools(self.ctx, self.cfg.chat)
        if mcp is None:
            return None
        self.offered, missing = await mcp.offered()
        if len(missing) == len(mcp.servers):  # nothing of the config works: a mistake
            raise ModelError(_one_line("config.mcp: " + "; ".join(missing.values())))
        for server, why in missing.items():
            self.ctx.record_tool(why, data={"mcp_unavailable": server})
        return mcp

    async def run(self, agent: Any, model: Any) -> str | None:
        from pydantic_ai import Agent
        from pydantic_ai.messages import EnqueuedMessagesEvent, FunctionToolResultEvent

        ctx = self.ctx
        mcp = await self._mcp()
        entries = await ctx.load_history()
        prompt: str | None = ctx.message.content
        deferred: Any = None
        if ctx.recovered is None:
            history = _history(entries, ctx.turn)
        else:
            recovered = self._recovered(entries, ctx.recovered)
            if recovered is None:
                return None  # its final reply was durable: it is the turn's final text
            history, deferred = recovered
            prompt = None  # the history ends where the turn was: it goes on from there
        tools = _host_tools(self, self.cfg.tools) + _mcp_as_tools(self, mcp, self.offered)
        toolsets = [_toolset(tools)] if tools else None
        async with agent.iter(
            prompt,
            message_history=history or None,
            deferred_tool_results=deferred,
            model=model,
            toolsets=toolsets,
            capabilities=[_Stops(self)],
        ) as run:
            self.run_ = run
            relay = asyncio.ensure_future(self.steers.run(self._offer))
            try:
                async for node in run:
                    if Agent.is_model_request_node(node):
                        # the boundary before each model request: a steer that arrived
                        # since the last poll goes into it too
                        ctx.progress()
                        for steer in self.steers.new():
                            await self._offer(steer)
                        with spans.chat("openai", _model_name(model, agent)) as span:
                            await self._stream(node, run, span)
                    elif Agent.is_call_tools_node(node):
                        if deferred is None:
                            self._reply(node.model_response)
                        deferred = None  # a recovered run's first: its reply is durable
                        async with node.stream(run.ctx) as events:
                            async for event in events:
                                ctx.progress()
                                if isinstance(event, FunctionToolResultEvent):
                                    self.returned(event.part)
                                elif isinstance(event, EnqueuedMessagesEvent):
                                    self._taken(event)
            finally:
                relay.cancel()
        return None  # the last reply, said already, is the turn's final text

    def _recovered(
        self, entries: list[Entry], recovered: Recovered
    ) -> tuple[list[Any], Any] | None:
        """A recovered turn's history, from its last durable step (semantics §17.1), and
        the deferred results that run the calls still to run; None if its final reply
        was durable. The last reply's calls with no durable result: never started, they
        run now; started, each is unknown (the model is told so, as its result), unless
        its policy says it is idempotent: then it runs again with the same call key."""
        from pydantic_ai import DeferredToolResults
        from pydantic_ai.messages import ModelRequest, ModelResponse, ToolReturnPart

        messages, results = _gathered(entries, None)
        mine = [e for e in entries if e.turn == self.ctx.turn]
        last = next(
            (i for i in range(len(messages) - 1, -1, -1) if isinstance(messages[i], ModelResponse)),
            None,
        )
        replied = any(e.kind == "assistant" and _KEY in (e.data or {}) for e in mine)
        run_now: dict[str, bool] = {}
        if replied and last is not None:
            calls = _calls(messages[last])
            if not calls and last == len(messages) - 1:
                return None
            assert self.cfg.chat is not None
            for call_id, call in calls.items():
                if call_id in results:
                    continue
                unknown = next(
                    (c for c in recovered.unknown_calls if c.tool_call_id == call_id), None
                )
                if unknown is None:
                    run_now[call_id] = True  # it never started
                elif _idempotent(self.cfg.chat, self.mcp, call.tool_name):
                    self.rerun[call_id] = unknown.key
                    run_now[call_id] = True
                else:
                    text = unknown_call_text(recovered.cause)
                    part = ToolReturnPart(
                        call.tool_name, text, tool_call_id=call_id, outcome="interrupted"
                    )
                    results[call_id] = part
                    self.keys[call_id] = unknown.key
                    self.calls[call_id] = call
                    self.returned(part, unknown=True)
            self.calls.update(calls)
        history = _answered(messages, results, keep_open=set(run_now))
        if history and isinstance(history[-1], ModelRequest):
            self.resent = history[-1]
        deferred = DeferredToolResults(approvals=dict(run_now)) if run_now else None
        return history, deferred

    async def _offer(self, steer: Steer) -> None:
        """Enqueue a steer ``asap``: the framework delivers it into its next request (or
        one more, if the run would end) and says so with an ``EnqueuedMessagesEvent``."""
        from pydantic_ai.exceptions import UserError

        try:
            enqueue_id = self.run_.enqueue(steer.render(), priority="asap")
        except UserError:  # the run has ended: the steer stays the turn's pending one
            return
        if enqueue_id is not None:
            self.enqueued[enqueue_id] = steer

    def _taken(self, event: Any) -> None:
        """The framework delivered an enqueued steer into the request it sends now."""
        steer = self.enqueued.pop(event.enqueue_id, None)
        if steer is not None:
            log.debug("steer.taken", turn=self.ctx.turn)
            self.steers.taken([steer])

    async def _stream(self, node: Any, run: Any, span: spans.Span) -> None:
        from pydantic_ai.messages import (
            EnqueuedMessagesEvent,
            PartDeltaEvent,
            PartStartEvent,
            TextPart,
            TextPartDelta,
        )

        self.partial = ""
        events = 0

        async def read() -> Any:
            nonlocal events
            async with node.stream(run.ctx) as stream:
                # the request went out, its answer began: it costs from here on
                self.open = (list(run.ctx.state.message_history), stream)
                async for event in stream:
                    events += 1
                    self.ctx.progress()  # every streamed event is progress for the watchdog
                    if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
                        self.partial += event.part.content
                    elif isinstance(event, PartDeltaEvent) and isinstance(
                        event.delta, TextPartDelta
                    ):
                        self.partial += event.delta.content_delta
                    elif isinstance(event, EnqueuedMessagesEvent):
                        self._taken(event)
                return stream.response

        # a cancel lets the stream parse what the worker had read first: the cut keeps it
        response = await drained(read(), lambda: events)
        usage = response.usage
        span.usage(usage.input_tokens, usage.output_tokens)
        finish = getattr(response, "finish_reason", None)
        if finish:
            span.finish([str(finish)])

    def _unsaved(self) -> list[Any]:
        if self.run_ is None:
            return []
        messages: list[Any] = list(self.run_.new_messages())
        return messages[self.saved :]

    def _reply(self, response: Any) -> None:
        """A model reply arrived whole: its assistant entry, its usage."""
        from pydantic_ai.messages import TextPart

        self.partial = ""
        self.open = None
        usage = {
            "prompt_tokens": int(response.usage.input_tokens or 0),
            "completion_tokens": int(response.usage.output_tokens or 0),
        }
        chunk = self._unsaved()
        if not chunk or chunk[-1] is not response:
            chunk.append(response)  # the run adds it to its history only after this node
        self.saved += len(chunk)
        if self.resent is not None:
            # a recovered run's first request is its history's, not among its new
            # messages: kept with its reply, as a request of the turn's own
            if not any(m is self.resent for m in chunk):
                chunk.insert(0, self.resent)
            self.resent = None
        text = "".join(p.content for p in response.parts if isinstance(p, TextPart))
        data: dict[str, Any] = {_KEY: _dump(chunk)}
        calls = self.calls = _calls(response)
        if calls:
            data["tool_calls"] = [
                {
                    "id": c.tool_call_id,
                    "type": "function",
                    "function": {"name": c.tool_name, "arguments": c.args_as_json_str()},
                }
                for c in calls.values()
            ]
        self.ctx.say(text, data=data, usage=usage)  # the usage rides with the reply

    def result(self, call: Any, value: Any) -> None:
        """A tool call returned ``value``: its tool entry, with the part the framework
        makes of it (``ToolReturn``'s value and metadata; its extra user content is not
        kept)."""
        from pydantic_ai.messages import ToolReturn, ToolReturnPart

        meta = None
        if isinstance(value, ToolReturn):
            value, meta = value.return_value, value.metadata
        part = ToolReturnPart(call.tool_name, value, tool_call_id=call.tool_call_id, metadata=meta)
        self.returned(part)

    def returned(self, part: Any, *, unknown: bool = False) -> None:
        """A tool call's result as the model gets it: its one ``tool`` entry, carrying the
        framework's part, so that every later turn reads it as it came back (a turn
        stopped before the next reply stores no messages of its own), and its call key.
        ``unknown``: a recovered turn's call that may or may not have run."""
        from pydantic_ai.messages import ModelRequest, ToolReturnPart

        if not isinstance(part, ToolReturnPart) or part.tool_call_id in self.recorded:
            return
        self.recorded.add(part.tool_call_id)
        call = self.calls.get(part.tool_call_id)
        data: dict[str, Any] = {
            "tool_call_id": part.tool_call_id,
            "name": part.tool_name,
            "arguments": call.args_as_json_str() if call is not None else "",
            _KEY: _dump([ModelRequest(parts=[part])]),
        }
        key = self.keys.get(part.tool_call_id)
        if key is not None:
            data["call"] = key
        if unknown:
            data["unknown"] = True
        if part.tool_call_id in self.preempted:
            data["preempted"] = True
        self.ctx.record_tool(part.model_response_str(), data=data)

    def cut(self) -> None:
        """The turn was cancelled: keep the partial reply, with the run's messages so far,
        and count what its request cost."""
        from pydantic_ai.messages import ModelResponse, TextPart

        usage = self._cut_usage()
        if not self.partial:
            if usage is not None:
                self.ctx.add_usage(usage)
            return
        chunk = self._unsaved()
        if not chunk or not isinstance(chunk[-1], ModelResponse):
            # the framework keeps the interrupted reply in its messages; where it did
            # not, what arrived is added, so the next turn sees what the model said
            chunk.append(ModelResponse(parts=[TextPart(self.partial)]))
        self.saved += len(chunk)
        self.ctx.say(self.partial, data={"cut": True, _KEY: _dump(chunk)}, usage=usage)
        self.partial = ""

    def _cut_usage(self) -> dict[str, int | bool] | None:
        """What the request whose reply was not said cost, at least (semantics §15.2): the
        server's counts of it where the stream gave them, else estimates (None: no
        request had begun answering)."""
        opened, self.open = self.open, None
        if opened is None:
            return None
        sent, stream = opened
        response = stream.response
        usage = response.usage
        # the stream's tool schemas were sent too; its parameters are not public
        params = getattr(stream, "_model_request_parameters", None)
        return chat._cut_usage(
            int(usage.input_tokens or 0),
            int(usage.output_tokens or 0),
            lambda: _sent(sent, params),
            sum(len(_part_text(p)) for p in response.parts),
        )


def _model_name(model: Any, agent: Any) -> str:
    """The model a request goes to, for its span's name."""
    chosen = model if model is not None else getattr(agent, "model", None)
    return str(getattr(chosen, "model_name", None) or chosen or "default")


def _part_text(part: Any) -> str:
    """What a message part carries to or from the model, as text."""
    from pydantic_ai.messages import ToolCallPart

    if isinstance(part, ToolCallPart):
        return part.tool_name + part.args_as_json_str()
    if hasattr(part, "model_response_str"):  # a tool's result
        return str(part.model_response_str())
    content = getattr(part, "content", "")
    return content if isinstance(content, str) else json.dumps(content, default=str)


def _sent(messages: list[Any], params: Any) -> str:
    """A request's messages and tool schemas about as the wire carries them (JSON), for
    the estimate of a cut reply's prompt."""
    items: list[Any] = []
    instructions = ""  # only the latest request's go out
    for m in messages:
        instructions = getattr(m, "instructions", None) or instructions
        items += [{"role": getattr(p, "part_kind", ""), "content": _part_text(p)} for p in m.parts]
    if instructions:
        items.insert(0, {"role": "system", "content": instructions})
    tools = [
        {"name": t.name, "description": t.description, "parameters": t.parameters_json_schema}
        for t in getattr(params, "function_tools", None) or ()
    ]
    return json.dumps([items, tools], ensure_ascii=False, default=str)


def _calls(response: Any) -> dict[str, Any]:
    from pydantic_ai.messages import ToolCallPart

    return {p.tool_call_id: p for p in response.parts if isinstance(p, ToolCallPart)}


def _dump(messages: list[Any]) -> list[Any]:
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    dumped: list[Any] = ModelMessagesTypeAdapter.dump_python(messages, mode="json")
    return dumped


def _history(entries: list[Entry], turn: str) -> list[Any]:
    """The conversation so far: the messages stored with earlier turns' replies, and what
    no stored reply covers (a turn stopped or failed before a reply: its user message,
    the steers taken since its last reply); every tool call answered, by its ``tool``
    entry where its result came back, else by a result saying it was stopped."""
    messages, results = _gathered(entries, turn)
    return _answered(messages, results)


def _gathered(entries: list[Entry], turn: str | None) -> tuple[list[Any], dict[str, Any]]:
    """``_history``'s messages, their calls not yet answered, and the results of the
    calls by id; every turn's but ``turn``'s (None: all of them)."""
    from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelRequest

    turns: dict[str, list[Entry]] = {}
    for e in entries:
        if e.turn is not None and e.turn != turn:
            turns.setdefault(e.turn, []).append(e)
    messages: list[Any] = []
    results: dict[str, Any] = {}  # tool call id -> its result part, from its tool entry
    for own in turns.values():
        stored = [i for i, e in enumerate(own) if e.kind == "assistant" and _KEY in (e.data or {})]
        for i in stored:
            messages.extend(ModelMessagesTypeAdapter.validate_python((own[i].data or {})[_KEY]))
        # a stored reply holds the requests before it: the user parts after the last one
        # (or all of them, with none) went to the model with no reply kept
        tail = own[stored[-1] + 1 :] if stored else own
        parts = [p for e in tail if (p := _user_part(e)) is not None]
        if parts:
            messages.append(ModelRequest(parts=parts))
        for e in own:
            part = _result_part(e)
            if part is not None:
                results[part.tool_call_id] = part
    return messages, results


def _user_part(e: Entry) -> Any | None:
    """A turn's message, or a steer taken, as the user part its request carried."""
    from pydantic_ai.messages import UserPromptPart

    if e.kind in ("user", "notice"):
        return UserPromptPart(e.text)
    if e.kind == "marker" and e.action == "steered":
        return UserPromptPart(render_frame("steer", e.origin or "", e.by or "", e.reason or ""))
    return None


def _result_part(e: Entry) -> Any | None:
    """A ``tool`` entry's result as the framework's part (an older entry's from its text)."""
    from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelRequest, ToolReturnPart

    data = e.data or {}
    call_id = data.get("tool_call_id")
    if e.kind != "tool" or not call_id:
        return None
    for m in ModelMessagesTypeAdapter.validate_python(data.get(_KEY) or []):
        if isinstance(m, ModelRequest):
            for p in m.parts:
                if isinstance(p, ToolReturnPart) and p.tool_call_id == call_id:
                    return p
    return ToolReturnPart(str(data.get("name") or ""), e.text, tool_call_id=call_id)


def _answered(
    messages: list[Any], results: dict[str, Any], keep_open: set[str] | None = None
) -> list[Any]:
    """``messages`` with every tool call answered in the request after its reply: by its
    result where one came back, else by a result saying it was stopped; the calls of
    ``keep_open`` (of the last reply: a recovered turn runs them) are left unanswered."""
    from pydantic_ai.messages import ModelRequest, ModelResponse, ToolReturnPart

    out: list[Any] = []
    open_calls: dict[str, str] = {}

    def close(into: Any | None) -> None:
        parts = [
            results.get(i) or ToolReturnPart(name, _NO_RESULT, tool_call_id=i)
            for i, name in open_calls.items()
            if i not in (keep_open or ())
        ]
        open_calls.clear()
        if not parts:
            return
        if into is None:
            out.append(ModelRequest(parts=parts))
        else:
            into.parts = [*parts, *into.parts]

    for m in messages:
        if isinstance(m, ModelRequest):
            for p in m.parts:
                if isinstance(p, ToolReturnPart):
                    open_calls.pop(p.tool_call_id, None)
            close(m)
            out.append(m)
        elif isinstance(m, ModelResponse):
            close(None)
            open_calls.update({i: c.tool_name for i, c in _calls(m).items()})
            out.append(m)
    close(None)
    return out


def _toolset(tools: list[Any]) -> Any:
    from pydantic_ai.toolsets import FunctionToolset

    return FunctionToolset(tools)


def _tool(function: Any, schema: dict[str, Any]) -> Any:
    from pydantic_ai import Tool

    fn = schema["function"]
    return Tool.from_schema(
        function,
        name=fn["name"],
        description=fn.get("description"),
        json_schema=fn.get("parameters") or {"type": "object", "properties": {}},
    )


def _host_tools(turn: _Turn, names: list[str]) -> list[Any]:
    """Tether's agent tools (semantics §11) as Pydantic AI tools, with their own schemas."""
    return [
        _tool(_host_tool(turn, s["function"]["name"]), s)
        for s in _host_schemas()
        if s["function"]["name"] in names
    ]


def _host_tool(turn: _Turn, name: str) -> Any:
    async def call(**arguments: Any) -> str:
        assert turn.cfg.chat is not None
        timer = _max_duration(turn.ctx, turn.cfg.chat, name)  # a policy's limit
        try:
            return _result_text(await turn.ctx.call_tool(name, json.dumps(arguments)))
        except Preempted as exc:
            return _preempted_text(exc)
        finally:
            if timer is not None:
                timer.cancel()

    return call


def _mcp_as_tools(turn: _Turn, mcp: McpTools | None, offered: list[dict[str, Any]]) -> list[Any]:
    """The MCP servers' tools (``mcp__<server>__<tool>``), called through Tether's MCP
    client: a preempt or cancel reaches the server, its policies apply (semantics §15.3)."""
    if mcp is None:
        return []

    def tool(name: str) -> Any:
        async def call(**arguments: Any) -> str:
            try:
                return await _mcp_call(turn.ctx, mcp, name, json.dumps(arguments))
            except Preempted as exc:
                return _preempted_text(exc)

        return call

    return [_tool(tool(s["function"]["name"]), s) for s in offered]


def _make_stops() -> type[Any]:
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.exceptions import ToolFailedError, ToolRetryError

    class Stops(AbstractCapability[Any]):
        """Every tool's execution as the innermost preemptable call: a preempt stops
        that tool alone and the model gets the honest result."""

        def __init__(self, turn: _Turn) -> None:
            self.turn = turn

        async def wrap_tool_execute(
            self, ctx: Any, *, call: Any, tool_def: Any, args: Any, handler: Any
        ) -> Any:
            # its start is durable before it runs (write-ahead, semantics §17.1): a crash
            # while it runs makes it unknown, never silently run twice; the tool gets its
            # key (``tether.current_call_id()``, an MCP request's, a spawn's)
            turn = self.turn
            key = turn.rerun.pop(call.tool_call_id, None)
            if key is None:
                key = await turn.ctx.begin_call(
                    call.tool_name, call.args_as_json_str(), call.tool_call_id
                )
            turn.keys[call.tool_call_id] = key
            with spans.tool(call.tool_name, call_id=call.tool_call_id) as span, calling(key):
                return await self._execute(call, args, handler, span)

        async def _execute(self, call: Any, args: Any, handler: Any, span: spans.Span) -> Any:
            turn = self.turn
            if call.tool_name in turn.cfg.tools or call.tool_name.startswith("mcp__"):
                # a Tether or MCP tool: preemptable already (``ctx.call_tool``, the MCP
                # call); its entry is written as its call returns, in the same step as
                # its stop report closes it
                result = await handler(args)
                if isinstance(result, str) and result.startswith("preempted after "):
                    turn.preempted.add(call.tool_call_id)
                    span.fail("preempted", result.partition("\n")[0])
                turn.result(call, result)
                return result

            async def run() -> Any:
                # the entry is written the moment the tool returns, and the stop report
                # says ``returned`` exactly when it was: a cancel landing as it returns
                # (a resume that wakes both) cannot leave one without the other
                try:
                    result = await handler(args)
                except ToolRetryError as exc:  # a retry asked for: its result all the same
                    turn.returned(exc.tool_retry)
                    raise
                except ToolFailedError as exc:
                    turn.returned(exc.tool_failed)
                    raise
                turn.result(call, result)
                return result

            def fate() -> str | None:
                return "returned" if call.tool_call_id in turn.recorded else None

            try:
                return await turn.ctx.preemptable(call.tool_name, run(), fate=fate)
            except Preempted as exc:
                turn.preempted.add(call.tool_call_id)
                span.fail("preempted", exc.reason or exc.message)
                text = _preempted_text(exc)
                turn.result(call, text)
                return text

    return Stops


class _LazyStops:
    cls: type[Any] | None = None


def _Stops(turn: _Turn) -> Any:
    if _LazyStops.cls is None:
        _LazyStops.cls = _make_stops()
    return _LazyStops.cls(turn)
