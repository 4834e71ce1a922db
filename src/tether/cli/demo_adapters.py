"""``tether demo --adapters``: agents written with other frameworks, stopped inside their
work (semantics §16.1).

One agent of each framework Tether hosts talks to the model server of ``tether.testing``
(a real HTTP server on loopback replaying a script, OpenAI and Anthropic wire: no key, no
network): a Pydantic AI agent, an OpenAI Agents SDK agent, and Claude Code through its
bundled CLI. Each is steered while its reply streams (the framework's next model request
carries the ``<steer>``) and cancelled mid-stream (the server sees the client go, the
partial reply is kept). Claude Code then runs a Bash command that leaves a ``setsid``
escapee behind (its environment cleared, SIGTERM ignored); an abort stops the CLI, the
command and the escapee, and the stop report lists each of them ``dead``. A framework
whose extra is not installed is skipped, with the line that installs it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.text import Text

from tether import Runtime, User
from tether.cli._wait import wait
from tether.testing.escapee import escapee as escapee_command
from tether.testing.escapee import escapee_procs
from tether.testing.model_server import ModelServer, Request

__all__ = ["main"]

_CLAUDE_MODEL = "claude-sonnet-4-5"  # the CLI refuses model names it does not know
_KEY_ENV = "TETHER_DEMO_ANTHROPIC_KEY"  # the CLI's ANTHROPIC_API_KEY: anything will do
_TIMEOUT = 90.0  # seconds a step may take (a CLI starts in a second or two)
_STALLED = 0.3  # seconds a cut reply visibly hangs before the cancel


@dataclass(frozen=True)
class _Framework:
    title: str
    module: str  # the framework's import name: missing means its extra is missing
    extra: str
    adapter: str
    factory: str | None  # a framework agent's factory (Claude Code has none: the CLI)


_FRAMEWORKS = [
    _Framework(
        "Pydantic AI",
        "pydantic_ai",
        "pydantic-ai",
        "tether.adapters.pydantic_ai:PydanticAIAgent",
        "tether.cli.demo_frameworks:pydantic_ai_agent",
    ),
    _Framework(
        "OpenAI Agents SDK",
        "agents",
        "openai-agents",
        "tether.adapters.openai_agents:OpenAIAgentsAgent",
        "tether.cli.demo_frameworks:openai_agents_agent",
    ),
    _Framework(
        "Claude Code",
        "claude_agent_sdk",
        "claude",
        "tether.adapters.claude_code:ClaudeCodeAgent",
        None,
    ),
]

_LONG = (
    "Here is the full migration report. Part one: the schema changes, table by table. "
    "Part two: the backfill, batch sizes and throttles. Part three: ..."
)


def _replies(fw: _Framework, name: str, escapee: str) -> list[dict[str, Any]]:
    """The script of one framework's agent: a streamed reply with a tool call (the steer
    lands meanwhile), the answer to the steer, a reply that hangs mid-sentence (the
    cancel); for Claude Code, a Bash command that leaves an escapee (the abort)."""
    if fw.factory is None:
        call = {"name": "Bash", "arguments": {"command": "echo slow-path", "description": "run"}}
    else:
        call = {"name": "lookup", "arguments": {"topic": "the slow path"}}
    replies: list[dict[str, Any]] = [
        {
            "text": f"{name}: checking the slow path first, step by step.",
            "tool_calls": [call],
            "chunk": 3,
            "pace": 0.05,
        },
        {"text": f"{name}: switched to the fast path, as asked."},
        {"text": _LONG, "chunk": 6, "pace": 0.02, "hang": True},
    ]
    if fw.factory is None:
        bash = {"command": escapee_command(escapee, "sleep 60; echo never"), "description": "build"}
        replies.append({"tool_calls": [{"name": "Bash", "arguments": bash}]})
    return replies


def _wait(what: str, done: Callable[[], Any]) -> Any:
    return wait(what, done, _TIMEOUT)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _config(fw: _Framework, server: ModelServer, name: str, home: str) -> dict[str, Any]:
    if fw.factory is not None:
        model = {"base_url": server.url, "name": name, "retries": 0, "timeout": 60}
        return {"agent": fw.factory, "model": model}
    os.makedirs(home, exist_ok=True)
    claude = {
        "model": _CLAUDE_MODEL,
        "allowed_tools": ["Bash"],  # as root the CLI refuses its bypass-permissions mode
        "cwd": home,
        "env": {"HOME": home},
    }
    return {"claude": claude, "model": {"base_url": server.root, "api_key_env": _KEY_ENV}}


def _said(request: Request) -> list[str]:
    """Every text a request sent the model, in order (strings, text blocks, tool results)."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key in ("text", "content"):
                walk(node.get(key))

    walk(request.body.get("messages", []))
    return out


