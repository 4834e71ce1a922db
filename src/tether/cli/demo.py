"""``tether demo``: what Tether is for, in about twenty seconds.

A scripted lead spawns three continuable subagents doing visible work. While they run,
a person steers one, cancels another (it wraps up with a partial summary, and the work
queued behind it stays parked), and aborts a third that is wedged in a long ``sleep``
tool call. Then the parked one is woken and finishes its queue, in order.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text
from rich.tree import Tree

from tether import Runtime, User

__all__ = ["main"]

_STYLE = {
    "running": "bold green",
    "idle": "dim",
    "parked": "bold yellow",
    "dormant": "dim",
    "settled": "dim",
    "disposing": "red",
}


def _work(topic: str, steps: int) -> list[dict[str, Any]]:
    script: list[dict[str, Any]] = []
    for i in range(1, steps + 1):
        script.append({"op": "say", "text": f"{topic}: step {i}/{steps}"})
        script.append({"op": "work", "steps": 5, "every": 0.05})
    script.append({"op": "say", "text": f"{topic}: done"})
    return script


def _render(rt: Runtime, lead: str, headline: str) -> Group:
    tree = Tree(Text(f"lead  ({rt.status(lead).state})", style="bold"))
    agents = rt.list_agents(lead, scope="descendants")
    for a in agents:
        last = rt.transcript(a.id)[-1:] if a.state != "dormant" else []
        tail = last[0].text if last else ""
        line = Text.assemble(
            (f"{a.slug or a.id:<11}", "bold"),
            (f"{a.state:<8}", _STYLE.get(a.state, "")),
            f" queue={a.pending}",
            (f" stopping={a.stopping}" if a.stopping else "", "red"),
            ("  " + tail[:70], "cyan"),
        )
        tree.add(line)
    running = sum(a.state == "running" for a in agents)
    done = sum(len(rt.turns(a.id)) for a in agents if a.state != "running")
    progress = Text(f"{headline}   [{running} running, {done} turns ended]", style="magenta")
    return Group(tree, progress)


def _until(
    rt: Runtime, live: Live, lead: str, headline: str, done: Callable[[], bool], timeout: float
) -> None:
    """Redraw the tree until ``done()``; a demo that hangs is a failed demo."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo step timed out: {headline}")
        live.update(_render(rt, lead, headline))
        time.sleep(0.1)  # the display's frame rate, not a synchronization
    live.update(_render(rt, lead, headline))


