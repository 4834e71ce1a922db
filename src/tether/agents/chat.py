"""``tether.agents:ChatAgent``: a model agent over any OpenAI-compatible endpoint.

An async driver over the official client (``openai.AsyncOpenAI``, streaming). Its loop and
what each stop does to it: docs/design.md, section 12.1; its config and promises:
docs/semantics.md section 15.2.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from tether.agents.drain import drained
from tether.agents.mcp import McpTimeout, McpTools
from tether.agents.mcp._config import resolve_policy
from tether.driver.async_context import AsyncTurnContext
from tether.driver.calls import calling
from tether.driver.disposal import on_disposed
from tether.driver.toolenv import model_key
from tether.driver.tools import TOOLS, schemas
from tether.telemetry import spans
from tether.wire.errors import InvalidParams, Preempted, TetherError
from tether.wire.frames import Cancel, Preempt, Steer
from tether.wire.records import Entry, Stop, UnknownCall
from tether.wire.text import neutralize, render_frame, unknown_call_text, who

__all__ = ["ChatAgent", "ModelError", "openai_client"]

log = structlog.get_logger("tether.agents.chat")

_DEFAULT_STEPS = 50
_M = TypeVar("_M")  # a model dataclass: ChatAgent's, an adapter's
_MCP_GRACE = 5.0  # seconds a stopped MCP call may take to end (config.mcp.grace)
_RESULT_CAP = 20_000  # characters of one tool result sent to the model
_ERROR_CAP = 300  # characters of a one-line error


class ModelError(TetherError):
    """The model endpoint refused the request for good (not retried), or kept failing."""

    code = "model-error"


@dataclass
class _Model:
    base_url: str | None = None
    name: str = "default"
    api_key_env: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    timeout: float = 600.0
    retries: int = 3
    backoff: float = 0.5  # seconds before the first retry, doubling (capped at 30)
    headers: dict[str, str] = field(default_factory=dict)
    # {"input_per_mtok", "output_per_mtok"}: dollars per million tokens; the turn's
    # context prices each response's usage with it, for the tree's budget (semantics §16.2).
    price: dict[str, float] | None = None


@dataclass
class _Config:
    model: _Model
    system: str | None = None
    tools: list[str] = field(default_factory=list)
    mcp: dict[str, Any] | None = None
    tool_policy: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_steps: int = _DEFAULT_STEPS


def _check_model_keys(given: dict[str, Any], known: Collection[str]) -> None:
    """A ``config.model``'s keys (ChatAgent's, an adapter's): never an API key itself,
    and none its model does not know (``known``)."""
    if "api_key" in given:  # never: a key in the config would be stored
        raise InvalidParams("config.model: give api_key_env, never the key itself")
    unknown = set(given) - set(known)
    if unknown:
        raise InvalidParams(f"config.model: unknown keys {sorted(unknown)}")


def _object(where: str, value: Any) -> dict[str, Any]:
    """``value`` as a JSON object (absent: empty); else InvalidParams naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParams(f"{where} must be an object")
    return dict(value)


