"""``tether.adapters.claude_code:ClaudeCodeAgent``: Claude Code as a Tether agent.

An async driver over ``claude-agent-sdk`` (extra ``tether-runtime[claude]``); the CLI and its Bash
commands run inside the turn's process tree. Config and behaviour:
docs/adapters-claude_code.md; how each stop reaches the CLI: docs/design.md, section 12.3.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import claude_agent_sdk  # noqa: F401  # the SDK: a worker without it refuses the driver
import psutil
import structlog

from tether.adapters._forward import ANTHROPIC, KEY_STAND_IN, Forwarder
from tether.adapters._steers import SteerRelay
from tether.agents import chat
from tether.agents.chat import _mcp_call, _mcp_tools, _one_line, _preempted_text
from tether.agents.mcp import McpTools
from tether.contain.procs import alive, all_dead, child_pids, kill_tree
from tether.driver.async_context import AsyncTurnContext
from tether.driver.calls import calling
from tether.driver.toolenv import model_key, tool_user
from tether.driver.tools import TOOLS, parameters
from tether.telemetry import spans
from tether.wire.errors import InvalidParams, Preempted, TetherError
from tether.wire.frames import Steer
from tether.wire.records import Entry, Recovered
from tether.wire.text import render_frame, unknown_call_text

__all__ = ["ClaudeCodeAgent", "ClaudeCodeError"]

log = structlog.get_logger("tether.adapters.claude_code")

# The CLI's own conversation id for a Tether session: stable, so resume finds it.
_NAMESPACE = uuid.UUID("5b0c7e2a-8f57-4a40-9d0e-2f1d3c6a9b11")
_SESSION_KEY = "claude_session"  # an older version's whole saved session (read only)
# The CLI's session, kept as the turn goes (appended, semantics §17.1): each entry the
# turn writes carries the session's lines written since the last (``_LINES_KEY``), and
# the turn's last one says the session is whole to there (``_END_KEY``).
_LINES_KEY = "claude_lines"
_END_KEY = "claude_end"
_MIRRORED = 5.0  # seconds a tool's start waits for its reply's line in the session
_WRAP_UP = 30.0  # seconds to wait for the CLI's result after an interrupt (grace bounds it)
_CATCH_UP = 1.0  # seconds a cut CLI gets to show what the forwarder passed on, before its interrupt
_RESULT_CAP = 20_000
_SESSION_CAP = 8 * 1024 * 1024  # characters of a saved session (a frame carries 16 MiB)
_SWEEP_PASSES = 20  # kill passes at the turn's end, until one finds nothing of ours alive
_HOST_SERVER = "tether"  # the in-process MCP server of Tether's agent tools


class ClaudeCodeError(TetherError):
    """The Claude Code CLI could not run the turn (a config mistake, a CLI error)."""

    code = "claude-code-error"


@dataclass
class _Config:
    model: str | None = None
    system_prompt: str | None = None
    allowed_tools: list[str] = field(default_factory=lambda: ["Bash"])
    cwd: str | None = None
    max_turns: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    base_url: str | None = None
    api_key_env: str | None = None
    tools: list[str] = field(default_factory=list)
    chat: chat._Config | None = None  # its mcp and tool_policy, as ChatAgent reads them


def _config(raw: dict[str, Any]) -> _Config:
    """The session config, checked: a mistake is a one-line ``InvalidParams`` naming the
    field. ClaudeCodeAgent.check_config runs it at open, the turn at its start."""
    claude = chat._object("config.claude", raw.get("claude"))
    model = chat._object("config.model", raw.get("model"))
    _check_keys(claude, model)
    max_turns = chat._int("config.claude.max_turns", claude.get("max_turns"))
    if max_turns is not None and max_turns < 1:
        raise InvalidParams("config.claude.max_turns must be at least 1")
    allowed = chat._names("config.claude.allowed_tools", claude.get("allowed_tools"), "tool names")
    tools_cfg = _tools_config(raw)
    return _Config(
        model=chat._str("config.claude.model", claude.get("model")),
        system_prompt=chat._str("config.claude.system_prompt", claude.get("system_prompt")),
        allowed_tools=["Bash"] if allowed is None else allowed,
        cwd=chat._str("config.claude.cwd", claude.get("cwd")),
        max_turns=max_turns,
        env=chat._str_map("config.claude.env", claude.get("env")),
        base_url=chat._str("config.model.base_url", model.get("base_url")),
        api_key_env=chat._str("config.model.api_key_env", model.get("api_key_env")),
        tools=tools_cfg.tools,
        chat=tools_cfg,
    )


def _check_keys(claude: dict[str, Any], model: dict[str, Any]) -> None:
    """No key in the config, and no key unknown to ``claude`` or ``model``."""
    env = claude.get("env")
    if "api_key" in model or (isinstance(env, dict) and "ANTHROPIC_API_KEY" in env):
        raise InvalidParams("config: give model.api_key_env, never the key itself")
    known = {"model", "system_prompt", "allowed_tools", "cwd", "max_turns", "env"}
    if set(claude) - known:
        raise InvalidParams(f"config.claude: unknown keys {sorted(set(claude) - known)}")
    unknown = set(model) - {"base_url", "api_key_env", "price"}  # price: see add_usage
    if unknown:
        raise InvalidParams(f"config.model: unknown keys {sorted(unknown)}")
    chat._price("config.model.price", model.get("price"))


def _tools_config(raw: dict[str, Any]) -> chat._Config:
    """Tether's tools, MCP servers and tool policies as ChatAgent reads them (semantics
    §15.3); an MCP server may not take the name of Tether's own."""
    tools_cfg = chat._config(
        {"tools": raw.get("tools"), "mcp": raw.get("mcp"), "tool_policy": raw.get("tool_policy")}
    )
    if _HOST_SERVER in ((tools_cfg.mcp or {}).get("servers") or {}):
        raise InvalidParams(f"config.mcp: the server name {_HOST_SERVER!r} is Tether's own")
    return tools_cfg


@dataclass
class _Reply:
    """One model reply, gathered from the CLI's messages (one per content block)."""

    text: str = ""  # what streamed so far
    blocks: list[Any] = field(default_factory=list)
    done: bool = False  # its stream ended (message_stop)

    def final_text(self) -> str:
        said = "".join(getattr(b, "text", "") for b in self.blocks if _kind(b) == "TextBlock")
        return said or self.text

    def tool_calls(self) -> list[dict[str, Any]]:
        return [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input)},
            }
            for b in self.blocks
            if _kind(b) == "ToolUseBlock"
        ]


