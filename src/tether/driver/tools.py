"""The agent tools for model function calling: argument Structs, schemas, one dispatcher.

Each tool's arguments are a msgspec Struct; its JSON Schema (what the model sees) is
generated from that Struct, and the same Struct validates what the model sends back, so
the two cannot drift. ``call_tool`` validates fully before it calls anything: malformed
arguments never reach the runtime.

A driver wrapping any model needs no glue of its own::

    tools = schemas("anthropic")                   # pass to the model
    result = call_tool(ctx, call.name, call.input)  # feed back as the tool result
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, Protocol, overload

import msgspec
from msgspec import UNSET, Meta, UnsetType

from tether.wire.errors import Preempted, TetherError
from tether.wire.text import neutralized
from tether.wire.vocab import MAX_SECONDS

__all__ = [
    "TOOLS",
    "BudgetArgs",
    "DecideApprovalArgs",
    "InterruptAgentArgs",
    "ListAgentsArgs",
    "ListApprovalsArgs",
    "PauseAgentArgs",
    "ResumeAgentArgs",
    "RunCommandArgs",
    "SendMessageArgs",
    "SpawnAgentArgs",
    "StopReportArgs",
    "ToolHost",
    "acall_tool",
    "call_tool",
    "parameters",
    "schemas",
]


class _CommandResult(Protocol):
    @property
    def returncode(self) -> int: ...
    @property
    def stdout(self) -> str: ...
    @property
    def stderr(self) -> str: ...


class ToolHost(Protocol):
    """What the tools need from a turn context (``TurnContext`` provides it)."""

    def spawn_agent(
        self,
        *,
        slug: str | None = ...,
        mode: str = ...,
        prompt: str | None = ...,
        data: dict[str, Any] | None = ...,
        budget: dict[str, Any] | None = ...,
        on_crash: str | None = ...,
    ) -> str: ...

    def budget(self) -> dict[str, Any]: ...

    def send_message(
        self, to: str, text: str, *, data: dict[str, Any] | None = ..., wake: bool = ...
    ) -> str: ...

    def list_agents(self, *, scope: str = ...) -> Sequence[Any]: ...

    @overload
    def interrupt_agent(
        self,
        agent_id: str,
        *,
        kind: str = ...,
        reason: str = ...,
        scope: Literal["session"] = ...,
    ) -> str | None: ...

    @overload
    def interrupt_agent(
        self, agent_id: str, *, kind: str = ..., reason: str = ..., scope: Literal["subtree"]
    ) -> Sequence[str]: ...

    def stop_report(self, turn: str) -> Any: ...

    def pause_agent(
        self, agent_id: str, *, scope: str = ..., reason: str = ...
    ) -> Sequence[str]: ...

    def resume_agent(self, agent_id: str, *, scope: str = ...) -> Sequence[str]: ...

    def list_approvals(self) -> Sequence[Any]: ...

    def decide_approval(
        self,
        approval: str,
        decision: str = ...,
        *,
        reason: str = ...,
        arguments: dict[str, Any] | None = ...,
    ) -> Any: ...

    def run_command(
        self, argv: list[str], *, timeout: float | None = ..., cwd: str | None = ...
    ) -> _CommandResult: ...


class _Args(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the argument Structs. Optional arguments are left out, never null."""


AgentName = Annotated[
    str, Meta(min_length=1, description="The agent's id, or its slug within your own subtree.")
]


class SpawnAgentArgs(_Args):
    """Start a subagent (a child session running your own driver) and give it a task.

    Returns its id. A continuable child lives on after its turn and can be messaged,
    steered or stopped; a one-shot child does one task and ends.
    """

    slug: (
        Annotated[
            str,
            Meta(
                min_length=1, max_length=64, description="A short name, unique among your children."
            ),
        ]
        | UnsetType
    ) = UNSET
    prompt: Annotated[str, Meta(description="The child's first message: its task.")] | UnsetType = (
        UNSET
    )
    mode: Annotated[
        Literal["continuable", "one-shot"],
        Meta(description="continuable (default): lives on with an inbox; one-shot: one task."),
    ] = "continuable"
    data: (
        Annotated[
            dict[str, Any], Meta(description="Structured data attached to the first message.")
        ]
        | UnsetType
    ) = UNSET
    # A plain object (the host checks it as tether.Budget): a nested schema would need a
    # $ref, which some models' function calling cannot follow.
    budget: (
        Annotated[
            dict[str, Any],
            Meta(
                description='The child\'s own budget, e.g. {"tokens": 50000, "cost_usd": 1.0,'
                ' "turn_seconds": 600, "turns": 20}: it must fit in what your tree has left.'
            ),
        ]
        | UnsetType
    ) = UNSET
    on_crash: (
        Annotated[
            Literal["recover", "park"],
            Meta(
                description="If its host or worker dies mid-turn: recover (default: yours) runs"
                " the turn on from its last step; park ends it crashed."
            ),
        ]
        | UnsetType
    ) = UNSET


