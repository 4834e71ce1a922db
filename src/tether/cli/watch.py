"""``tether watch ROOT``: a live tree of a subtree, redrawn on its events.

The tree is re-read (``subagent.status`` + ``subagent.list``) after each burst of
events rather than patched from them, so what it shows is always one consistent walk.
Markers are printed above the tree as they arrive. With ``--json`` it prints one JSON
object per line instead: a ``snapshot`` of the tree, then each event as it arrives.
"""

from __future__ import annotations

from typing import Any, Final

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.tree import Tree

from tether.cli._terminal import json_line, shown
from tether.cli.client import Client, in_background

__all__ = ["render_tree", "watch"]

_STATE_STYLE: Final = {
    "running": "bold green",
    "paused": "bold cyan",  # frozen in place until resumed (semantics §14.4)
    "idle": "dim",
    "parked": "yellow",
    "disposing": "magenta",
    "dormant": "dim italic",
    "settled": "dim strike",
}


def _label(info: dict[str, Any]) -> str:
    style = _STATE_STYLE.get(str(info["state"]), "")
    slug = escape(shown(str(info.get("slug") or "-")))
    stopping = f" [red]stopping={escape(str(info['stopping']))}[/]" if info.get("stopping") else ""
    # An older server does not say: only an explicit False is "waiting".
    waiting = info["state"] == "running" and info.get("dispatched") is False
    return (
        f"[bold]{slug}[/] [dim]{escape(str(info['id']))}[/] [{style}]{info['state']}[/]"
        f" pending={info.get('pending', 0)}{stopping}"
        + (" [yellow]waiting for a worker[/]" if waiting else "")
    )


def render_tree(root: dict[str, Any], agents: list[dict[str, Any]]) -> Tree:
    """A rich Tree of a pre-order walk (``depth`` 1 = child of the root)."""
    tree = Tree(_label(root))
    path: list[Tree] = [tree]
    for info in agents:
        depth = int(info["depth"])
        del path[depth:]
        path.append(path[-1].add(_label(info)))
    return tree


def watch(client: Client, root: str, *, as_json: bool = False) -> int:
    """Follow ``root``'s subtree until the server ends the stream (0) or Ctrl-C."""
    pending = in_background(client.events(session=root))  # connected before the snapshot

    def walk() -> dict[str, Any]:
        info = client.call("subagent.status", {"session": root})
        agents = client.call("subagent.list", {"root": root, "scope": "descendants"})["agents"]
        return {"root": info, "agents": agents}

    names: dict[str, str] = {}  # id -> slug, for the marker lines

    def snapshot() -> Tree:
        tree = walk()
        for info in [tree["root"], *tree["agents"]]:
            names[info["id"]] = info.get("slug") or info["id"]
        return render_tree(tree["root"], tree["agents"])

    if as_json:
        print(json_line({"id": None, "event": "snapshot", "data": walk()}), flush=True)
        while (ev := pending.get()) is not None:
            print(json_line({"id": ev.id, "event": ev.event, "data": ev.data}), flush=True)
        return 0
    console = Console(highlight=False)
    with _Display(console, snapshot()) as display:
        while True:
            burst = [pending.get()]
            while not pending.empty():  # coalesce a burst into one redraw
                burst.append(pending.get())
            for ev in burst:
                if ev is not None and ev.event == "marker":
                    text = ev.data.get("data", {}).get("entry", {}).get("text", "")
                    session = str(ev.data.get("session", ""))
                    who = escape(shown(names.get(session, session)))
                    console.print(f"[cyan]{who}[/] {escape(shown(str(text)))}")
            if None in burst:
                console.print("[dim]the server ended the event stream[/]")
                return 0
            display.update(snapshot())


class _Display:
    """A live, redrawn tree on a terminal; elsewhere (a pipe, a log) each tree printed."""

    def __init__(self, console: Console, first: Tree) -> None:
        self._console = console
        self._live = (
            Live(first, console=console, auto_refresh=False) if console.is_terminal else None
        )
        if self._live is None:
            console.print(first)

    def update(self, tree: Tree) -> None:
        if self._live is not None:
            self._live.update(tree, refresh=True)
        else:
            self._console.print(tree)

    def __enter__(self) -> _Display:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
