"""``tether.adapters.openai_agents:OpenAIAgentsAgent``: an OpenAI Agents SDK agent as a
Tether async driver, extra ``tether-runtime[openai-agents]``.

Config and behaviour: docs/adapters-openai_agents.md; where steers, cancels and preempts
enter the SDK's run: docs/design.md, section 12.3.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import agents
import openai
from agents import FunctionTool, Model, ModelSettings, OpenAIChatCompletionsModel
from agents.exceptions import AgentsException
from agents.models.multi_provider import MultiProvider

from tether.adapters._factory import check_factory
from tether.agents.chat import (
    ModelError,
    _Config,
    _cut_usage,
    _describe,
    _host_schemas,
    _idempotent,
    _max_duration,
    _mcp_call,
    _mcp_tools,
    _Model,
    _one_line,
    _preempted_text,
    _replayed,
    _result_text,
    openai_client,
)
from tether.agents.chat import _config as _chat_config
from tether.agents.drain import settle
from tether.driver.async_context import AsyncTurnContext
from tether.driver.calls import calling
from tether.telemetry import spans
from tether.wire.errors import InvalidParams, Preempted, TetherError
from tether.wire.frames import Steer
from tether.wire.records import Entry, Recovered
from tether.wire.text import unknown_call_text

__all__ = ["OpenAIAgentsAgent"]

_UNWIND = 5.0  # seconds a cancelled run's task may take to close its stream
_NO_RESULT = "(no result: stopped)"


class OpenAIAgentsAgent:
    """An ``agents.Agent`` run as a Tether turn: ``rt.open_session(
    "tether.adapters.openai_agents:OpenAIAgentsAgent", config={"agent": "pkg.mod:factory",
    "model": {...}, "tools": [...]})``."""

    # A turn a crash interrupted runs on from its input list (semantics §17.1).
    recoverable = True

    @staticmethod
    def check_config(config: dict[str, Any]) -> None:
        """At open and spawn, in a worker: the config the turn will read (its _parse),
        and the ``agent`` factory imports (else ``driver-not-found``, before any turn)."""
        _parse(config)
        check_factory(config)

    async def run(self, ctx: AsyncTurnContext) -> str | None:
        agents.set_tracing_disabled(True)  # no trace export: offline, and not ours to send
        try:
            cfg, spec = _parse(ctx.config)
            agent = _factory(spec)(dict(ctx.config))
            if not isinstance(agent, agents.Agent):
                raise InvalidParams(f"config.agent: {spec} returned {type(agent).__name__}")
        except TetherError as exc:
            raise ModelError(_one_line(exc.message)) from None
        turn = _Run(ctx, cfg)
        agent = await turn.prepare(agent, model="model" in ctx.config)
        history = await ctx.load_history()
        if ctx.recovered is None:
            items = _input_items(history, ctx)
        else:
            recovered = await turn.recovered(agent, history, ctx.recovered)
            if recovered is None:
                return None  # its final reply was durable: it is the turn's final text
            items = recovered
        result = agents.Runner.run_streamed(
            agent,
            items,
            max_turns=cfg.max_steps,
            run_config=agents.RunConfig(
                call_model_input_filter=turn.take_steers, tracing_disabled=True
            ),
        )
        try:
            async for _ in result.stream_events():
                pass  # the entries are written in the SDK's task, as things happen
        except asyncio.CancelledError:
            # The SDK's loop is a task of its own: let it take what the worker has read
            # of the stream (the cut keeps it), stop it, and wait for it to unwind so
            # that the stream's connection is closed before the turn's end is reported.
            await settle(turn.progress)
            result.cancel("immediate")
            task = result.run_loop_task
            if task is not None:
                await asyncio.wait([task], timeout=_UNWIND)
            turn.keep_partial()
            if ctx.cancel is None:
                raise  # not this turn's cancel
            return None  # the partial reply, kept, is the turn's final text
        except Exception as exc:
            raise _model_error(exc, cfg.model.retries) from None
        return None  # the last reply, said already, is the turn's final text


@dataclass
class _Run:
    """One turn's bookkeeping, shared by the SDK's task (model, tools, filter) and the
    driver's (a cancel)."""

    ctx: AsyncTurnContext
    cfg: _Config
    partial: str = ""  # the text of the reply streaming now
    events: int = 0  # streamed events seen: what a cancel's drain watches move
    steers: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (place, msg)
    asked: list[dict[str, Any]] = field(default_factory=list)  # the last reply's calls
    # The request sent now (``stream_response``'s arguments), and the one whose answer
    # began but has not ended: what it cost if it is cut, with the characters it streamed
    sending: dict[str, Any] | None = None
    open: dict[str, Any] | None = None
    streamed: int = 0
    mcp: Any = None  # the config's MCP tools (McpTools), if any
    rerun: dict[str, str] = field(default_factory=dict)  # an idempotent unknown call: its key

    async def recovered(
        self, agent: Any, history: list[Entry], recovered: Recovered
    ) -> list[Any] | None:
        """A recovered turn's input list, from its last durable step (semantics §17.1):
        this turn's durable items after its message, and an output for each call of its
        last reply with none (the SDK's saved state holds no running call): a call that
        never started runs now; one that started is unknown (the model is told so, as
        its output), unless its policy says it is idempotent: then it runs again with
        the same call key. None if its final reply was durable."""
        ctx = self.ctx
        items = _replayed(history, ctx, _said, own=True)
        mine = [e for e in history if e.turn == ctx.turn]
        last = next(
            (
                i
                for i in range(len(mine) - 1, -1, -1)
                if mine[i].kind == "assistant" and (mine[i].data or {}).get("input_items")
            ),
            None,
        )
        if last is None:
            return _paired(items)  # the request in flight is sent again
        calls = (mine[last].data or {}).get("tool_calls") or []
        if not calls:
            return None
        self.asked = calls
        answered = {
            (e.data or {}).get("tool_call_id") for e in mine[last + 1 :] if e.kind == "tool"
        }
        for call in calls:
            call_id, fn = call["id"], call["function"]
            if call_id in answered:
                continue
            unknown = next((c for c in recovered.unknown_calls if c.tool_call_id == call_id), None)
            if unknown is not None and not _idempotent(self.cfg, self.mcp, fn["name"]):
                text = unknown_call_text(recovered.cause)
                item = {"type": "function_call_output", "call_id": call_id, "output": text}
                data = {"tool_call_id": call_id, "name": fn["name"], "arguments": fn["arguments"]}
                extra = {"call": unknown.key, "unknown": True, "input_items": [item]}
                ctx.record_tool(text, data={**data, **extra})
            else:  # it never started, or it may run again: it runs now
                if unknown is not None:
                    self.rerun[call_id] = unknown.key
                text = await self._run_now(agent, fn["name"], call_id, fn["arguments"])
            items.append({"type": "function_call_output", "call_id": call_id, "output": text})
        return _paired(items)

    async def _run_now(self, agent: Any, name: str, call_id: str, arguments: str) -> str:
        """Run one of the agent's function tools outside the SDK's loop, as the loop would
        (its entry written by the tool's wrapper); a tool it lacks (a handoff) is not run."""
        from agents.tool_context import ToolContext

        tool = next(
            (t for t in agent.tools if isinstance(t, FunctionTool) and t.name == name), None
        )
        if tool is None:
            item = {"type": "function_call_output", "call_id": call_id, "output": _NO_RESULT}
            data = {"tool_call_id": call_id, "name": name, "arguments": arguments}
            self.ctx.record_tool(_NO_RESULT, data={**data, "input_items": [item]})
            return _NO_RESULT
        tc = ToolContext(
            context=None,
            tool_name=name,
            tool_call_id=call_id,
            tool_arguments=arguments,
            agent=agent,
        )
        out = await tool.on_invoke_tool(tc, arguments)
        return out if isinstance(out, str) else json.dumps(out, default=str)

    async def prepare(self, agent: Any, *, model: bool) -> Any:
        """The factory's agent with this session's model, usage asked for in streams,
        every function tool preemptable and recorded, and Tether's tools added; every
        agent it can hand off to watched the same way (its own tools only)."""
        seen: dict[int, Any] = {}
        top = await self._watched(agent, model=model, seen=seen)
        extra = [self._host_tool(s["function"]) for s in _host_schemas()]
        extra = [t for t in extra if t is not None]
        extra.extend(await self._mcp_tools())
        top.tools = [*top.tools, *extra]
        return top

    async def _watched(self, agent: Any, *, model: bool, seen: dict[int, Any]) -> Any:
        """One agent, watched: its model observed, its function tools preemptable and
        recorded, and its handoffs' agents too (a handoff target runs the same loop, so
        a stop must reach it). ``seen`` ends a cycle of agents handing off to each other."""
        done = seen.get(id(agent))
        if done is not None:
            return done
        if model:
            inner: Any = OpenAIChatCompletionsModel(
                model=self.cfg.model.name, openai_client=_client(self.cfg.model)
            )
        elif isinstance(agent.model, str) or agent.model is None:
            inner = MultiProvider().get_model(agent.model)
        else:
            inner = agent.model
        settings = agent.model_settings
        if settings.include_usage is None:  # the SDK asks a non-OpenAI endpoint for none
            settings = settings.resolve(ModelSettings(include_usage=True))
        tools = [self._own(t) for t in agent.tools]
        name = str(getattr(inner, "model", None) or agent.model or "default")
        observed = _Observed(inner, self, name)
        clone = agent.clone(model=observed, model_settings=settings, tools=tools)
        seen[id(agent)] = clone
        clone.handoffs = [await self._handoff(h, model=model, seen=seen) for h in agent.handoffs]
        return clone

    async def _handoff(self, target: Any, *, model: bool, seen: dict[int, Any]) -> Any:
        if isinstance(target, agents.Agent):
            # the handoff the SDK would make of the agent, made here so it is recorded
            return self._recorded_handoff(
                agents.handoff(await self._watched(target, model=model, seen=seen))
            )
        if not isinstance(target, agents.Handoff):
            return target
        invoke = target.on_invoke_handoff

        async def watched(tc: Any, arguments: str) -> Any:
            # a custom handoff makes its agent when it is taken: watched then
            return await self._watched(await invoke(tc, arguments), model=model, seen=seen)

        return self._recorded_handoff(dataclasses.replace(target, on_invoke_handoff=watched))

    def _recorded_handoff(self, target: Any) -> Any:
        """A handoff whose call, once taken, has its ``tool`` entry with the result the
        SDK gives the model (its transfer message), so later turns read that result."""
        invoke = target.on_invoke_handoff

        async def recorded(tc: Any, arguments: str) -> Any:
            agent = await invoke(tc, arguments)
            # the SDK hands the call's id to none of a handoff's callbacks: it takes the
            # first handoff call of the reply, the first one by this name
            call_id = next(
                (c["id"] for c in self.asked if c["function"]["name"] == target.tool_name), ""
            )
            text = target.get_transfer_message(agent)
            item = {"type": "function_call_output", "call_id": call_id, "output": text}
            data = {"tool_call_id": call_id, "name": target.tool_name, "arguments": arguments}
            self.ctx.record_tool(text, data={**data, "input_items": [item]})
            return agent

        return dataclasses.replace(target, on_invoke_handoff=recorded)

    # ---- steers: the SDK's model-input filter, before every model request -----------

    async def take_steers(self, data: Any) -> Any:
        frames = await self.ctx.checkpoint()
        model_data = data.model_data
        base = list(model_data.input)
        for f in frames:
            if isinstance(f, Steer):
                self.steers.append((len(base), {"role": "user", "content": f.render()}))
        # The filter's additions are not kept by the SDK: a steer taken earlier in the run
        # goes back in at its place in every later request.
        model_data.input = self.with_steers(base)
        return model_data

    def with_steers(self, items: list[Any]) -> list[Any]:
        out: list[Any] = []
        pending = list(self.steers)
        for i, item in enumerate(items):
            while pending and pending[0][0] <= i:
                out.append(pending.pop(0)[1])
            out.append(item)
        out.extend(msg for _, msg in pending)
        return out

    # ---- replies -------------------------------------------------------------------

    def on_event(self, event: Any) -> None:
        """One streamed event of a model reply (in the SDK's task, as it arrives)."""
        self.events += 1
        self.ctx.progress()
        kind = getattr(event, "type", "")
        if self.open is None:  # the request's answer began: it costs from here on
            self.open, self.streamed = self.sending, 0
        if kind == "response.created":
            self.partial = ""
        elif kind == "response.output_text.delta":
            self.partial += event.delta
            self.streamed += len(event.delta)
        elif kind == "response.function_call_arguments.delta":
            self.streamed += len(event.delta)
        elif kind == "response.output_item.added":
            self.streamed += len(getattr(event.item, "name", None) or "")
        elif kind == "response.completed":
            self.partial = ""
            self.open = None
            self._reply(event.response)

    def _reply(self, response: Any) -> None:
        usage = _usage(getattr(response, "usage", None))
        items = [o.model_dump(exclude_unset=True, mode="json") for o in response.output]
        text = _output_text(items)
        calls = self.asked = _function_calls(items)
        if not text and not calls:
            if usage is not None:
                self.ctx.add_usage(usage)
            return
        data: dict[str, Any] = {"input_items": items}
        if calls:
            data["tool_calls"] = calls
        self.ctx.say(text, data=data, usage=usage)  # the usage rides with the reply

    def progress(self) -> int:
        return self.events

    def keep_partial(self) -> None:
        """A cut reply: what arrived is kept (``cut``), as ChatAgent keeps it, and its
        request counted."""
        usage = self._cut_usage()
        if self.partial:
            self.ctx.say(self.partial, data={"cut": True}, usage=usage)
            self.partial = ""
        elif usage is not None:
            self.ctx.add_usage(usage)

    def _cut_usage(self) -> dict[str, int | bool] | None:
        """What the request whose answer was cut cost, at least (semantics §15.2): the
        SDK's stream reports usage only with its end, so estimates (None: no answer had
        begun)."""
        sent, self.open = self.open, None
        if sent is None:
            return None
        return _cut_usage(0, 0, lambda: _sent(sent), self.streamed)

    # ---- tools ---------------------------------------------------------------------

    def _own(self, tool: Any) -> Any:
        """The agent's own function tool, preemptable and recorded; other tools as they are."""
        if not isinstance(tool, FunctionTool):
            return tool
        invoke = tool.on_invoke_tool
        name = tool.name
        policy = self.cfg.tool_policy.get(name) or {}

        async def run(tc: Any, arguments: str) -> Any:
            return await self.ctx.preemptable(
                name, invoke(tc, arguments), preempt=policy.get("preempt", "cooperative")
            )

        wrapped = copy.copy(tool)
        wrapped.on_invoke_tool = self._recorded(name, run)
        return wrapped

    def _host_tool(self, schema: dict[str, Any]) -> Any:
        """One of Tether's agent tools (``spawn_agent`` & co), if the config asks for it."""
        name = schema["name"]
        if name not in self.cfg.tools:
            return None

        async def run(tc: Any, arguments: str) -> str:
            return _result_text(await self.ctx.call_tool(name, arguments))

        return FunctionTool(
            name=name,
            description=schema.get("description", ""),
            params_json_schema=schema["parameters"],
            on_invoke_tool=self._recorded(name, run),
            strict_json_schema=False,
        )

    async def _mcp_tools(self) -> list[Any]:
        mcp = self.mcp = await _mcp_tools(self.ctx, self.cfg)
        if mcp is None:
            return []
        offered, missing = await mcp.offered()
        if len(missing) == len(mcp.servers):
            raise ModelError(_one_line("config.mcp: " + "; ".join(missing.values())))
        for server, why in missing.items():
            self.ctx.record_tool(why, data={"mcp_unavailable": server})
        out = []
        for schema in offered:
            fn = schema["function"]

            def make(name: str) -> Callable[[Any, str], Awaitable[str]]:
                async def run(tc: Any, arguments: str) -> str:
                    return await _mcp_call(self.ctx, mcp, name, arguments)

                return run

            out.append(
                FunctionTool(
                    name=fn["name"],
                    description=fn.get("description") or "",
                    params_json_schema=fn.get("parameters") or {"type": "object"},
                    on_invoke_tool=self._recorded(fn["name"], make(fn["name"])),
                    strict_json_schema=False,
                )
            )
        return out

    def _recorded(
        self, name: str, run: Callable[[Any, str], Awaitable[Any]]
    ) -> Callable[[Any, str], Awaitable[Any]]:
        """A tool call as ChatAgent runs one: its start durable before it runs (the
        write-ahead, semantics §17.1) and its key given to it, a ``max_duration`` policy,
        the honest preempted result, one ``tool`` entry (with its SDK input item and its
        key) per call."""

        async def invoke(tc: Any, arguments: str) -> Any:
            call_id = str(getattr(tc, "tool_call_id", "") or "")
            key = self.rerun.pop(call_id, None)
            if key is None:
                key = await self.ctx.begin_call(name, arguments, call_id or None)
            data: dict[str, Any] = {
                "tool_call_id": call_id,
                "name": name,
                "arguments": arguments,
                "call": key,
            }
            timer = _max_duration(self.ctx, self.cfg, name)
            try:
                with spans.tool(name, call_id=call_id or None) as span, calling(key):
                    span.content("gen_ai.tool.call.arguments", arguments)
                    out = await run(tc, arguments)
            except Preempted as exc:
                out = _preempted_text(exc)
                data["preempted"] = True
            finally:
                if timer is not None:
                    timer.cancel()
            text = out if isinstance(out, str) else json.dumps(out, default=str)
            item = {"type": "function_call_output", "call_id": call_id, "output": text}
            self.ctx.record_tool(text, data={**data, "input_items": [item]})
            return out

        return invoke