@dataclass
class _Response:
    """One model response as its stream counts it: its figures so far (the Anthropic
    wire's usage keys), what was reported of it (prompt and completion tokens,
    micro-dollars), and the characters of content it streamed."""

    model: str
    figures: dict[str, Any] = field(default_factory=dict)
    counted: tuple[int, int, int] = (0, 0, 0)
    chars: int = 0
    stop: str | None = None  # why it stopped (its message_delta's): none if it was cut


_COUNTS = ("prompt_tokens", "completion_tokens", "cost_microusd")
# What a content delta streams, by its type (text, a tool call's input, thinking)
_STREAMED = ("text", "partial_json", "thinking")


def _kind(obj: Any) -> str:
    return type(obj).__name__


def _mirror_class() -> type[Any]:
    from claude_agent_sdk.types import SessionStore

    class Mirror(SessionStore):
        """The CLI's session as it writes it, line by line (the SDK's transcript mirror,
        flushed after each frame): the lines of this turn's session not yet kept in an
        entry, and a wait for a tool call's line."""

        def __init__(self, session: str) -> None:
            self.session = session
            self.lines: list[str] = []  # not yet in an entry
            self.tool_uses: set[str] = set()  # the tool calls of its replies so far
            self.changed = asyncio.Event()

        async def append(self, key: Any, entries: list[Any]) -> None:
            if key.get("subpath") or key.get("session_id") != self.session:
                return  # a subagent's transcript: not needed to resume the session
            for e in entries:
                self.lines.append(json.dumps(e, ensure_ascii=False))
                content = (e.get("message") or {}).get("content") if e.get("type") else None
                if e.get("type") == "assistant" and isinstance(content, list):
                    self.tool_uses.update(
                        str(b.get("id")) for b in content if b.get("type") == "tool_use"
                    )
            self.changed.set()

        async def load(self, key: Any) -> list[Any] | None:
            return None  # Tether writes the session back itself before the CLI starts

        def take(self) -> list[str]:
            lines, self.lines = self.lines, []
            return lines

        async def seen(self, tool_use_id: str) -> bool:
            """Wait (``_MIRRORED`` at most) until the line of the reply asking for
            ``tool_use_id`` is in the session."""
            try:
                async with asyncio.timeout(_MIRRORED):
                    while tool_use_id not in self.tool_uses:
                        self.changed.clear()
                        await self.changed.wait()
            except TimeoutError:
                return False
            return True

    return Mirror


class _Bash:
    """One running Bash call: preemptable while it runs (its task awaits its end)."""

    def __init__(self, tool_use_id: str, before: set[int]) -> None:
        self.id = tool_use_id
        self.before = before  # the CLI's children before the command started: not its
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.preempted: Preempted | None = None
        self.task: asyncio.Task[None] | None = None