def _str(where: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidParams(f"{where} must be a string")
    return value


def _number(where: str, value: Any) -> float | None:
    # bool is an int to Python, never a number in a config
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise InvalidParams(f"{where} must be a number")
    return None if value is None else float(value)


def _int(where: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidParams(f"{where} must be an integer")
    return value


def _names(where: str, value: Any, what: str) -> list[str] | None:
    """A list of strings; a string is refused, never read as its characters."""
    if value is not None and (
        not isinstance(value, list) or not all(isinstance(v, str) for v in value)
    ):
        raise InvalidParams(f"{where} must be a list of {what}")
    return None if value is None else list(value)


def _str_map(where: str, value: Any) -> dict[str, str]:
    given = _object(where, value)
    if not all(isinstance(v, str) for v in given.values()):
        raise InvalidParams(f"{where} must map names to strings")
    return given


def _price(where: str, value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    given = _object(where, value)
    out: dict[str, float] = {}
    for k, v in given.items():
        number = _number(f"{where}.{k}", v)
        if number is None:
            raise InvalidParams(f"{where}.{k} must be a number")
        out[k] = number
    return out


# The type check of each model key (ChatAgent's and the adapters' models share them)
_MODEL_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "base_url": _str,
    "name": _str,
    "api_key_env": _str,
    "temperature": _number,
    "max_tokens": _int,
    "timeout": _number,
    "retries": _int,
    "backoff": _number,
    "headers": _str_map,
    "price": _price,
}


def _model(raw: Any, cls: type[_M]) -> _M:
    """``config.model`` as ``cls`` (a model dataclass), each key's type checked; a
    mistake is an InvalidParams naming the key."""
    given = _object("config.model", raw)
    _check_model_keys(given, cls.__dataclass_fields__)  # type: ignore[attr-defined]
    checked = {k: _MODEL_CHECKS[k](f"config.model.{k}", v) for k, v in given.items()}
    # null: the default, as if the key were absent
    return cls(**{k: v for k, v in checked.items() if v is not None})


def _check_mcp(mcp: dict[str, Any], policy: dict[str, Any]) -> None:
    """The MCP servers and tool policies parsed as the turn's McpTools will (no server is
    started), so that their mistakes are refused at open too."""
    try:
        McpTools(mcp.get("servers") or {}, policies=policy, grace=mcp.get("grace", _MCP_GRACE))
    except TetherError as exc:
        raise InvalidParams(f"config.mcp: {exc.message}") from None


def _config(raw: dict[str, Any]) -> _Config:
    """The session config, checked: a mistake is a one-line ``InvalidParams`` naming the
    field. ChatAgent.check_config runs it at open, the turn at its start."""
    m = _model(raw.get("model"), _Model)
    tools = _names("config.tools", raw.get("tools"), "tool names") or []
    steps = _int("config.max_steps", raw.get("max_steps"))
    steps = _DEFAULT_STEPS if steps is None else steps
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise InvalidParams(f"config.tools: unknown tools {bad}; tools: {', '.join(TOOLS)}")
    if steps < 1:
        raise InvalidParams("config.max_steps must be at least 1")
    mcp = _object("config.mcp", raw.get("mcp")) if raw.get("mcp") is not None else None
    policy = _object("config.tool_policy", raw.get("tool_policy"))
    for name, rule in policy.items():
        _object(f"config.tool_policy.{name}", rule)
    _check_mcp(mcp or {}, policy)
    return _Config(
        model=m,
        system=_str("config.system", raw.get("system")),
        tools=tools,
        mcp=mcp,
        tool_policy=policy,
        max_steps=steps,
    )


@dataclass
class _Reply:
    text: str = ""
    calls: dict[int, dict[str, str]] = field(default_factory=dict)  # index -> id, name, args
    finish: str | None = None
    usage: tuple[int, int] | None = None  # prompt, completion tokens, as the stream said
    chunks: int = 0  # how many the stream gave: what a cancel's drain watches move

    def progress(self) -> int:
        return self.chunks

    def tool_calls(self) -> list[dict[str, Any]]:
        return [
            {
                "id": c.get("id") or f"call_{i}",
                "type": "function",
                "function": {"name": c.get("name", ""), "arguments": c.get("arguments", "")},
            }
            for i, c in sorted(self.calls.items())
        ]

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.calls:
            out["tool_calls"] = self.tool_calls()
        return out


class ChatAgent:
    """A model agent: ``rt.open_session("tether.agents:ChatAgent", config={...})``.

    Config (semantics §15.2): ``model`` {``base_url``, ``name``, ``api_key_env``,
    ``temperature``, ``max_tokens``, ``timeout``, ``retries``, ``backoff``, ``headers``},
    ``system``, ``tools`` (the host tools it may call: ``run_command``, ``spawn_agent``,
    ``send_message``, ``list_agents``, ``interrupt_agent``, ``pause_agent``,
    ``resume_agent``), ``mcp`` {``servers``}, ``tool_policy``, ``max_steps``.
    """

    # A turn a crash interrupted runs on from its last durable step (semantics §17.1).
    recoverable = True
    # The offered tools' argument schemas, by name: set by each turn (never changed in place).
    _schemas: dict[str, dict[str, Any]] = {}  # noqa: RUF012

    @staticmethod
    def check_config(config: dict[str, Any]) -> None:
        """At open and spawn, in a worker: the config the turn will read (its _config)."""
        _config(config)

    async def run(self, ctx: AsyncTurnContext) -> str | None:
        try:
            cfg = _config(ctx.config)
            client = _client(cfg.model)
        except TetherError as exc:
            raise ModelError(_one_line(exc.message)) from None
        try:
            return await self._loop(ctx, cfg, client)
        except asyncio.CancelledError:
            if ctx.cancel is None:
                raise  # not this turn's cancel
            # The partial reply (if a stream was cut) is already the last assistant
            # entry: the turn ends cancelled with it as its final text.
            return None

    async def _loop(self, ctx: AsyncTurnContext, cfg: _Config, client: Any) -> str | None:
        mcp = await _mcp_tools(ctx, cfg)
        tools = [t for t in _host_schemas() if t["function"]["name"] in cfg.tools]
        self._schemas = _schemas_of(tools)
        missing: dict[str, str] = {}
        if mcp is not None:
            offered, missing = await mcp.offered()
            if len(missing) == len(mcp.servers):  # nothing of the config works: a mistake
                raise ModelError(_one_line("config.mcp: " + "; ".join(missing.values())))
            tools.extend(offered)
            self._schemas = _schemas_of(tools)
            for server, why in missing.items():
                # in the transcript, never in the model's history (no tool_call_id)
                ctx.record_tool(why, data={"mcp_unavailable": server})
        history = await ctx.load_history()
        raw = _replayed_with_system(cfg, history, ctx)
        done = 0
        if ctx.recovered is not None:
            mine = [e for e in history if e.turn == ctx.turn]
            done = sum(1 for e in mine if e.kind == "assistant")
            last = next((e for e in reversed(mine) if e.kind == "assistant"), None)
            if last is not None and not _calls_of(last):
                return None  # its final reply was durable: it is the turn's final text
            for call in _unanswered(mine, last):
                result = await self._recovered_call(ctx, cfg, mcp, call)
                raw.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        messages = _paired(raw)
        if missing:
            _tell_missing(messages, missing)
        for _ in range(max(cfg.max_steps - done, 0)):
            messages.extend(_steers(await ctx.checkpoint()))  # a boundary before each request
            reply = await self._request(ctx, cfg, client, messages, tools)
            messages.append(reply.message())
            if not reply.calls:
                return None  # the reply, said already, is the turn's final text
            steered: list[dict[str, Any]] = []
            for call in reply.tool_calls():
                result = await self._tool(ctx, cfg, mcp, call)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                # a boundary after each tool result; a steer waits until every call of
                # the reply has its result (the API wants them right after the reply)
                steered.extend(_steers(await ctx.checkpoint()))
            messages.extend(steered)
        raise ModelError(f"no final reply within max_steps ({cfg.max_steps}) model requests")

    # ---- the model ----------------------------------------------------------------------

    async def _request(
        self,
        ctx: AsyncTurnContext,
        cfg: _Config,
        client: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> _Reply:
        import openai

        kwargs = _request_kwargs(cfg, messages, tools)
        attempt = 0
        log.debug(
            "model.request",
            turn=ctx.turn,
            model=cfg.model.name,
            base_url=cfg.model.base_url,
            messages=len(messages),
        )
        while True:
            reply = _Reply()
            stream: Any = None

            async def read(reply: _Reply = reply) -> None:
                nonlocal stream
                stream = await client.chat.completions.create(**kwargs)
                async for chunk in stream:
                    reply.chunks += 1
                    ctx.progress()  # every chunk is progress for the stall watchdog
                    _take(ctx, reply, chunk)

            try:
                with spans.chat("openai", cfg.model.name, **_server(cfg.model)) as span:
                    span.content("gen_ai.system_instructions", cfg.system)
                    span.content("gen_ai.input.messages", messages)
                    # a cancel lets the stream parse what the worker had read first
                    await drained(read(), reply.progress)
                    _answered(span, reply)
            except asyncio.CancelledError:
                # a response that began costs what was sent and what streamed, at least
                usage = _usage(reply) if stream is None else _cut(reply, kwargs)
                if reply.text:  # what arrived is kept
                    ctx.say(reply.text, data={"cut": True}, usage=usage)
                elif usage is not None:
                    ctx.add_usage(usage)
                raise
            except (openai.APIConnectionError, openai.APIStatusError) as exc:
                usage = _usage(reply) if stream is None else _cut(reply, kwargs)
                if usage is not None:  # a response that failed after it began
                    ctx.add_usage(usage)
                attempt = await _retry(ctx, cfg, exc, attempt)
                continue
            finally:
                if stream is not None:
                    await stream.close()  # at once on a cancel: the connection goes
            _say_reply(ctx, reply)
            return reply

    # ---- tools --------------------------------------------------------------------------

    async def _recovered_call(
        self, ctx: AsyncTurnContext, cfg: _Config, mcp: Any, call: dict[str, Any]
    ) -> str:
        """A call of the last durable reply with no durable result, on a recovered turn:
        never started, it runs now; started (it may have run), it is unknown, unless its
        policy says it is idempotent: then it runs again with the same call key."""
        assert ctx.recovered is not None
        name = call["function"]["name"]
        unknown = _unknown(ctx.recovered.unknown_calls, call["id"])
        if unknown is None:
            return await self._tool(ctx, cfg, mcp, call)
        if _idempotent(cfg, mcp, name):
            return await self._tool(ctx, cfg, mcp, call, key=unknown.key)
        text = unknown_call_text(ctx.recovered.cause)
        data = {
            "tool_call_id": call["id"],
            "name": name,
            "arguments": call["function"]["arguments"],
            "call": unknown.key,
            "unknown": True,
        }
        ctx.record_tool(text, data=data)
        return text

    async def _tool(
        self,
        ctx: AsyncTurnContext,
        cfg: _Config,
        mcp: Any,
        call: dict[str, Any],
        *,
        key: str | None = None,
    ) -> str:
        """Run one tool call; the text the model gets back (also its ``tool`` entry). Its
        start is durable first (write-ahead): a crash while it runs makes it unknown,
        never silently run twice. ``key``: an idempotent call run again, by its key."""
        name = call["function"]["name"]
        arguments = used = call["function"]["arguments"]
        data: dict[str, Any] = {"tool_call_id": call["id"], "name": name, "arguments": arguments}
        if key is None:
            policy = resolve_policy(cfg.tool_policy, name)
            if policy.approval == "required":
                decided = await ctx.ask_approval(
                    name,
                    arguments,
                    call["id"],
                    schema=self._schemas.get(name),
                    timeout=policy.approval_timeout,
                    approver=policy.approver,
                )
                data["approval"] = decided.approval
                if decided.key is None:  # denied, expired or cancelled: it never runs
                    data["approval_state"] = decided.state
                    ctx.record_tool(decided.text, data=data)
                    return decided.text
                key, used = decided.key, decided.arguments or arguments
                if used != arguments:  # the tool entry records both
                    data["arguments_used"] = used
            else:
                key = await ctx.begin_call(name, arguments, call["id"])
        data["call"] = key
        started = time.monotonic()
        try:
            with spans.tool(name, call_id=call["id"]) as span, calling(key):
                span.content("gen_ai.tool.call.arguments", used)
                text = await self._run_tool(ctx, cfg, mcp, name, used)
                if used != arguments:  # the model is told what ran (docs/semantics.md)
                    text = f"(run with arguments edited at its approval: {used})\n{text}"
                span.content("gen_ai.tool.call.result", text)
        except Preempted as exc:
            text = _preempted_text(exc)
            data["preempted"] = True
        except asyncio.CancelledError:
            stop = ctx.cancel
            if stop is not None:  # the turn's cancel: the call's entry says so
                data["cancelled"] = True
                cut = _cancelled_text(stop, time.monotonic() - started)
                ctx.record_tool(neutralize(cut), data=data)
            raise
        # An MCP server's result or a preempted command's output is read beside Tether's
        # frames as much as a Tether tool's (whose results come neutralized already).
        text = neutralize(text[:_RESULT_CAP])
        ctx.record_tool(text, data=data)
        return text

    async def _run_tool(
        self, ctx: AsyncTurnContext, cfg: _Config, mcp: Any, name: str, arguments: str
    ) -> str:
        if name in cfg.tools:
            timer = _max_duration(ctx, cfg, name)
            try:
                return _result_text(await ctx.call_tool(name, arguments))
            finally:
                if timer is not None:
                    timer.cancel()
        if mcp is not None and name.startswith("mcp__"):
            return await _mcp_call(ctx, mcp, name, arguments)
        offered = [*cfg.tools, *(["mcp__…"] if mcp is not None else [])]
        return json.dumps(
            {"error": "unknown-tool", "message": f"no tool {name!r}; tools: {offered}"}
        )


# One client per endpoint in this worker process, kept across turns on the worker's one
# event loop: its connections are reused (a cut stream's connection is closed, never
# reused). Keyed by what makes a client, the key included: held in memory only.
_clients: dict[tuple[Any, ...], Any] = {}


@functools.cache
def _host_schemas() -> tuple[dict[str, Any], ...]:
    """The host tools' schemas, generated once per worker (a few ms each time)."""
    return tuple(schemas("openai"))


def _client(model: _Model) -> Any:
    # ours: the retries are counted and logged here, so the client retries nothing
    return openai_client(
        base_url=model.base_url,
        api_key_env=model.api_key_env,
        timeout=model.timeout,
        headers=model.headers,
    )


def openai_client(
    *,
    base_url: str | None,
    api_key_env: str | None,
    timeout: float,
    retries: int = 0,
    headers: dict[str, str] | None = None,
) -> Any:
    """The worker's ``openai.AsyncOpenAI`` for an endpoint (ChatAgent's and the adapters'),
    made once and kept; the key read from ``api_key_env`` (``ModelError`` when unset)."""
    import openai

    key = "unused"  # a local server needs none; the client insists on a value
    if api_key_env:
        found = model_key(api_key_env)  # the host's, for this turn: never in the environment
        if not found:
            raise ModelError(f"the environment variable {api_key_env} (api_key_env) is not set")
        key = found
    ident = (base_url, key, timeout, retries, tuple(sorted((headers or {}).items())))
    client = _clients.get(ident)
    if client is None:
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key=key,
            timeout=timeout,
            max_retries=retries,
            default_headers=headers or None,
        )
        _clients[ident] = client
    return client


def _request_kwargs(
    cfg: _Config, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> dict[str, Any]:
    """The chat completion's arguments: a stream, with its usage at the end."""
    # The messages and tools are plain JSON already: they go in ``extra_body``, which
    # the client sends as is. Given as typed params, the client walks them through its
    # TypedDict transform on every request, which costs about a millisecond a message
    # and grows with the history (60+ ms a request after a hundred turns).
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    kwargs: dict[str, Any] = {
        "model": cfg.model.name,
        "messages": [],  # replaced by extra_body's
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": body,
    }
    if cfg.model.temperature is not None:
        kwargs["temperature"] = cfg.model.temperature
    if cfg.model.max_tokens is not None:
        kwargs["max_tokens"] = cfg.model.max_tokens
    return kwargs


async def _retry(ctx: AsyncTurnContext, cfg: _Config, exc: Exception, attempt: int) -> int:
    """A failed request (``attempt`` retries so far): ModelError when it is not to be
    retried, or has been as often as the config allows; else the backoff is waited out
    and the next attempt's number returned."""
    status = getattr(exc, "status_code", None)
    retry = status is None or status == 429 or status >= 500
    if not retry or attempt >= cfg.model.retries:
        raise ModelError(_describe(exc, attempt)) from None
    attempt += 1
    log.info("model.retry", turn=ctx.turn, attempt=attempt, status=status)
    await asyncio.sleep(min(cfg.model.backoff * 2 ** (attempt - 1), 30.0))
    return attempt


def _say_reply(ctx: AsyncTurnContext, reply: _Reply) -> None:
    """A whole reply into the transcript: its text, and its tool calls if any, with
    the response's usage in the same frame (alone when there is nothing to say)."""
    data: dict[str, Any] | None = None
    if reply.calls:
        data = {"tool_calls": reply.tool_calls()}
    if reply.text or data:
        ctx.say(reply.text, data=data, usage=_usage(reply))
    elif reply.usage is not None:
        ctx.add_usage(_usage(reply) or {})


def _usage(reply: _Reply) -> dict[str, int] | None:
    """The response's usage as ``ctx.add_usage`` takes it (None: the stream gave none)."""
    if reply.usage is None:
        return None
    prompt, completion = reply.usage
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def _cut(reply: _Reply, kwargs: dict[str, Any]) -> dict[str, int | bool]:
    """What a response cut before its end cost, at least: see ``_cut_usage``."""
    prompt, completion = reply.usage or (0, 0)
    calls = reply.calls.values()
    streamed = len(reply.text) + sum(len(c["name"]) + len(c["arguments"]) for c in calls)
    return _cut_usage(
        prompt, completion, lambda: json.dumps(kwargs["extra_body"], ensure_ascii=False), streamed
    )


def _tokens_in(chars: int) -> int:
    """About one token per four characters: the estimate where a server gave no count.
    No tokenizer: the exact ones fetch their tables at run time, and a model's own is
    unknown here anyway."""
    return (chars + 3) // 4


def _cut_usage(
    prompt: int, completion: int, sent: Callable[[], str], streamed: int
) -> dict[str, int | bool]:
    """What a response cut before its end (its usage comes at a stream's end) cost, at
    least (semantics §15.2): the prompt as the server counted it for this request
    (``prompt``; 0: it gave none), else about a token per four characters of what was
    sent (``sent()``); the completion as the server counted it, else the same estimate
    of the ``streamed`` characters; ``estimated`` where any of it is an estimate."""
    out: dict[str, int | bool] = {}
    if not prompt:
        prompt = _tokens_in(len(sent()))
        out["estimated"] = True
    if not completion and streamed:
        completion = _tokens_in(streamed)
        out["estimated"] = True
    out["prompt_tokens"] = prompt
    if completion:
        out["completion_tokens"] = completion
    return out


def _server(model: _Model) -> dict[str, Any]:
    """``server.address`` / ``server.port`` of the model endpoint, for its spans."""
    if not model.base_url:
        return {}
    from urllib.parse import urlsplit

    url = urlsplit(model.base_url)
    return {"server.address": url.hostname, "server.port": url.port}


def _answered(span: spans.Span, reply: _Reply) -> None:
    """What the model request's span records of its answer."""
    if reply.usage is not None:
        span.usage(*reply.usage)
    if reply.finish:
        span.finish([reply.finish])
    span.content("gen_ai.output.messages", [reply.message()])


def _take(ctx: AsyncTurnContext, reply: _Reply, chunk: Any) -> None:
    usage = getattr(chunk, "usage", None)
    if usage is not None:
        prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
        completion = int(getattr(usage, "completion_tokens", 0) or 0)
        reply.usage = (prompt, completion)  # counted as the reply is said
    for choice in chunk.choices or ():
        delta = choice.delta
        if delta is not None:
            if delta.content:
                reply.text += delta.content
            for tc in delta.tool_calls or ():
                slot = reply.calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
        if choice.finish_reason:
            reply.finish = choice.finish_reason


def _steers(frames: list[Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f.render()} for f in frames if isinstance(f, Steer)]


def _replayed(
    history: list[Entry],
    ctx: AsyncTurnContext,
    said: Callable[[Entry, dict[str, Any]], list[Any]],
    *,
    own: bool = False,
) -> list[Any]:
    """Earlier turns' entries as a model's input, then this turn's message: a user's
    message, a notice and a steer taken (its marker) are the user's; a reply or a tool
    result is what ``said`` makes of it (the entry and its data) in the API's own items.
    ChatAgent's messages and the Agents SDK adapter's input items; not yet paired.
    ``own``: this turn's steps recorded so far follow its message."""
    out: list[Any] = []
    for e in history:
        if e.turn != ctx.turn:
            out.extend(_item(e, said))
    out.append({"role": "user", "content": ctx.message.content})
    if own:  # this turn's own steps, after its message: a recovered turn's kept ones
        for e in history:
            if e.turn == ctx.turn and e.kind != "user":  # its message is ctx.message
                out.extend(_item(e, said))
    return out


def _item(e: Entry, said: Callable[[Entry, dict[str, Any]], list[Any]]) -> list[Any]:
    match e.kind:
        case "user" | "notice":
            return [{"role": "user", "content": e.text}]
        case "assistant" | "tool":
            return said(e, e.data or {})
        case "marker" if e.action == "steered":
            steer = render_frame("steer", e.origin or "", e.by or "", e.reason or "")
            return [{"role": "user", "content": steer}]
    return []


def _replayed_with_system(
    cfg: _Config, history: list[Entry], ctx: AsyncTurnContext
) -> list[dict[str, Any]]:
    """The request's messages, not yet paired: the system prompt, earlier turns' entries,
    this message, then this turn's own entries (a recovered turn's kept steps)."""
    system = [{"role": "system", "content": cfg.system}] if cfg.system else []
    return system + _replayed(history, ctx, _said, own=True)


def _calls_of(entry: Entry) -> list[dict[str, Any]]:
    data = entry.data or {}
    calls = data.get("tool_calls")
    return [] if data.get("cut") or not isinstance(calls, list) else calls


def _unanswered(mine: list[Entry], last: Entry | None) -> list[dict[str, Any]]:
    """The calls of this turn's last durable reply that have no durable result, in order."""
    if last is None:
        return []
    answered = {
        (e.data or {}).get("tool_call_id") for e in mine if e.kind == "tool" and e.seq > last.seq
    }
    return [c for c in _calls_of(last) if c.get("id") not in answered]


def _unknown(calls: list[UnknownCall], call_id: str) -> UnknownCall | None:
    return next((c for c in calls if c.tool_call_id == call_id), None)


def _idempotent(cfg: _Config, mcp: Any, name: str) -> bool:
    """Whether the tool's policy lets an unknown call of it run again (``idempotent``)."""
    if mcp is not None and name.startswith("mcp__"):
        return bool(mcp.policy(name).idempotent)
    return bool((cfg.tool_policy.get(name) or {}).get("idempotent"))


def _said(e: Entry, data: dict[str, Any]) -> list[Any]:
    """A reply (with its tool calls, unless it was cut) or a tool result, as messages."""
    if e.kind == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": e.text or None}
        if data.get("tool_calls") and not data.get("cut"):
            msg["tool_calls"] = data["tool_calls"]
        return [msg]
    if data.get("tool_call_id"):
        return [{"role": "tool", "tool_call_id": data["tool_call_id"], "content": e.text}]
    return []


def _paired(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every assistant tool call answered right after its reply, as the API requires: a
    call left without a result (its turn was stopped) gets one saying so; a tool result
    with no call before it is dropped. A user message recorded while a reply's calls were
    still running (a steer delivered at the boundary after one of them) waits until the
    last of those calls has its result: where the live request had it too."""
    out: list[dict[str, Any]] = []
    open_ids: list[str] = []
    held: list[dict[str, Any]] = []  # user messages recorded between the open calls

    def close() -> None:
        for missing in open_ids:
            out.append({"role": "tool", "tool_call_id": missing, "content": "(no result: stopped)"})
        open_ids.clear()
        out.extend(held)
        held.clear()

    for m in messages:
        if m["role"] == "tool":
            if m["tool_call_id"] in open_ids:
                open_ids.remove(m["tool_call_id"])
                out.append(m)
                if not open_ids:
                    close()  # the reply's calls all answered: what waited comes now
            continue
        if m["role"] == "user" and open_ids:
            held.append(m)
            continue
        close()
        open_ids.extend(c["id"] for c in m.get("tool_calls") or ())
        out.append(m)
    close()
    return out


def _schemas_of(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each offered tool's argument schema, by the name the model calls it by (an edit
    made at an approval is checked against it)."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


def _result_text(result: dict[str, Any]) -> str:
    return json.dumps(result, ensure_ascii=False)


def _preempted_text(exc: Preempted) -> str:
    if exc.elapsed is None:
        elapsed = "a while"
    else:  # whole seconds, as a person says it; tenths for a short call
        elapsed = f"{exc.elapsed:.0f} s" if exc.elapsed >= 10 else f"{exc.elapsed:.1f} s"
    head = f"preempted after {elapsed} by {who(exc.origin or 'user', exc.by)}"
    if exc.reason:
        head += f": {exc.reason}"
    partial = exc.partial.strip()
    return f"{head}\npartial output:\n{partial}" if partial else head


def _cancelled_text(stop: Cancel, elapsed: float) -> str:
    """The result a call cut by the turn's cancel gets: what a later turn's model reads."""
    took = f"{elapsed:.0f} s" if elapsed >= 10 else f"{elapsed:.1f} s"
    head = f"cancelled after {took} by {who(stop.origin or 'user', stop.by)}"
    return f"{head}: {stop.reason}" if stop.reason else head


def _max_duration(ctx: AsyncTurnContext, cfg: _Config, name: str) -> asyncio.TimerHandle | None:
    """A ``max_duration`` policy for a host tool (``run_command``): a preempt of origin
    ``system`` when the call outlasts it."""
    policy = cfg.tool_policy.get(name) or {}
    limit = policy.get("max_duration")
    if limit is None:
        return None
    why = f"max_duration {float(limit):g} s exceeded"
    frame = Preempt(ctx.turn, Stop("preempt", "system", "policy", why))
    return asyncio.get_running_loop().call_later(float(limit), ctx.preempt_now, frame)


# ---- MCP (tether.agents.mcp) ----------------------------------------------------------

# Per worker process: a config's servers live across turns (and sessions with the same
# config share them), but at most _MCP_SETS configs' servers at once: the least recently
# used set is closed (its stdio trees killed) when another is opened, so configs that
# differ only in an ``env`` or ``cwd`` cannot pile servers up in the worker, where they
# would count against later turns' process limits.
_mcp_cache: OrderedDict[str, McpTools] = OrderedDict()
_MCP_SETS = 4
# The sessions whose turns used each set in this worker (same keys as _mcp_cache): when
# the last of them is disposed, the set is closed at once (``_disposed``), not when the
# LRU bound gets to it.
_mcp_users: dict[str, set[str]] = {}


async def _mcp_tools(ctx: AsyncTurnContext, cfg: _Config) -> McpTools | None:
    mcp = cfg.mcp or {}
    servers = mcp.get("servers")
    if not servers:
        return None
    grace = mcp.get("grace", _MCP_GRACE)
    key = json.dumps([servers, cfg.tool_policy, grace], sort_keys=True)
    tools = _mcp_cache.get(key)
    if tools is not None:
        _mcp_cache.move_to_end(key)
        _mcp_users[key].add(ctx.session)
        return tools
    try:
        tools = McpTools(servers, policies=cfg.tool_policy, grace=grace)
    except TetherError as exc:
        raise ModelError(_one_line(f"config.mcp: {exc.message}")) from None
    while len(_mcp_cache) >= _MCP_SETS:
        # one turn runs in a worker at a time: every other set is idle, none is mid-call
        old, evicted = _mcp_cache.popitem(last=False)
        _mcp_users.pop(old, None)
        await asyncio.shield(evicted.aclose())  # a cancel of this turn must not halve it
    _mcp_cache[key] = tools
    _mcp_users[key] = {ctx.session}
    return tools


@on_disposed
async def _disposed(sessions: list[str]) -> None:
    """Sessions settled for good (the worker runs this between turns): close every set
    that no session left uses, its stdio trees killed. A set another session used
    stays, even if that one is dormant: it may wake."""
    gone = set(sessions)
    closing: list[McpTools] = []
    for key, users in list(_mcp_users.items()):
        if users & gone:
            users -= gone
            if not users:
                del _mcp_users[key]
                closing.append(_mcp_cache.pop(key))
    for tools in closing:
        await tools.aclose()


def _tell_missing(messages: list[dict[str, Any]], missing: dict[str, str]) -> None:
    """Tell the model, one line a server, which MCP servers' tools it lacks this turn and
    why: in the system message (one only: some endpoints refuse a second)."""
    lines = "\n".join(
        f"Unavailable this turn, its tools not offered: {why}" for why in missing.values()
    )
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{lines}"}
    else:
        messages.insert(0, {"role": "system", "content": lines})


async def _mcp_call(ctx: AsyncTurnContext, mcp: McpTools, name: str, arguments: str) -> str:
    """One MCP call as the innermost preemptable await: a preempt or cancel reaches the
    server (``notifications/cancelled``, or the request's stream closed); a policy limit
    stops it as a preempt of origin ``system``."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        return json.dumps({"error": "invalid-params", "message": f"arguments are not JSON: {exc}"})
    if not isinstance(args, dict):
        return json.dumps({"error": "invalid-params", "message": "arguments must be an object"})
    policy = mcp.policy(name)
    started = time.monotonic()
    stops: list[tuple[str, str]] = []  # this call's own (fate, output so far)
    server = name.removeprefix("mcp__").partition("__")[0]
    spans.annotate(**{"mcp.method.name": "tools/call", "tether.mcp.server": server})
    try:
        result = await ctx.preemptable(
            name,
            mcp.call(
                name, args, on_progress=ctx.progress, on_stop=lambda f, p: stops.append((f, p))
            ),
            preempt=policy.preempt,
            fate=lambda: stops[-1][0] if stops else None,
        )
    except Preempted as exc:
        if stops and not exc.partial:
            exc.partial = stops[-1][1]  # the progress notices received: its output so far
        raise
    except McpTimeout as exc:
        limit = policy.max_duration if exc.kind == "max_duration" else policy.idle_timeout
        reason = f"{exc.kind} {limit:g} s exceeded" if limit is not None else exc.kind
        # raised, as a user's preempt is: the tool entry says ``preempted`` either way
        raise ctx.report_preempt(name, reason, started=started, partial=exc.partial) from None
    if result.is_error:
        return json.dumps({"error": "tool-error", "message": result.text})
    return result.text


# ---- errors -------------------------------------------------------------------------


def _one_line(text: str) -> str:
    line = re.sub(r"\s+", " ", text).strip()
    return line if len(line) <= _ERROR_CAP else line[: _ERROR_CAP - 1] + "…"


def _describe(exc: Exception, retries: int) -> str:
    status = getattr(exc, "status_code", None)
    message = getattr(exc, "message", None) or str(exc)
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            message = str(inner["message"])
        elif isinstance(body.get("message"), str):
            message = body["message"]
    head = f"HTTP {status}" if status is not None else type(exc).__name__
    after = f" after {retries} retries" if retries else ""
    return _one_line(f"model request failed{after}: {head}: {message}")