def _note(rt: Runtime, live: Live, slug: str, sid: str, what: str) -> None:
    """One line per step, printed above the live tree (and kept when output is a file)."""
    info = rt.status(sid)
    markers = [e.text for e in rt.transcript(sid) if e.kind == "marker"]
    line = Text.assemble(
        ("→ ", "bold"),
        (f"{slug}: {what}", "bold"),
        f"   state={info.state} queue={info.pending}",
        (f"   {markers[-1]}" if markers else "", "yellow"),
    )
    live.console.print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tether demo",
        description="Run the embedded demo: a lead and three subagents, steered, "
        "cancelled and aborted while they work. Example: tether demo",
    )
    parser.add_argument(
        "--agent",
        action="store_true",
        help="model agents (tether.agents:ChatAgent) against a local scripted model "
        "server: a steer, a cancel cutting a streamed reply, a preempt of a hung tool "
        "(needs the extra tether-runtime[agents])",
    )
    parser.add_argument(
        "--adapters",
        action="store_true",
        help="one agent of each hosted framework (Pydantic AI, the OpenAI Agents SDK, "
        "Claude Code) against the same server: a steer, a cancel mid-stream, and an "
        "abort that leaves no process of a Bash command's setsid escapee (each needs "
        "its extra; a missing one is skipped)",
    )
    args = parser.parse_args(argv)
    if args.agent:
        from tether.cli.demo_agent import main as agent_main

        return agent_main()
    if args.adapters:
        from tether.cli.demo_adapters import main as adapters_main

        return adapters_main()
    console = Console()
    console.rule("[bold]Tether demo: steer, cancel and abort running subagents")
    with Runtime(workers=3, grace=2.0) as rt:
        lead = rt.open_session("tether:Scripted", slug="lead")
        rt.prompt(
            lead,
            "Fix the flaky build",
            data={
                "steps": [
                    {"op": "say", "text": "Splitting the job between three subagents."},
                    {
                        "op": "spawn",
                        "slug": "researcher",
                        "data": {"steps": _work("reading logs", 12)},
                    },
                    {
                        "op": "spawn",
                        "slug": "writer",
                        "data": {"steps": _work("drafting patch", 12)},
                    },
                    {
                        "op": "spawn",
                        "slug": "tester",
                        "data": {
                            "steps": [
                                {"op": "say", "text": "running the full test suite (slow)"},
                                {"op": "tool", "argv": ["sh", "-c", "sleep 300 & sleep 300; wait"]},
                            ]
                        },
                    },
                    {"op": "say", "text": "Three subagents are at work."},
                ]
            },
        )
        rt.wait(lead, timeout=30)
        kids = {a.slug: a.id for a in rt.list_agents(lead)}
        me = User(parent=lead)  # a person with no name: markers read "by user"

        def turns_ended(sid: str, n: int) -> Callable[[], bool]:
            return lambda: sum(t.outcome is not None for t in rt.turns(sid)) >= n

        def said(sid: str, needle: str) -> Callable[[], bool]:
            return lambda: any(needle in e.text for e in rt.transcript(sid))

        with Live(console=console, refresh_per_second=10, transient=False) as live:
            _until(rt, live, lead, "subagents working", said(kids["writer"], "step 3/"), 30)

            rt.interrupt(
                kids["researcher"],
                authority=me,
                kind="steer",
                reason="focus on the test that fails on CI, not the linter",
            )
            _until(rt, live, lead, "steered researcher", said(kids["researcher"], "<steer"), 30)
            _note(
                rt,
                live,
                "researcher",
                kids["researcher"],
                "steered; it reads the correction and goes on",
            )

            rt.send(kids["writer"], "then update the changelog", authority=me, wake=False)
            rt.interrupt(
                kids["writer"], authority=me, kind="cancel", reason="out of budget for now"
            )
            _until(
                rt,
                live,
                lead,
                "cancelled writer (its queue stays parked)",
                turns_ended(kids["writer"], 1),
                30,
            )
            _note(rt, live, "writer", kids["writer"], "cancelled; wrapped up, follow-up parked")

            rt.interrupt(kids["tester"], authority=me, kind="abort", reason="wedged in sleep")
            _until(
                rt,
                live,
                lead,
                "aborted tester (its whole process tree is killed)",
                turns_ended(kids["tester"], 1),
                30,
            )
            _note(rt, live, "tester", kids["tester"], "aborted; sh and both sleeps are gone")

            rt.send(kids["writer"], "resume: finish the patch", authority=me)
            _until(
                rt,
                live,
                lead,
                "woke writer: its parked queue runs first, in order",
                turns_ended(kids["writer"], 3),
                60,
            )
            _note(
                rt,
                live,
                "writer",
                kids["writer"],
                "woken; ran the parked follow-up, then the new one",
            )
            _until(rt, live, lead, "waiting for researcher", turns_ended(kids["researcher"], 1), 60)
            # The last frame stays on screen: it says how things ended, not what was awaited.
            live.update(_render(rt, lead, "every subagent's turns have ended"))

        console.print()
        console.rule("[bold]Transcripts (last lines)")
        for slug, sid in kids.items():
            console.print(
                f"[bold]{slug}[/bold]  turns: " + ", ".join(f"{t.outcome}" for t in rt.turns(sid))
            )
            for e in rt.transcript(sid)[-5:]:
                style = "yellow" if e.kind == "marker" else ""
                console.print(Text(f"  {e.kind:<9} {e.text[:100]}", style=style))
        console.rule("[bold]Markers")
        for slug, sid in kids.items():
            for e in rt.transcript(sid):
                if e.kind == "marker":
                    console.print(Text(f"  {slug:<11} {e.text}", style="yellow"))
    console.print("[bold green]demo finished: every process stopped[/bold green]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