class _Turn:
    """The bookkeeping of one turn with the CLI."""

    def __init__(
        self,
        ctx: AsyncTurnContext,
        client: Any,
        session: str,
        model: str | None = None,
        forwarder: Forwarder | None = None,
    ) -> None:
        self.ctx = ctx
        self.client = client
        self.forwarder = forwarder  # the CLI's model requests go through it
        self.session = session  # the CLI's session id
        self.model = model or "claude"  # for the model requests' spans
        # The model request streaming now (telemetry on): its span, from the CLI's
        # message_start to its message_stop (or the interrupt that cut it).
        self.chat: spans.Span | None = None
        self.reply: _Reply | None = None
        self.pending: _Reply | None = None  # a finished reply with no tool call: the last?
        self.calls: dict[str, dict[str, Any]] = {}  # tool_use_id -> its call
        self.bash: dict[str, _Bash] = {}
        self.preempted: dict[str, str] = {}  # tool_use_id -> the preempted text told
        self.interrupted = False  # after an interrupt, the CLI ends the cut stream itself
        self.steers = SteerRelay(ctx)  # steers written to the CLI, not delivered yet
        self.before: set[int] = set()  # the worker's children before the CLI started
        self.said = ""  # the last reply text said this turn
        self.mcp_preempted: set[str] = set()  # preempted texts MCP calls gave the CLI
        # The responses streaming now, by the tool call whose subagent asked (None: the
        # turn's own): what each has counted so far
        self.responses: dict[str | None, _Response] = {}
        self.reported = [0, 0, 0]  # prompt and completion tokens, micro-dollars, this turn
        self.priced = bool((ctx.config.get("model") or {}).get("price"))  # by the context
        self.deltas = 0  # content deltas the CLI streamed to us this turn
        self.missed: list[str] = []  # earlier turns' user texts the saved session lacks
        self.held: list[Any] = []  # tool results of the reply still streaming
        self.prompted = False  # the turn's message was handed to the CLI
        self.mirror = _mirror_class()(session)  # the CLI's session lines, as it writes them
        self.whole = True  # every line of the session is kept (none was over the cap)
        self.keys: dict[str, str] = {}  # tool_use_id -> its call key (its durable start)
        self.waiting: dict[str, list[tuple[Any, str]]] = {}  # an MCP call's input and key
        self.took = asyncio.Event()  # set as each of the CLI's messages is taken
        self.note: str | None = None  # a recovered turn's message: Tether's, naming calls

    # ---- steers --------------------------------------------------------------------

    async def relay(self) -> None:
        """Write steers to the CLI as they arrive: a message written mid-turn reaches the
        model's next request. The poll is no boundary: it hides no stall from the
        watchdog."""
        await self.steers.run(self._write)

    async def _write(self, steer: Steer) -> None:
        await self.client.query(_user_message(steer.render()))

    def requesting(self) -> None:
        """The CLI is sending a model request: the steers written before it are in it, so
        they are delivered now (the host writes their ``steered`` markers)."""
        self.steers.taken()

    # ---- the CLI's messages --------------------------------------------------------

    def take(self, msg: Any) -> Any:
        """Record one message; the ResultMessage when it is one."""
        ctx = self.ctx
        ctx.progress()  # every message from the CLI is progress for the stall watchdog
        self.took.set()
        name = _kind(msg)
        if name == "StreamEvent":
            self._response_usage(msg.parent_tool_use_id, msg.event)
            self._event(msg.event)
        elif name == "AssistantMessage":
            if msg.parent_tool_use_id is None:
                if self.reply is None:
                    self.reply = _Reply()
                self.reply.blocks.extend(msg.content)
        elif name == "UserMessage":
            if msg.parent_tool_use_id is None and isinstance(msg.content, list):
                self._flush()
                for block in msg.content:
                    if _kind(block) == "ToolResultBlock":
                        self._tool_result(block)
        elif name == "ResultMessage":
            self.cut_usage()  # a response still open at the end never ends
            self._usage(msg)
            return msg
        return None

    def _usage(self, result: Any) -> None:
        """The turn's result: what its responses' stream events did not report (the CLI's
        totals beyond what was reported), and its cost beyond what the responses' list
        prices came to (the CLI knows its models' prices best), unless ``model.price``
        priced each response (the CLI's figure would count it twice)."""
        usage = result.usage or {}
        delta: dict[str, int] = {}
        if usage:
            prompt = _prompt_tokens(usage) - self.reported[0]
            completion = int(usage.get("output_tokens") or 0) - self.reported[1]
            if prompt > 0:
                delta["prompt_tokens"] = prompt
            if completion > 0:
                delta["completion_tokens"] = completion
        cost = result.total_cost_usd
        if isinstance(cost, (int, float)) and not self.priced:
            # TurnRecord.usage holds ints: the cost in millionths of a dollar
            beyond = round(float(cost) * 1_000_000) - self.reported[2]
            if beyond > 0:
                delta["cost_microusd"] = beyond
        if delta:
            self.ctx.add_usage(delta)

    def _response_usage(self, parent: str | None, event: dict[str, Any]) -> None:
        """Each model response counted as its stream reports it (the prompt at its start,
        the completion at its end), priced as it comes, so that a budget acts within one
        response (the CLI's own cost comes only with its result)."""
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message") or {}
            broken = self.responses.get(parent)
            if broken is not None:  # it never ended: a retry follows a broken stream
                self._count(broken, {}, cut=True)
            started = self.responses[parent] = _Response(str(message.get("model") or self.model))
            self._count(started, message.get("usage") or {})
            return
        response = self.responses.get(parent)
        if response is None:
            return
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            response.chars += sum(len(str(delta.get(k) or "")) for k in _STREAMED)
        elif kind == "message_delta":
            response.stop = (event.get("delta") or {}).get("stop_reason")
            self._count(response, event.get("usage") or {})
        elif kind == "message_stop":
            # the CLI ends a stream its interrupt cut itself: with no stop reason
            del self.responses[parent]
            self._count(response, {}, cut=True)

    def _count(self, response: _Response, usage: dict[str, Any], *, cut: bool = False) -> None:
        """Report what ``response`` has cost beyond what it reported: its figures so far
        (``usage``'s, which are cumulative, merged in); ``cut``: it will not go on, so
        unless it said why it stopped (its completion figure is then final), its
        completion is at least what streamed, estimated."""
        figures = response.figures
        figures.update({k: v for k, v in usage.items() if v is not None})
        prompt = _prompt_tokens(figures)
        completion = int(figures.get("output_tokens") or 0)
        # a stream's completion figure before its end is no count of what streamed (its
        # start says 0 or 1): a cut one counts at least what streamed
        estimated = cut and not response.stop and chat._tokens_in(response.chars) > completion
        if estimated:
            completion = chat._tokens_in(response.chars)
        cost = 0 if self.priced else _list_cost(response.model, figures, completion)
        counts = (prompt, completion, cost)
        delta: dict[str, int | bool] = {
            key: now - before
            for key, now, before in zip(_COUNTS, counts, response.counted, strict=True)
            if now > before
        }
        if not delta:
            return
        response.counted = (
            max(prompt, response.counted[0]),
            max(completion, response.counted[1]),
            max(cost, response.counted[2]),
        )
        for i, key in enumerate(_COUNTS):
            self.reported[i] += int(delta.get(key, 0))
        if estimated:
            delta["estimated"] = True
        self.ctx.add_usage(delta)

    def cut_usage(self) -> None:
        """The responses an interrupt cut (their streams will not end): what streamed of
        each counted at least (semantics §15.2)."""
        responses, self.responses = self.responses, {}
        for response in responses.values():
            self._count(response, {}, cut=True)

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if spans.on():
            self._chat_event(kind, event)
        if kind == "message_start":
            self._flush()
            self.reply = _Reply()
        elif kind == "content_block_delta":
            self.deltas += 1
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta" and self.reply is not None:
                self.reply.text += str(delta.get("text") or "")
        elif kind == "message_stop" and self.reply is not None and not self.interrupted:
            self.reply.done = True
            if self.reply.tool_calls():
                # its entry is written as its first call starts (``pre_tool``), once the
                # session has its line, or with the next message: never after a result
                pass
            else:  # maybe the turn's last reply: said with the saved session at the end
                self.pending, self.reply = self.reply, None

    def _chat_event(self, kind: Any, event: dict[str, Any]) -> None:
        """The CLI's model requests as ``chat`` spans (semantics §16.3), from its stream events."""
        if kind == "message_start":
            self.end_chat()
            message = event.get("message") or {}
            self.chat = spans.open_chat("anthropic", str(message.get("model") or self.model))
            usage = message.get("usage") or {}
            self.chat.usage(usage.get("input_tokens"), None)
        elif kind == "message_delta" and self.chat is not None:
            usage = event.get("usage") or {}
            if usage.get("output_tokens") is not None:
                self.chat.set("gen_ai.usage.output_tokens", usage["output_tokens"])
            stop = (event.get("delta") or {}).get("stop_reason")
            if stop:
                self.chat.finish([str(stop)])
        elif kind == "message_stop":
            self.end_chat()

    def end_chat(self, exc: BaseException | None = None) -> None:
        if self.chat is not None:
            self.chat.end(exc)
            self.chat = None

    def _flush(self) -> None:
        """Write the pending and the finished replies as assistant entries."""
        if self.pending is not None:
            self.say(self.pending.final_text())
            self.pending = None
        reply = self.reply
        if reply is None or not reply.done:
            return
        self.reply = None
        calls = reply.tool_calls()
        for c in calls:
            self.calls[c["id"]] = c
        text = reply.final_text()
        if text or calls:
            self.say(text, data={"tool_calls": calls} if calls else None)
        self._release()

    def _release(self) -> None:
        """Write the tool results held for the reply just written."""
        held, self.held = self.held, []
        for block in held:
            self._tool_result(block)

    def _tool_result(self, block: Any) -> None:
        asking = self.reply.tool_calls() if self.reply is not None else []
        if block.tool_use_id not in self.calls and block.tool_use_id in {c["id"] for c in asking}:
            # the CLI answered a call of the reply still streaming (one it refuses by its
            # own rule, before running anything): held until that reply's entry
            self.held.append(block)
            return
        call = self.calls.get(block.tool_use_id) or {}
        fn = call.get("function") or {}
        data: dict[str, Any] = {
            "tool_call_id": block.tool_use_id,
            "name": fn.get("name", ""),
            "arguments": fn.get("arguments", ""),
        }
        content = block.content
        if isinstance(content, list):
            text = "\n".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        else:
            text = "" if content is None else str(content)
        told = self.preempted.pop(block.tool_use_id, None)
        if told is None and text in self.mcp_preempted:
            told = text
        if told is not None:
            data["preempted"] = True
            text = told
        elif block.is_error:
            data["error"] = True
        key = self.keys.get(block.tool_use_id)
        if key is not None:
            data["call"] = key
        self.ctx.record_tool(text[:_RESULT_CAP], data=self._with_lines(data))

    def say(self, text: str, data: dict[str, Any] | None = None) -> None:
        self.ctx.say(text, data=self._with_lines(data))
        if text:
            self.said = text

    def _with_lines(self, data: dict[str, Any] | None) -> dict[str, Any] | None:
        """An entry's data with the session's lines the CLI wrote since the last entry:
        the session is kept as the turn goes, appended (semantics §17.1)."""
        lines = self.mirror.take()
        if not lines:
            return data
        packed = base64.b64encode(zlib.compress(("\n".join(lines) + "\n").encode(), 6)).decode()
        if len(packed) > _SESSION_CAP:
            # over what one entry may carry: the next turn starts a new conversation
            log.warning("claude.session_too_large", turn=self.ctx.turn, size=len(packed))
            self.whole = False
            return data
        return {**(data or {}), _LINES_KEY: {"id": self.session, "jsonl": packed}}

    def finish(self, keep: bool) -> str | None:
        """The turn's end: its last reply (cut, or held back), saying the session is kept
        whole to there (``keep``: it took this turn's message); the turn's final text
        when that is not the last entry's."""
        self.end_chat()
        data: dict[str, Any] = {}
        if keep and self.whole:
            data[_END_KEY] = True
        # The turn's last entry carries the saved session: the reply cut by an interrupt
        # (its stream never ended), else the finished reply held back at its end.
        last: _Reply | None = None
        if self.reply is not None and not self.reply.done:
            if self.reply.blocks or self.reply.text:
                last = self.reply
                data["cut"] = True
            self.reply = None
        if last is None:
            last, self.pending = self.pending, None
        self._flush()
        if last is not None:
            self.say(last.final_text(), data=data or None)
            # results the CLI gave for the calls of the cut reply follow it, named
            self.calls.update({c["id"]: c for c in last.tool_calls()})
            self._release()
            return None
        self._release()
        if data:
            # nothing left to say (stopped while a tool ran): a silent entry keeps it, and
            # the turn's final text stays the last reply said
            self.ctx.say("", data=self._with_lines(data))
            return self.said or None
        return None

    # ---- Bash calls: preemptable while they run ------------------------------------

    async def pre_tool(self, data: Any, tool_use_id: str | None, _: Any) -> dict[str, Any]:
        """Every tool call's start: the reply that asked for it is an entry (with its
        session lines), then the call's start is durable (the write-ahead, semantics
        §17.1), then it runs; a Bash call is preemptable while it runs."""
        if not tool_use_id:
            return {}
        name = str(data.get("tool_name") or "")
        tool_input = data.get("tool_input") or {}
        if not await self.mirror.seen(tool_use_id):  # the reply's line, in the session
            log.warning("claude.session_line_late", turn=self.ctx.turn, call=tool_use_id)
        await self._asked(tool_use_id)
        self._flush()  # the reply that asked for it, before its start and its result
        key = await self.ctx.begin_call(name, json.dumps(tool_input), tool_use_id)
        self.keys[tool_use_id] = key
        if name.startswith("mcp__"):  # its handler runs as this call (``keyed``)
            self.waiting.setdefault(name, []).append((tool_input, key))
        if name == "Bash":
            bash = _Bash(tool_use_id, _children(self.client))
            self.bash[tool_use_id] = bash
            bash.task = asyncio.ensure_future(self._watch(bash))
        return {}

    async def _asked(self, tool_use_id: str) -> None:
        """Wait (``_MIRRORED`` at most) until the reply asking for ``tool_use_id`` has
        been taken whole from the CLI's messages (the hook may run first)."""

        def taken() -> bool:
            reply = self.reply
            if tool_use_id in self.calls:
                return True
            return (
                reply is not None
                and reply.done
                and any(c["id"] == tool_use_id for c in reply.tool_calls())
            )

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_MIRRORED):
                while not taken():
                    self.took.clear()
                    await self.took.wait()

    def keyed(self, name: str, arguments: Any) -> str | None:
        """The call key of the MCP call ``name`` with ``arguments`` whose start is
        durable (its handler runs as that call: ``tether.current_call_id()``)."""
        waiting = self.waiting.get(name) or []
        for i, (given, key) in enumerate(waiting):
            if given == arguments:
                del waiting[i]
                return key
        return None

    async def _watch(self, bash: _Bash) -> None:
        """Await the Bash call's end as the turn's innermost preemptable call: a preempt
        cancels the wait (``Preempted`` here) and kills the command's tree."""
        try:
            await self.ctx.preemptable("Bash", asyncio.shield(bash.ended))
        except Preempted as exc:
            bash.preempted = exc
            self.preempted[bash.id] = _preempted_text(exc)
            _kill_commands(self.client, bash.before)

    async def post_tool(self, data: Any, tool_use_id: str | None, _: Any) -> dict[str, Any]:
        bash = self.bash.pop(tool_use_id or "", None)
        if bash is None:
            return {}
        if not bash.ended.done():
            bash.ended.set_result(None)
        if bash.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await bash.task
        exc = bash.preempted
        if exc is None:
            return {}
        # the honest result, with what the command wrote before it was killed
        response = data.get("tool_response")
        partial = ""
        if isinstance(response, dict):
            partial = "\n".join(
                str(response.get(k) or "") for k in ("stdout", "stderr") if response.get(k)
            )
        text = _preempted_text(
            Preempted(
                exc.message,
                origin=exc.origin,
                by=exc.by,
                reason=exc.reason,
                elapsed=exc.elapsed,
                partial=partial or exc.partial,
            )
        )
        self.preempted[bash.id] = text
        event = data.get("hook_event_name", "PostToolUse")
        out: dict[str, Any] = {"hookEventName": event}
        if event == "PostToolUse":
            out["updatedToolOutput"] = {"stdout": text, "stderr": "", "interrupted": False}
        else:  # a failure's output cannot be replaced: the model is told beside it
            out["additionalContext"] = text
        return {"hookSpecificOutput": out}

    def close(self) -> None:
        for bash in self.bash.values():
            if bash.task is not None:
                bash.task.cancel()