class BudgetArgs(_Args):
    """What your own tree (you and every agent below you) may still spend: the least each
    budget on it or above it has left per limit (tokens, cost_usd, turn_seconds, turns),
    what it has spent, and its state (ok, soft, exhausted)."""


class SendMessageArgs(_Args):
    """Send a message to one of your direct children; it starts a turn unless wake is false."""

    to: AgentName
    text: Annotated[str, Meta(min_length=1, description="The message.")]
    data: Annotated[dict[str, Any], Meta(description="Structured data to attach.")] | UnsetType = (
        UNSET
    )
    wake: Annotated[
        bool, Meta(description="Start a turn if the child is not running one (default true).")
    ] = True


class ListAgentsArgs(_Args):
    """List the agents below you with their state (running, idle, parked, ...) and inbox size."""

    scope: Annotated[
        Literal["children", "descendants"],
        Meta(description="children (default) or your whole subtree (descendants)."),
    ] = "children"


class InterruptAgentArgs(_Args):
    """Interrupt an agent below you.

    steer: redirect it at its next step with your text as guidance; cancel: ask it to
    wrap up and stop (keeps partial work); abort: kill its turn now; preempt: kill only
    its current command and let it go on. The agent is not destroyed: it can be
    messaged again afterwards.
    """

    agent: AgentName
    kind: Annotated[
        Literal["steer", "cancel", "abort", "preempt"],
        Meta(description="What to do (default cancel)."),
    ] = "cancel"
    reason: Annotated[
        str, Meta(max_length=2000, description="Why; for a steer, the guidance itself.")
    ] = ""
    scope: Annotated[
        Literal["session", "subtree"],
        Meta(
            description="session (default): that agent's turn; subtree: with cancel or "
            "abort, that agent's turn and the turns of every agent below it."
        ),
    ] = "session"


_Scope = Annotated[
    Literal["session", "subtree"],
    Meta(description="session (default): that agent's turn; subtree: and every agent below it."),
]


class PauseAgentArgs(_Args):
    """Pause an agent below you: freeze its running turn in place (its commands too),
    keeping everything, until you resume it.

    Messages sent to it meanwhile queue; a steer or a cancel takes effect after resume;
    abort still stops it at once. Returns the turns paused (empty if it was not running).
    """

    agent: AgentName
    scope: _Scope = "session"
    reason: Annotated[str, Meta(max_length=2000, description="Why (shown in its marker).")] = ""


class ResumeAgentArgs(_Args):
    """Resume an agent you paused: its turn goes on where it was. Returns the turns resumed."""

    agent: AgentName
    scope: _Scope = "session"


class StopReportArgs(_Args):
    """What a stop (cancel, abort, preempt) did to one turn of an agent below you (or
    yours): who asked and when, how long it took to land, how, every process it killed
    and whether it died, every tool call it cut and how that ended, and the partial
    reply. Returns {"report": null} if no stop reached that turn."""

    turn: Annotated[str, Meta(min_length=1, description="The turn's id (t_…).")]


class ListApprovalsArgs(_Args):
    """List the tool calls of the agents below you that wait for a decision (approval):
    each one's id, agent, tool and arguments. Decide one with decide_approval."""


class DecideApprovalArgs(_Args):
    """Decide a tool call of an agent below you that waits for approval: approve it (it
    runs, with your edited arguments if you give them) or deny it (the agent is told why
    and goes on)."""

    approval: Annotated[str, Meta(min_length=1, description="The approval's id (a_…).")]
    decision: Annotated[
        Literal["approve", "deny"], Meta(description="approve (default) or deny.")
    ] = "approve"
    reason: Annotated[str, Meta(max_length=2000, description="Why (the agent is told).")] = ""
    arguments: (
        Annotated[
            dict[str, Any],
            Meta(description="To approve with other arguments than the call's own."),
        ]
        | UnsetType
    ) = UNSET


class RunCommandArgs(_Args):
    """Run a command (no shell) and return its exit code, stdout and stderr."""

    argv: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(min_length=1, description='The program and its arguments, e.g. ["ls", "-l"].'),
    ]
    timeout: (
        Annotated[
            float,
            Meta(gt=0, le=MAX_SECONDS, description="Seconds before it is killed."),
        ]
        | UnsetType
    ) = UNSET
    cwd: Annotated[str, Meta(min_length=1, description="Working directory.")] | UnsetType = UNSET