def main(argv: list[str] | None = None) -> int:
    del argv
    console = Console()

    def say(line: str, style: str = "") -> None:
        console.print(Text(line, style=style))

    console.rule("[bold]Tether demo: agents of other frameworks, stopped inside their work")
    with (
        tempfile.TemporaryDirectory(prefix="tether-demo-") as tmp,
        _env(_KEY_ENV, "x"),
        ModelServer() as server,
        Runtime(workers=3, grace=2.0) as rt,
    ):
        say(f"model server (OpenAI and Anthropic wire, scripted): {server.root}")
        lead = rt.open_session("tether:Scripted", slug="lead")
        me = User(parent=lead)  # a person with no name: markers read "by user"
        for i, fw in enumerate(_FRAMEWORKS, 1):
            console.rule(f"{i}. {fw.title}")
            if importlib.util.find_spec(fw.module) is None:
                say(f"skipped: pip install 'tether-runtime[{fw.extra}]' brings {fw.title}", "dim")
                continue
            _framework(rt, server, lead, me, fw, os.path.join(tmp, fw.extra), say)
    console.print("[bold green]demo finished: every stream closed, every process stopped[/]")
    return 0


def _framework(
    rt: Runtime,
    server: ModelServer,
    lead: str,
    me: User,
    fw: _Framework,
    home: str,
    say: Callable[..., None],
) -> None:
    name = fw.extra if fw.factory is not None else _CLAUDE_MODEL  # its script's name
    slug = fw.extra.replace("-", "_")
    token = f"tether-demo-escapee-{uuid.uuid4().hex[:8]}"
    server.script(name, _replies(fw, slug, token))
    sid = str(rt.spawn(lead, fw.adapter, slug=slug, config=_config(fw, server, name, home)))
    agent = _Agent(rt, server, fw, name, sid, me, say)
    _steer(agent)
    _cancel(agent)
    if fw.factory is None:
        _abort(rt, sid, me, token, say)


@dataclass(frozen=True)
class _Agent:
    """One framework's agent, as the demo's steps drive and watch it."""

    rt: Runtime
    server: ModelServer
    fw: _Framework
    name: str  # its script's name on the model server
    sid: str
    me: User
    say: Callable[..., None]

    def ended(self, count: int) -> Callable[[], bool]:
        return lambda: sum(1 for t in self.rt.turns(self.sid) if t.outcome) >= count

    def asked(self, count: int) -> list[Request]:
        found = self.server.requests_for(self.name)
        return found if len(found) >= count else []


def _steer(a: _Agent) -> None:
    """A steer while the reply streams: the framework's next model request carries it."""
    rt, fw, say = a.rt, a.fw, a.say
    rt.send(a.sid, "Plan the database migration.", authority=a.me)
    _wait(f"{fw.title}'s first request", lambda: a.asked(1))
    rt.interrupt(a.sid, authority=a.me, kind="steer", reason="take the fast path")
    say("→ steered while its first reply was still streaming", "bold")
    _wait(f"{fw.title}'s first turn", a.ended(1))
    steer = _carried_steer(a.asked(2)[1], cli=fw.factory is None)
    say(f"  its next model request carries: {steer}", "yellow")
    for e in rt.transcript(a.sid):
        if e.kind in ("assistant", "tool", "marker"):
            say(f"  {e.kind:<9} {e.text[:90]}")