class ClaudeCodeAgent:
    """Claude Code as an agent: ``rt.open_session("tether.adapters.claude_code:ClaudeCodeAgent",
    config={...})``.

    Config (semantics §16.1): ``claude`` {``model``, ``system_prompt``, ``allowed_tools``
    (default ``["Bash"]``), ``cwd``, ``max_turns``, ``env``}, ``model`` {``base_url`` (the
    CLI's ``ANTHROPIC_BASE_URL``), ``api_key_env`` (the variable whose value becomes its
    ``ANTHROPIC_API_KEY``)}, ``tools`` (Tether's agent tools, offered as MCP tools).
    """

    # A turn a crash interrupted resumes the CLI's session, kept as it went (§17.1).
    recoverable = True

    @staticmethod
    def check_config(config: dict[str, Any]) -> None:
        """At open and spawn, in a worker: the config the turn will read (its _config)."""
        _config(config)

    async def run(self, ctx: AsyncTurnContext) -> str | None:
        try:
            cfg = _config(ctx.config)
        except TetherError as exc:
            raise ClaudeCodeError(exc.message) from None
        key = None
        if cfg.api_key_env:
            key = model_key(cfg.api_key_env)
            if not key:
                raise ClaudeCodeError(
                    f"the environment variable {cfg.api_key_env} (api_key_env) is not set"
                )
        history = await ctx.load_history()
        if ctx.recovered is not None and any(
            e.turn == ctx.turn and (e.data or {}).get(_END_KEY) for e in history
        ):
            return None  # its final reply was durable: it is the turn's final text
        home = _home()
        client: Any = None
        turn: _Turn | None = None
        # the key goes upstream from the forwarder alone: the CLI, and every command its
        # Bash tool runs, hold only a stand-in (semantics §17.4)
        forwarder = Forwarder(_upstream(cfg), key=key, stand_in=KEY_STAND_IN)
        try:
            await forwarder.start()
            client, turn = await _start(ctx, cfg, history, home, forwarder)
            # A cancel shuts the model connection from the worker's reader thread as it
            # arrives, not after the loop's turn (busy with the CLI's stream, it lags)
            ctx.on_cancel_arrival(forwarder.cut)
            return await _converse(ctx, client, turn, home)
        finally:
            ctx.on_cancel_arrival(None)
            if turn is not None:
                turn.close()
            await _stop(client, turn.before if turn is not None else None)
            await forwarder.aclose()  # after the CLI is gone: it sees no closed connection
            shutil.rmtree(home, ignore_errors=True)