class _Observed(Model):
    """The agent's model, watched: every streamed event goes through ``_Run.on_event`` in
    the SDK's task as it arrives (progress, the partial text, the reply's entry)."""

    def __init__(self, inner: Any, run: _Run, name: str) -> None:
        self._inner = inner
        self._run = run
        self._name = name  # the model's name, for its requests' spans

    async def close(self) -> None:
        await self._inner.close()

    def get_retry_advice(self, request: Any) -> Any:
        return self._inner.get_retry_advice(request)

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        with spans.chat("openai", self._name) as span:
            response = await self._inner.get_response(*args, **kwargs)
            _answered(span, response)
        self._run._reply(response)
        return response

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        self._run.sending = dict(zip(_STREAM_ARGS, args, strict=False)) | kwargs
        self._run.open = None  # an earlier answer that broke off is the SDK's to retry
        # a span opened and ended by hand: an async generator may be closed elsewhere
        span = spans.open_chat("openai", self._name)
        try:
            async for event in self._inner.stream_response(*args, **kwargs):
                self._run.on_event(event)
                if getattr(event, "type", "") == "response.completed":
                    _answered(span, event.response)
                yield event
        except BaseException as exc:
            span.end(exc)
            raise
        span.end()


def _answered(span: spans.Span, response: Any) -> None:
    """What a model request's span records of a whole response."""
    usage = getattr(response, "usage", None)
    if usage is not None:
        span.usage(usage.input_tokens, usage.output_tokens)
    output = list(getattr(response, "output", None) or ())
    calls = any(getattr(o, "type", "") == "function_call" for o in output)
    span.finish(["tool_calls" if calls else "stop"])
    if spans.content():
        span.content("gen_ai.output.messages", [o.model_dump(mode="json") for o in output])