def _carried_steer(request: Request, *, cli: bool) -> str:
    """The last ``<steer>`` a model request carried."""
    steer = next((t for t in reversed(_said(request)) if "<steer" in t), "(no steer in it)")
    if cli:  # the CLI folds it into the tool result, as a system reminder
        steer = steer[steer.find("<steer") :].split("</steer>")[0] + "</steer>"
    return steer


def _cancel(a: _Agent) -> None:
    """A cancel mid-stream: the server sees the client go, the partial reply is kept."""
    rt, fw, say = a.rt, a.fw, a.say
    rt.send(a.sid, "Write the migration report.", authority=a.me)
    request = _wait(
        f"{fw.title}'s stream", lambda: next((r for r in a.asked(3)[2:3] if r.hanging), None)
    )
    time.sleep(_STALLED)  # the reply visibly stalls mid-sentence: then the person cancels
    start = time.time()
    rt.interrupt(a.sid, authority=a.me, kind="cancel", reason="enough detail")
    _wait(f"{fw.title}'s cancelled turn", a.ended(2))
    turn = rt.turns(a.sid)[1]
    gone = a.server.wait_disconnect(request.id, timeout=_TIMEOUT)
    cut = [e for e in rt.transcript(a.sid) if e.kind == "assistant" and (e.data or {}).get("cut")]
    partial = cut[-1].text if cut else ""
    say(f"→ turn {turn.outcome}; partial reply kept: {partial[:60]!r}…", "bold")
    say(
        f"  server saw the disconnect {(gone.time - start) * 1000:.0f} ms after the cancel; "
        f"the turn ended {((turn.ended_at or start) - start) * 1000:.0f} ms after it",
        "yellow",
    )


def _abort(rt: Runtime, sid: str, me: User, token: str, say: Callable[..., None]) -> None:
    """Claude Code's Bash command leaves an escapee; an abort leaves nothing."""
    rt.send(sid, "Run the build.", authority=me)
    escaped = _wait("the escapee", lambda: escapee_procs(token))
    runaway = escaped[0].pid
    say(f"→ its Bash command left an escapee behind: {token}, pid {runaway}", "bold")
    say("  (double-forked, setsid, its environment cleared, SIGTERM ignored)")
    turn = rt.interrupt(sid, authority=me, kind="abort", reason="stop it all")
    _wait("the aborted turn", lambda: len([t for t in rt.turns(sid) if t.outcome]) >= 3)
    [record] = [t for t in rt.turns(sid) if t.id == turn]
    report = _wait("the abort's stop report", lambda: rt.stop_report(str(turn)))
    left = escapee_procs(token)
    say(f"→ turn {record.outcome}; the stop report's processes:", "bold")
    for p in report.processes:
        say(
            f"  pid {p.pid:<8} {p.signal:<8} {p.fate:<5} {_who(p.argv, runaway == p.pid)}", "yellow"
        )
    fates = sorted({p.fate for p in report.processes})
    say(
        f"  {len(report.processes)} processes signalled, fates {json.dumps(fates)}; "
        f"escapees still alive: {len(left)}",
        "bold",
    )


def _who(argv: list[str], escapee: bool) -> str:
    """A signalled process, in a few words."""
    if escapee:
        return f"{argv[0]}  ← the escapee"
    line = " ".join([os.path.basename(argv[0]), *argv[1:]]) if argv else "?"
    if "claude_agent_sdk" in " ".join(argv):
        return "the Claude Code CLI"
    if "python" in os.path.basename(argv[0] if argv else ""):
        return "the turn's worker"
    if argv and os.path.basename(argv[0]) == "bash":
        return "the CLI's Bash command"
    return line[:50]