def _home() -> str:
    """The CLI's own directory for this turn (its ``CLAUDE_CONFIG_DIR``), the tool user's
    where one is set: the CLI runs as that user."""
    home = tempfile.mkdtemp(prefix="tether-claude-")
    user = tool_user()
    if user is not None:
        os.chown(home, user.uid, user.gid)
    return home


def _upstream(cfg: _Config) -> str:
    """Where the CLI's model requests go: where it would have sent them itself."""
    return (
        cfg.base_url
        or cfg.env.get("ANTHROPIC_BASE_URL")
        or os.environ.get("ANTHROPIC_BASE_URL")
        or ANTHROPIC
    )


async def _start(
    ctx: AsyncTurnContext, cfg: _Config, history: list[Entry], home: str, forwarder: Forwarder
) -> tuple[Any, _Turn]:
    from claude_agent_sdk import ClaudeAgentOptions, ClaudeSDKClient, HookMatcher

    cwd = os.path.abspath(cfg.cwd or os.getcwd())
    session = str(uuid.uuid5(_NAMESPACE, ctx.session))
    base, own, missed = _session(history, ctx.turn)
    recovering = ctx.recovered is not None and bool(own)
    lines = [*(base or []), *own] if recovering else base
    env = {
        "CLAUDE_CONFIG_DIR": home,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        **cfg.env,
    }
    env["ANTHROPIC_BASE_URL"] = forwarder.url
    if any(k.lower().endswith("_proxy") for k in [*os.environ, *cfg.env]):
        # a proxy the CLI honours must not carry its requests to the forwarder
        for name in ("NO_PROXY", "no_proxy"):
            given = cfg.env.get(name, os.environ.get(name, ""))
            env[name] = ",".join(p for p in (given, "127.0.0.1") if p)
    # A key of some kind, or the CLI refuses to start ("Not logged in"); the forwarder
    # puts the real one in its place, or drops it for a server that wants none.
    env["ANTHROPIC_API_KEY"] = KEY_STAND_IN
    kwargs: dict[str, Any] = {}
    if lines and _restore(home, cwd, session, lines):
        kwargs["resume"] = session
    else:
        kwargs["session_id"] = session
    turn_box: list[_Turn] = []

    async def pre(data: Any, tool_use_id: str | None, hook_ctx: Any) -> Any:
        return await turn_box[0].pre_tool(data, tool_use_id, hook_ctx)

    def keyed(name: str, arguments: Any) -> str | None:
        return turn_box[0].keyed(name, arguments)

    async def post(data: Any, tool_use_id: str | None, hook_ctx: Any) -> Any:
        return await turn_box[0].post_tool(data, tool_use_id, hook_ctx)

    allowed = list(cfg.allowed_tools)
    mcp: dict[str, Any] = {}
    if cfg.tools:
        mcp[_HOST_SERVER] = _host_tools(ctx, cfg.tools, keyed)
        allowed += [f"mcp__{_HOST_SERVER}__{t}" for t in cfg.tools]
    told: set[str] = set()  # the preempted texts the MCP calls gave: their entries say so
    servers, names = await _mcp_servers(ctx, cfg, told, keyed)  # opened before the CLI
    mcp.update(servers)
    allowed += names
    user = tool_user()
    mirror = _mirror_class()(session)  # the session, kept in Tether's store as it goes
    options = ClaudeAgentOptions(
        session_store=mirror,
        session_store_flush="eager",
        user=None if user is None else user.name,  # semantics §17.4
        model=cfg.model,
        system_prompt=cfg.system_prompt,
        allowed_tools=allowed,
        cwd=cwd,
        max_turns=cfg.max_turns,
        env=env,
        include_partial_messages=True,
        mcp_servers=mcp,
        hooks={
            "PreToolUse": [HookMatcher(matcher=None, hooks=[pre])],  # every tool's start
            "PostToolUse": [HookMatcher(matcher="Bash", hooks=[post])],
            "PostToolUseFailure": [HookMatcher(matcher="Bash", hooks=[post])],
        },
        **kwargs,
    )
    client = ClaudeSDKClient(options)
    turn = _Turn(ctx, client, session, cfg.model, forwarder)
    turn.mirror = mirror
    turn.missed = missed
    if recovering:
        assert ctx.recovered is not None
        turn.missed, turn.note = [], _recovery_note(ctx.recovered)
    turn.mcp_preempted = told
    turn.before = set(child_pids(os.getpid()))  # the worker's children that are not ours
    turn_box.append(turn)
    # The SDK's own clean-up of a connect that fails or is cancelled waits for the CLI to
    # exit (seconds, past a cancel's grace): a cancel kills the CLI's tree first.
    connecting = asyncio.ensure_future(client.connect())
    try:
        await asyncio.shield(connecting)
    except BaseException:
        if not connecting.done():
            proc = _cli(client)
            _kill_ours(turn.before, None if proc is None else proc.pid)
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
        await _stop(client, turn.before)
        raise
    return client, turn