def _given(value: Any) -> Any:
    """UNSET (an argument left out) becomes the tool's own default, None."""
    return None if value is UNSET else value


# Each tool is two halves: ``invoke`` calls the host (a value for a sync context, an
# awaitable for an async one) and ``shape`` makes the JSON-ready result, so the sync and
# the async dispatchers share every line but the await.


def _spawn(host: Any, a: SpawnAgentArgs) -> Any:
    extra: dict[str, Any] = {} if a.budget is UNSET else {"budget": a.budget}
    if a.on_crash is not UNSET:
        extra["on_crash"] = a.on_crash
    return host.spawn_agent(
        slug=_given(a.slug), mode=a.mode, prompt=_given(a.prompt), data=_given(a.data), **extra
    )


def _send(host: Any, a: SendMessageArgs) -> Any:
    return host.send_message(a.to, a.text, data=_given(a.data), wake=a.wake)


def _list(host: Any, a: ListAgentsArgs) -> Any:
    return host.list_agents(scope=a.scope)


def _interrupt(host: Any, a: InterruptAgentArgs) -> Any:
    if a.scope == "subtree":
        return host.interrupt_agent(a.agent, kind=a.kind, reason=a.reason, scope="subtree")
    return host.interrupt_agent(a.agent, kind=a.kind, reason=a.reason)


def _shape_interrupt(turns: Any) -> dict[str, Any]:
    if isinstance(turns, list | tuple):  # a subtree stop: the turns stopped
        return {"accepted": True, "turns": list(turns)}
    return {"accepted": True, "turn": turns}


def _stop_report(host: Any, a: StopReportArgs) -> Any:
    return host.stop_report(a.turn)


def _shape_report(report: Any) -> dict[str, Any]:
    return {"report": None if report is None else msgspec.to_builtins(report)}


def _pause(host: Any, a: PauseAgentArgs) -> Any:
    return host.pause_agent(a.agent, scope=a.scope, reason=a.reason)


def _resume(host: Any, a: ResumeAgentArgs) -> Any:
    return host.resume_agent(a.agent, scope=a.scope)


def _decide(host: Any, a: DecideApprovalArgs) -> Any:
    extra = {} if a.arguments is UNSET else {"arguments": a.arguments}
    return host.decide_approval(a.approval, a.decision, reason=a.reason, **extra)


def _run(host: Any, a: RunCommandArgs) -> Any:
    return host.run_command(list(a.argv), timeout=_given(a.timeout), cwd=_given(a.cwd))


def _shape_run(r: Any) -> dict[str, Any]:
    return {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}


_Invoke = Callable[[Any, Any], Any]
_Shape = Callable[[Any], dict[str, Any]]

# Tool name -> (argument Struct, invoke, shape). The order is the order of schemas().
_CALLS: dict[str, tuple[type[_Args], _Invoke, _Shape]] = {
    "spawn_agent": (SpawnAgentArgs, _spawn, lambda agent: {"agent": agent}),
    "send_message": (SendMessageArgs, _send, lambda m: {"sent": True, "message": m}),
    "list_agents": (
        ListAgentsArgs,
        _list,
        lambda agents: {"agents": msgspec.to_builtins(list(agents))},
    ),
    "interrupt_agent": (InterruptAgentArgs, _interrupt, _shape_interrupt),
    "pause_agent": (PauseAgentArgs, _pause, lambda ts: {"accepted": True, "turns": list(ts)}),
    "resume_agent": (ResumeAgentArgs, _resume, lambda ts: {"accepted": True, "turns": list(ts)}),
    "stop_report": (StopReportArgs, _stop_report, _shape_report),
    "list_approvals": (
        ListApprovalsArgs,
        lambda host, a: host.list_approvals(),
        lambda found: {"approvals": msgspec.to_builtins(list(found))},
    ),
    "decide_approval": (
        DecideApprovalArgs,
        _decide,
        lambda a: {"approval": msgspec.to_builtins(a)},
    ),
    "run_command": (RunCommandArgs, _run, _shape_run),
    "budget": (BudgetArgs, lambda host, a: host.budget(), lambda left: {"budget": left}),
}

_Impl = Callable[[ToolHost, Any], dict[str, Any]]


def _sync(invoke: _Invoke, shape: _Shape) -> _Impl:
    return lambda host, args: shape(invoke(host, args))


# Tool name -> (argument Struct, implementation). The order is the order of schemas().
TOOLS: dict[str, tuple[type[_Args], _Impl]] = {
    name: (args, _sync(invoke, shape)) for name, (args, invoke, shape) in _CALLS.items()
}


