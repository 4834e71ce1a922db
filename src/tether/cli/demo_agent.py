"""``tether demo --agent``: model agents stopped inside their work, in about fifteen seconds.

A lead session has three ``tether.agents:ChatAgent`` subagents talking to the model server
of ``tether.testing`` (a real HTTP server on loopback replaying a script: no key, no
network). A person steers one mid-stream (its next request carries the ``<steer>``), cancels
another mid-reply (the stream is closed at once, the partial reply kept, and the server
saw the client go), and preempts the third's hung MCP tool call (the MCP server gets
``notifications/cancelled``, the model is told, and the turn goes on).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.text import Text

from tether import Runtime, User
from tether.cli._wait import wait as _wait
from tether.testing.mcp_server import LOG_ENV, read_log
from tether.testing.model_server import ModelServer

__all__ = ["main"]

CHAT = "tether.agents:ChatAgent"
_HUNG_FOR = 1.5  # seconds the tester's MCP call hangs before the preempt

_SCRIPTS: dict[str, list[dict[str, Any]]] = {
    "researcher": [
        {
            "text": "I'll start by grepping the whole repository for every timeout setting.",
            "tool_calls": [
                {"name": "run_command", "arguments": {"argv": ["sh", "-c", "echo 41 matches"]}}
            ],
            "chunk": 4,
            "pace": 0.04,
        },
        {"text": "Switching to the CI log as asked: the failure is test_net's 2 s timeout."},
    ],
    "writer": [
        {
            "text": "Here is the full design document for the new retry policy. Section 1: "
            "goals. Section 2: the backoff schedule, with jitter, caps and budgets. "
            "Section 3: ...",
            "chunk": 6,
            "pace": 0.05,
            "hang": True,
        }
    ],
    "tester": [
        {
            "text": "Searching the issue tracker through its MCP server.",
            "tool_calls": [{"name": "mcp__tracker__hang", "arguments": {"seconds": 300}}],
        },
        {"text": "The tracker search hung; I'll answer from the CI log alone."},
    ],
}


def main(argv: list[str] | None = None) -> int:
    del argv
    console = Console()
    console.rule("[bold]Tether demo: stopping model agents inside their work")
    with (
        tempfile.TemporaryDirectory(prefix="tether-demo-") as tmp,
        ModelServer() as server,
        Runtime(workers=3, grace=2.0) as rt,
    ):
        for name, replies in _SCRIPTS.items():
            server.script(name, replies)
        console.print(f"model server (OpenAI-compatible, scripted): {server.url}")
        lead = rt.open_session("tether:Scripted", slug="lead")
        me = User(parent=lead)  # a person with no name: markers read "by user"
        mcp_log = os.path.join(tmp, "mcp.log")
        kids = _spawn_team(rt, server.url, lead, mcp_log)
        demo = _Demo(console, rt, server, me, lead, kids, mcp_log)
        _steer(demo)
        _cancel(demo)
        _preempt(demo)
        _markers(demo)
    console.print("[bold green]demo finished: every stream closed, every process stopped[/]")
    return 0


def _spawn_team(rt: Runtime, url: str, lead: str, mcp_log: str) -> dict[str, str]:
    """One ChatAgent per script below ``lead``, each its own model name on the server."""
    kids: dict[str, str] = {}
    tracker = {
        "command": [sys.executable, "-m", "tether.testing.mcp_server"],
        "env": {LOG_ENV: mcp_log, "PYTHONPATH": os.pathsep.join(sys.path)},
    }
    for name in _SCRIPTS:
        config: dict[str, Any] = {
            "model": {"base_url": url, "name": name, "retries": 1},
            "system": f"You are the team's {name}.",
            "tools": ["run_command"],
        }
        if name == "tester":  # an MCP tool server of its own (stdio, the SDK's)
            config["mcp"] = {"servers": {"tracker": tracker}, "grace": 2.0}
        kids[name] = str(rt.spawn(lead, CHAT, slug=name, config=config))
    return kids


@dataclass(frozen=True, slots=True)
class _Demo:
    """What each act of the demo works with."""

    console: Console
    rt: Runtime
    server: ModelServer
    me: User
    lead: str
    kids: dict[str, str]
    mcp_log: str

    def ended(self, sid: str) -> Callable[[], bool]:
        return lambda: any(t.outcome for t in self.rt.turns(sid))

    def say(self, line: str, style: str = "") -> None:
        self.console.print(Text(line, style=style))


def _steer(d: _Demo) -> None:
    """1. A steer changes course mid-stream."""
    rt, server, sid = d.rt, d.server, d.kids["researcher"]
    d.console.rule("1. steer: a correction reaches the model's next request")
    rt.send(sid, "Why is CI flaky?", authority=d.me)
    _wait("the researcher's request", lambda: server.requests_for("researcher"))
    rt.interrupt(sid, authority=d.me, kind="steer", reason="look at the CI log instead")
    d.say("→ steered while its first reply was still streaming", "bold")
    _wait("the researcher's turn", d.ended(sid))
    second = server.requests_for("researcher")[1].body["messages"][-1]["content"]
    d.say(f"  next request ends with: {second}", "yellow")
    for e in rt.transcript(sid):
        if e.kind in ("assistant", "tool"):
            d.say(f"  {e.kind:<9} {e.text[:90]}")


def _cancel(d: _Demo) -> None:
    """2. A cancel cuts a streaming reply."""
    rt, server, sid = d.rt, d.server, d.kids["writer"]
    d.console.rule("2. cancel: the stream is cut at once, the partial reply kept")
    rt.send(sid, "Write the retry-policy design doc.", authority=d.me)
    _wait("the writer's stream", lambda: any(r.hanging for r in server.requests_for("writer")))
    start = time.time()
    rt.interrupt(sid, authority=d.me, kind="cancel", reason="enough detail")
    _wait("the writer's turn", d.ended(sid))
    [turn] = rt.turns(sid)
    [request] = server.requests_for("writer")
    gone = server.wait_disconnect(request.id)
    partial = [e.text for e in rt.transcript(sid) if e.kind == "assistant"]
    d.say(f"→ turn {turn.outcome}; partial reply kept: {(partial or [''])[-1][:70]!r}…", "bold")
    end_ms = ((turn.ended_at or start) - start) * 1000
    d.say(
        f"  server saw the disconnect {(gone.time - start) * 1000:.0f} ms after the "
        f"cancel; the turn ended {end_ms:.0f} ms after it",
        "yellow",
    )
    notice = _wait("the lead's notice", lambda: _notice(rt, d.lead, sid))
    d.say(f"  the lead's notice carries it: {notice[:70]!r}…")


def _preempt(d: _Demo) -> None:
    """3. A preempt stops only the hung MCP tool."""
    rt, server, sid = d.rt, d.server, d.kids["tester"]
    d.console.rule("3. preempt: only the hung MCP call stops; the server is told, the turn goes on")
    rt.send(sid, "Find the flaky test's issue.", authority=d.me)
    call = _wait("the MCP call", lambda: _logged(d.mcp_log, "tools/call"), timeout=60)
    # Let the call hang a visible while: a preempt the moment it arrives would tell
    # the model "preempted after 0.0 s", which is no hung tool.
    time.sleep(_HUNG_FOR)
    d.say(f"→ the tracker call has hung for {_HUNG_FOR:.1f} s: preempting it", "bold")
    rt.interrupt(sid, authority=d.me, kind="preempt", reason="the tracker is hung")
    _wait("the tester's turn", d.ended(sid), timeout=60)
    cancelled = _logged(d.mcp_log, "notifications/cancelled")
    if cancelled is not None:
        d.say(
            f"→ the MCP server got notifications/cancelled for request "
            f"{cancelled.get('requestId')} (the call was {call.get('id')})",
            "bold",
        )
    tool = server.requests_for("tester")[1].body["messages"][-1]["content"]
    d.say(f"→ turn {rt.turns(sid)[0].outcome}; the model got:", "bold")
    for line in tool.splitlines()[:3]:
        d.say(f"  {line}", "yellow")
    last = [e.text for e in rt.transcript(sid) if e.kind == "assistant"][-1]
    d.say(f"  and answered: {last}")


def _markers(d: _Demo) -> None:
    d.console.rule("[bold]Markers")
    for name, sid in d.kids.items():
        for e in d.rt.transcript(sid):
            if e.kind == "marker":
                d.say(f"  {name:<11} {e.text}", "yellow")


def _notice(rt: Runtime, lead: str, child: str) -> str | None:
    for e in rt.transcript(lead):
        notice = (e.data or {}).get("notice") if e.kind == "notice" else None
        if notice and notice.get("child") == child:
            return str(notice.get("partial") or "")
    return None


def _logged(path: str, method: str) -> dict[str, Any] | None:
    """The first record of ``method`` the MCP server logged, if any yet."""
    return next((r for r in read_log(path) if r.get("method") == method), None)