async def _converse(ctx: AsyncTurnContext, client: Any, turn: _Turn, home: str) -> str | None:
    """Send the message, relay steers, read until the result; a cancel interrupts."""
    steering = asyncio.ensure_future(turn.relay())
    result: Any = None
    try:
        if turn.note is not None:
            # recovered: the CLI's session resumed writes its own "interrupted" result
            # for each call that was running; the model is told which, and each gets its
            # tool entry saying it is unknown (no idempotent run again here)
            assert ctx.recovered is not None
            for c in ctx.recovered.unknown_calls:
                data = {"tool_call_id": c.tool_call_id, "name": c.name}
                extra = {"arguments": c.arguments, "call": c.key, "unknown": True}
                ctx.record_tool(unknown_call_text(ctx.recovered.cause), data={**data, **extra})
            await client.query(turn.note)
        elif turn.missed:
            # what the user said in turns whose session was lost, ahead of this message,
            # as one user message: the model reads them in order, as it would have
            await client.query(_user_message([*turn.missed, ctx.message.content]))
        else:
            await client.query(ctx.message.content)
        turn.prompted = True
        async for msg in client.receive_messages():
            if _kind(msg) == "SystemMessage" and (msg.data or {}).get("status") == "requesting":
                turn.requesting()
            result = turn.take(msg)
            # a steer written after the last request is answered by the CLI in a loop of
            # its own, after this result: read on to that one's result
            if result is not None and not turn.steers.offered:
                break
    except asyncio.CancelledError:
        if ctx.cancel is None:
            raise  # not this turn's cancel
        steering.cancel()
        result = await _wrap_up(client, turn)
        turn.cut_usage()  # with no result from the CLI, its cut response counts still
        # a session that never took this turn's message is not this turn's to keep: the
        # next turn resumes the one before and tells the CLI this message again
        return turn.finish(turn.prompted)
    finally:
        steering.cancel()
    turn.finish(True)
    if result is None:
        raise ClaudeCodeError("the Claude Code CLI ended without a result")
    if result.is_error:
        status = f" (HTTP {result.api_error_status})" if result.api_error_status else ""
        why = "; ".join(result.errors or []) or str(result.result or "")
        raise ClaudeCodeError(_one_line(f"Claude Code: {result.subtype}{status}: {why}"))
    return None


async def _wrap_up(client: Any, turn: _Turn) -> Any:
    """After a cancel: the model stream was closed upstream as the cancel arrived (the
    forwarder's cut, from the reader thread; again here, idempotent); the CLI is let
    show what had arrived before it (it drops what it has not read when it acts on its
    interrupt: the cut reply would lose it), then interrupted; then read to its result,
    which comes after the cut reply. The engine's grace bounds this."""
    turn.interrupted = True
    turn.end_chat(asyncio.CancelledError())  # the request the interrupt cuts
    if turn.forwarder is not None:
        turn.forwarder.cut()
        result = await _catch_up(client, turn, turn.forwarder)
        if result is not None:
            return result
    with contextlib.suppress(Exception):
        await client.interrupt()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_WRAP_UP):
            async for msg in client.receive_response():
                result = turn.take(msg)
                if result is not None:
                    return result
    return None


async def _catch_up(client: Any, turn: _Turn, forwarder: Forwarder) -> Any:
    """Read the CLI's messages until it has streamed us every content delta the
    forwarder passed on to it (nothing new comes after the cut), at most ``_CATCH_UP``;
    the result if the CLI ended meanwhile. Not waited for when a reply could not be
    counted (compressed)."""
    try:
        async with asyncio.timeout(_CATCH_UP):
            await forwarder.settled()
            while forwarder.deltas is not None and turn.deltas < forwarder.deltas:
                async for msg in client.receive_messages():
                    result = turn.take(msg)
                    if result is not None:
                        return result
                    if forwarder.deltas is None or turn.deltas >= forwarder.deltas:
                        break
                else:
                    break  # the CLI's messages ended
    except TimeoutError:
        log.info(
            "claude.catch_up_timeout", turn=turn.ctx.turn, seen=turn.deltas, sent=forwarder.deltas
        )
    return None