def _definition(name: str, args: type[msgspec.Struct]) -> tuple[str, dict[str, Any]]:
    (_,), components = msgspec.json.schema_components([args], ref_template="#/$defs/{name}")
    params = dict(components.pop(args.__name__))
    params.pop("title", None)
    description = " ".join(str(params.pop("description", name)).split())
    if components:  # nested Structs stay resolvable inside the parameters schema
        params["$defs"] = components
    return description, params


def parameters(args: type[msgspec.Struct]) -> tuple[str, dict[str, Any]]:
    """An argument Struct's (description, JSON Schema): what ``schemas`` offers a model,
    for other faces (the MCP server) that extend the same Structs."""
    return _definition(args.__name__, args)


def schemas(style: Literal["openai", "anthropic"] = "openai") -> list[dict[str, Any]]:
    """The tool definitions in the shape the model API expects.

    ``openai``: Chat Completions ``tools`` entries (``{"type": "function", "function":
    {...}}``); ``anthropic``: Messages API ``tools`` entries (``input_schema``).
    """
    out: list[dict[str, Any]] = []
    for name, (args, _) in TOOLS.items():
        description, params = _definition(name, args)
        if style == "openai":
            fn = {"name": name, "description": description, "parameters": params}
            out.append({"type": "function", "function": fn})
        elif style == "anthropic":
            out.append({"name": name, "description": description, "input_schema": params})
        else:
            raise ValueError(f"unknown schema style {style!r} (use 'openai' or 'anthropic')")
    return out


def _for_model(result: dict[str, Any]) -> dict[str, Any]:
    """A result as the model reads it: what it carries from other agents (a child's
    partial work, a slug) or from a command cannot hold a frame of Tether's."""
    out: dict[str, Any] = neutralized(result)
    return out


def _error(code: str, message: str) -> dict[str, Any]:
    return _for_model({"error": code, "message": message})


def _parse(arguments: str | bytes | Mapping[str, Any] | None) -> dict[str, Any]:
    if arguments is None or (isinstance(arguments, str | bytes) and not arguments.strip()):
        return {}  # models send "" (or nothing) for a call without arguments
    raw = msgspec.json.decode(arguments) if isinstance(arguments, str | bytes) else arguments
    if not isinstance(raw, Mapping):
        raise msgspec.ValidationError(f"Expected `object`, got `{type(raw).__name__}`")
    # Some models send null for an optional argument they mean to leave out.
    return {k: v for k, v in raw.items() if v is not None}


def _bound(
    name: str, arguments: str | bytes | Mapping[str, Any] | None
) -> tuple[_Args, _Invoke, _Shape] | dict[str, Any]:
    """The call ``call_tool`` and ``acall_tool`` make: the parsed arguments with the tool's
    invoke and shape, or the error result (a dict: nothing was called)."""
    tool = _CALLS.get(name)
    if tool is None:
        return _error("unknown-tool", f"no tool named {name!r}; tools: {', '.join(TOOLS)}")
    struct, invoke, shape = tool
    try:
        return msgspec.convert(_parse(arguments), struct), invoke, shape
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
        return _error("invalid-params", f"{name}: {exc}")
    except msgspec.DecodeError as exc:
        return _error("invalid-params", f"{name}: arguments are not valid JSON: {exc}")


def call_tool(
    host: ToolHost, name: str, arguments: str | bytes | Mapping[str, Any] | None
) -> dict[str, Any]:
    """Validate ``arguments`` for tool ``name`` and call it on ``host``.

    Returns the JSON-ready result (its text with Tether's frame tags neutralized: the
    model reads it beside Tether's own frames), or ``{"error": code, "message": ...}``
    for an unknown tool (``unknown-tool``), malformed JSON or arguments of the wrong shape
    (``invalid-params``; nothing was called), or a refusal from the runtime (the
    ``TetherError``'s code, e.g. ``subagent-unauthorized``). Other exceptions propagate.
    """
    call = _bound(name, arguments)
    if isinstance(call, dict):
        return call
    args, invoke, shape = call
    try:
        return _for_model(shape(invoke(host, args)))
    except TetherError as exc:
        return _error(exc.code, exc.message)


async def acall_tool(
    host: Any, name: str, arguments: str | bytes | Mapping[str, Any] | None
) -> dict[str, Any]:
    """``call_tool`` for an async context (``AsyncTurnContext``): the same validation and
    results, except that a ``Preempted`` error propagates (semantics §15.1: a preempt raises
    ``tether.Preempted`` at the innermost tool await)."""
    call = _bound(name, arguments)
    if isinstance(call, dict):
        return call
    args, invoke, shape = call
    try:
        return _for_model(shape(await invoke(host, args)))
    except Preempted:
        raise
    except TetherError as exc:
        return _error(exc.code, exc.message)