def _parse(raw: dict[str, Any]) -> tuple[_Config, str]:
    spec = raw.get("agent")
    if not isinstance(spec, str) or ":" not in spec:
        raise InvalidParams("config.agent: give the agent's factory as 'pkg.module:name'")
    return _chat_config({k: v for k, v in raw.items() if k != "agent"}), spec


def _factory(spec: str) -> Callable[[dict[str, Any]], Any]:
    module, _, name = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise InvalidParams(f"config.agent: cannot load {spec}: {exc}") from None
    if not callable(found):
        raise InvalidParams(f"config.agent: {spec} is not callable")
    return found  # type: ignore[no-any-return]


def _client(model: _Model) -> Any:
    # the client's own backoff: the SDK retries nothing
    return openai_client(
        base_url=model.base_url,
        api_key_env=model.api_key_env,
        timeout=model.timeout,
        retries=model.retries,
        headers=model.headers,
    )


def _model_error(exc: Exception, retries: int) -> Exception:
    if isinstance(exc, openai.APIStatusError | openai.APIConnectionError):
        return ModelError(_describe(exc, retries))
    if isinstance(exc, AgentsException):
        return ModelError(_one_line(f"{type(exc).__name__}: {exc}"))
    return exc


def _output_text(items: list[dict[str, Any]]) -> str:
    """The text of a reply's message items."""
    return "".join(
        part.get("text", "")
        for o in items
        if o.get("type") == "message"
        for part in o.get("content") or ()
        if part.get("type") == "output_text"
    )