async def _user_message(text: str | list[str]) -> AsyncIterator[dict[str, Any]]:
    """One user message for ``client.query``, in the CLI's stream-json input shape (a
    list: one text block each)."""
    content: Any = text if isinstance(text, str) else [{"type": "text", "text": t} for t in text]
    yield {
        "type": "user",
        "message": {"role": "user", "content": content},
        "parent_tool_use_id": None,
        "session_id": "default",
    }


async def _stop(client: Any, before: set[int] | None) -> None:
    """Kill the CLI's tree and whatever its commands left behind, then close the client
    (fast once the CLI is gone: ``disconnect()`` waits ~5 s for a live CLI to exit)."""
    if client is None:
        return
    proc = _cli(client)
    if before is not None:
        _kill_ours(before, None if proc is None else proc.pid)
    elif proc is not None:
        _kill_tree(proc)
    with contextlib.suppress(Exception):
        await asyncio.shield(client.disconnect())


def _kill_ours(before: set[int], cli: int | None) -> None:
    """Kill every child of the worker that was not there before the CLI started, and
    its tree: the CLI, and what its commands left behind. The worker is a subreaper, so
    an escapee of a Bash command (double-forked, ``setsid``, its environment cleared)
    has re-parented to it, and a cancel's ``interrupt()`` leaves one alive. Frozen
    before the kill, so nothing forks meanwhile; passes until nothing new is left."""
    orphans = _kill_new_children(before, cli)
    # The orphans are ours to reap (the SDK's subprocess reaps the CLI): dead by now
    _reap(orphans, within=1.0)


def _kill_new_children(before: set[int], cli: int | None) -> set[int]:
    """The kill passes of ``_kill_ours``; the children it killed other than the CLI."""
    me = os.getpid()
    orphans: set[int] = set()
    for _ in range(_SWEEP_PASSES):
        roots = [pid for pid in child_pids(me) if pid not in before]
        orphans.update(pid for pid in roots if pid != cli)
        live = [p for p in kill_tree(roots) if alive(p)] if roots else []
        if not live:
            break
        all_dead(live, 0.2)
    return orphans


def _reap(pids: set[int], *, within: float) -> None:
    """Reap these children of ours as they die, for ``within`` seconds at most."""
    deadline = time.monotonic() + within
    while pids and time.monotonic() < deadline:
        for pid in list(pids):
            if _reaped(pid):
                pids.discard(pid)
        if pids:
            time.sleep(0.005)


def _reaped(pid: int) -> bool:
    """Whether child ``pid`` is gone: reaped now, or not ours to wait for."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        return True
    return bool(done)


def _cli(client: Any) -> psutil.Process | None:
    """The CLI's process (the SDK keeps it in its transport)."""
    transport = getattr(client, "_transport", None)
    process = getattr(transport, "_process", None)
    pid = getattr(process, "pid", None)
    if pid is None:
        return None
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _kill_tree(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.Error):
        kids = proc.children(recursive=True)
        for p in [proc, *kids]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)


def _children(client: Any) -> set[int]:
    cli = _cli(client)
    if cli is None:
        return set()
    with contextlib.suppress(psutil.Error):
        return {p.pid for p in cli.children()}
    return set()


def _kill_commands(client: Any, before: set[int]) -> None:
    """Kill the trees of the CLI's children that were not there before the Bash call
    began: the running command's shell and whatever it started."""
    cli = _cli(client)
    if cli is None:
        return
    with contextlib.suppress(psutil.Error):
        for child in cli.children():
            if child.pid not in before:
                _kill_tree(child)


# ---- the CLI's session, kept in Tether's store -------------------------------------


def _session(history: list[Entry], turn: str) -> tuple[list[str] | None, list[str], list[str]]:
    """The CLI's session as kept in the store: its lines as the last turn that kept it
    whole left them (None: none did), this turn's own lines kept so far (a recovered
    turn's), and what the user said in the earlier turns after the last kept one, which
    that session never took (a turn aborted, crashed, or stopped or failed before the
    CLI took its message keeps none): their messages and the steers taken in them."""
    ended = {e.turn for e in history if (e.data or {}).get(_END_KEY)}
    base: list[str] | None = None
    own: list[str] = []
    since, covered = 0, None  # the entries after the kept session; the turn that kept it
    for i, e in enumerate(history):
        data = e.data or {}
        old = data.get(_SESSION_KEY)  # an older version's whole session
        if e.kind == "assistant" and isinstance(old, dict) and e.turn != turn:
            whole = _unpacked(old)
            if whole is not None:
                base, since, covered = whole, i + 1, e.turn
        chunk = data.get(_LINES_KEY)
        lines = _unpacked(chunk) if isinstance(chunk, dict) else None
        if e.turn == turn:
            own.extend(lines or ())
        elif e.turn in ended:
            base, since, covered = [*(base or ()), *(lines or ())], i + 1, e.turn
    missed = [
        text
        for e in history[since:]
        if e.turn not in (covered, turn) and (text := _user_text(e)) is not None
    ]
    return base, own, missed


def _unpacked(saved: dict[str, Any]) -> list[str] | None:
    """The session lines an entry carries (None: unreadable)."""
    try:
        body = zlib.decompress(base64.b64decode(saved["jsonl"]))
    except (KeyError, ValueError, TypeError, zlib.error):
        return None
    return body.decode(errors="replace").splitlines()


def _user_text(e: Entry) -> str | None:
    """A turn's message, or a steer taken, as the model was told it."""
    if e.kind in ("user", "notice"):
        return e.text
    if e.kind == "marker" and e.action == "steered":
        return render_frame("steer", e.origin or "", e.by or "", e.reason or "")
    return None


def _restore(home: str, cwd: str, session: str, lines: list[str]) -> bool:
    """Write the session's lines back under a fresh config dir, where the CLI resuming
    it from ``cwd`` reads it; whether it could."""
    from claude_agent_sdk import project_key_for_directory

    path = os.path.join(home, "projects", project_key_for_directory(cwd), f"{session}.jsonl")
    if not os.path.normpath(path).startswith(home + os.sep):
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return True


def _recovery_note(recovered: Recovered) -> str:
    """A recovered turn's message to the CLI: Tether's, naming each call that was
    running (the CLI's own result for each says only that it was interrupted)."""
    after = "the host stopped" if recovered.cause == "host" else "its worker died"
    text = f"[Tether] This turn was interrupted ({after}) and goes on from its last step."
    for c in recovered.unknown_calls:
        what = f"{c.name} {c.arguments}"
        if c.name == "Bash":
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                what = f"the command `{json.loads(c.arguments)['command']}`"
        text += (
            f" {what} was running when it stopped: it may or may not have taken effect;"
            " check before relying on it or running it again."
        )
    return text


# ---- Tether's agent tools, as an in-process MCP server of the SDK ---------------------


# An MCP call's key (``_Turn.keyed``): its start was made durable by the PreToolUse hook
Keyed = Callable[[str, Any], "str | None"]


def _host_tools(ctx: AsyncTurnContext, names: list[str], keyed: Keyed) -> Any:
    from claude_agent_sdk import SdkMcpTool, create_sdk_mcp_server

    def handler(name: str) -> Any:
        async def call(args: dict[str, Any]) -> dict[str, Any]:
            try:
                with calling(keyed(f"mcp__{_HOST_SERVER}__{name}", args)):
                    result = await ctx.call_tool(name, args)
            except Preempted as exc:
                text = _preempted_text(exc)
            else:
                text = json.dumps(result, ensure_ascii=False)
            return {"content": [{"type": "text", "text": text}]}

        return call

    tools = []
    for name in names:
        description, schema = parameters(TOOLS[name][0])
        tools.append(
            SdkMcpTool(
                name=name, description=description, input_schema=schema, handler=handler(name)
            )
        )
    return create_sdk_mcp_server("tether", tools=tools)


# ---- the config's MCP servers, opened by Tether, offered through the SDK ----------------


async def _mcp_servers(
    ctx: AsyncTurnContext, cfg: _Config, told: set[str], keyed: Keyed
) -> tuple[dict[str, Any], list[str]]:
    """One in-process SDK server per configured MCP server that answered, whose tools
    call through Tether's MCP client (semantics §15.3): the CLI names them
    ``mcp__<server>__<tool>`` as ChatAgent does, a preempt or cancel reaches the server,
    the policies apply. A server that will not start is left out, the model told in one
    line; a config none of whose servers start fails the turn."""
    from claude_agent_sdk import SdkMcpTool, create_sdk_mcp_server

    if cfg.chat is None:
        return {}, []
    try:
        tools = await _mcp_tools(ctx, cfg.chat)
    except TetherError as exc:
        raise ClaudeCodeError(exc.message) from None
    if tools is None:
        return {}, []
    offered, missing = await tools.offered()
    if len(missing) == len(tools.servers):
        raise ClaudeCodeError(_one_line("config.mcp: " + "; ".join(missing.values())))
    for server, why in missing.items():
        ctx.record_tool(why, data={"mcp_unavailable": server})
    by_server: dict[str, list[Any]] = {}
    names: list[str] = []
    for spec in offered:
        fn = spec["function"]
        full = str(fn["name"])
        server, _, tool = full[len("mcp__") :].partition("__")
        by_server.setdefault(server, []).append(
            SdkMcpTool(
                name=tool,
                description=str(fn.get("description") or ""),
                input_schema=fn.get("parameters") or {"type": "object", "properties": {}},
                handler=_mcp_handler(ctx, tools, full, told, keyed),
            )
        )
        names.append(full)
    servers = {s: create_sdk_mcp_server(s, tools=t) for s, t in by_server.items()}
    return servers, names


def _mcp_handler(
    ctx: AsyncTurnContext, tools: McpTools, name: str, told: set[str], keyed: Keyed
) -> Any:
    async def call(args: dict[str, Any]) -> dict[str, Any]:
        try:
            with calling(keyed(name, args)):
                text = await _mcp_call(ctx, tools, name, json.dumps(args))
        except Preempted as exc:
            text = _preempted_text(exc)
            told.add(text)
        return {"content": [{"type": "text", "text": text}]}

    return call


# Anthropic's list prices, dollars per million input and output tokens, by model id
# prefix (the first that matches): each response is priced as it streams, so that a cost
# budget acts within the turn; the CLI's own figure, which comes with its result, adds
# what these miss. A model not here is priced as the CLI prices a model it does not know.
_LIST_PRICES: tuple[tuple[str, float, float], ...] = (
    ("claude-opus-4-0", 15.0, 75.0),
    ("claude-opus-4-1", 15.0, 75.0),
    ("claude-opus-4-2025", 15.0, 75.0),  # Opus 4, by its dated id
    ("claude-3-opus", 15.0, 75.0),
    ("claude-opus-4", 5.0, 25.0),  # 4.5 and later
    ("claude-sonnet-4", 3.0, 15.0),
    ("claude-3-7-sonnet", 3.0, 15.0),
    ("claude-3-5-sonnet", 3.0, 15.0),
    ("claude-haiku-4", 1.0, 5.0),
    ("claude-3-5-haiku", 0.8, 4.0),
    ("claude-3-haiku", 0.25, 1.25),
)
_UNKNOWN_PRICE = (5.0, 25.0)


def _list_cost(model: str, usage: dict[str, Any], completion: int) -> int:
    """What a response costs at its model's list price, in micro-dollars (a token at $X
    per million costs X): cache writes at 1.25 times the input price (2 for an hour's),
    cache reads at a tenth."""
    given, out = next(((i, o) for p, i, o in _LIST_PRICES if model.startswith(p)), _UNKNOWN_PRICE)
    writes = int(usage.get("cache_creation_input_tokens") or 0)
    hour = min(
        int((usage.get("cache_creation") or {}).get("ephemeral_1h_input_tokens") or 0), writes
    )
    reads = int(usage.get("cache_read_input_tokens") or 0)
    sent = int(usage.get("input_tokens") or 0) + 1.25 * (writes - hour) + 2 * hour + 0.1 * reads
    return round(given * sent + out * completion)


def _prompt_tokens(usage: dict[str, Any]) -> int:
    """A response's prompt tokens: its input, cache reads and cache writes included."""
    keys = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    return sum(int(usage.get(k) or 0) for k in keys)