def _function_calls(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's function calls, as ChatAgent's transcript spells tool calls."""
    return [
        {
            "id": o["call_id"],
            "type": "function",
            "function": {"name": o["name"], "arguments": o.get("arguments", "")},
        }
        for o in items
        if o.get("type") == "function_call"
    ]


def _input_items(history: list[Entry], ctx: AsyncTurnContext) -> list[Any]:
    """The run's input list: earlier turns' entries (each reply and tool result carries
    its SDK input items), their steers where they were taken, and this turn's message."""
    return _paired(_replayed(history, ctx, _said))


def _said(e: Entry, data: dict[str, Any]) -> list[Any]:
    """A reply or a tool result as the SDK's input items it carries; a cut reply (none
    carried) as its text."""
    if data.get("input_items"):
        return list(data["input_items"])
    if e.kind == "assistant" and e.text:
        return [{"role": "assistant", "content": e.text}]
    return []


def _paired(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every function call answered before the next message, as the chat API requires: a
    call left without a result (its turn was stopped) gets one saying so; a result with
    no call before it is dropped."""
    out: list[dict[str, Any]] = []
    open_ids: list[str] = []

    def close() -> None:
        for call_id in open_ids:
            out.append({"type": "function_call_output", "call_id": call_id, "output": _NO_RESULT})
        open_ids.clear()

    for item in items:
        kind = item.get("type")
        if kind == "function_call_output":
            if item.get("call_id") in open_ids:
                open_ids.remove(item["call_id"])
                out.append(item)
            continue
        if kind == "function_call":
            open_ids.append(str(item.get("call_id")))
        else:
            close()
        out.append(item)
    close()
    return out


# ``Model.stream_response``'s leading arguments, by name: what a request sends
_STREAM_ARGS = (
    "system_instructions",
    "input",
    "model_settings",
    "tools",
    "output_schema",
    "handoffs",
)


def _sent(request: dict[str, Any]) -> str:
    """A request's instructions, input items and tool schemas about as the wire carries
    them (JSON), for the estimate of a cut reply's prompt."""
    tools = [
        {
            "name": getattr(t, "name", None) or getattr(t, "tool_name", ""),
            "description": getattr(t, "description", None) or getattr(t, "tool_description", ""),
            "parameters": getattr(t, "params_json_schema", None)
            or getattr(t, "input_json_schema", None),
        }
        for t in [*(request.get("tools") or ()), *(request.get("handoffs") or ())]
    ]
    sent = [request.get("system_instructions") or "", request.get("input") or "", tools]
    return json.dumps(sent, ensure_ascii=False, default=str)


def _usage(usage: Any) -> dict[str, int] | None:
    """A reply's token counts as ``ctx.add_usage`` takes them (None: it has none)."""
    if usage is None or not (usage.input_tokens or usage.output_tokens):
        return None
    return {
        "prompt_tokens": int(usage.input_tokens or 0),
        "completion_tokens": int(usage.output_tokens or 0),
    }
