"""The terminal UI under load (SPEC §17.3): how soon an event reaches the screen.

A real ``tether serve`` (a subprocess) holds a tree of 1,000 sessions (a root, 9 children,
111 grandchildren each); ``TetherTui`` runs headless in this process on that root, at 160
by 50 cells, as ``tether tui`` would. A load thread sends 50 messages a second (``wake``
false) to sessions of the tree, each one two events (``message.accepted`` and the
``state`` with its new pending count): 100 events a second over the whole tree. Every
second send goes to one of the 30 grandchildren drawn on screen, the others to the rest
of the tree, off screen.

`event_to_screen_ms`: an event's ``ts`` (the server's clock when the runtime emitted it)
→ the tree's row of that session drawn with it (``SessionTree.on_drawn``, called as the
row's label is rendered for the screen); one clock, this machine's. Only rows on screen
are drawn, so the samples are the on-screen half of the sends; the other half is load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._case import Cfg, Samples, Skip, poll_until

CHILDREN = 9
GRANDCHILDREN = 111  # 1 + 9 + 9 * 111 = 1,000 sessions
SENDS_PER_S = 50  # two events each: 100 events a second
ON_SCREEN = 30  # grandchildren drawn on screen that every second send goes to
SIZE = (160, 50)


class _Server:
    """``tether serve`` on a free loopback port, its store in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        out = workdir / "serve.out"
        cmd = [
            sys.executable,
            "-c",
            "from tether.cli import main; raise SystemExit(main())",
            "serve",
            "--port",
            "0",
            "--path",
            str(workdir / "state.db"),
            "--workers",
            "1",
        ]
        with out.open("wb") as sink:
            self.proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.DEVNULL)

        def bound() -> str | None:
            if self.proc.poll() is not None:
                raise RuntimeError("tether serve exited early")
            found = re.search(r"serving (http://\S+)", out.read_text())
            return found.group(1) if found else None

        self.url: str = poll_until(bound, 60.0, "tether serve to listen", interval=0.05)
        self.token = (workdir / "token").read_text().strip()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _spawn_tree(client: Any) -> tuple[str, list[str], list[str]]:
    """The root; the grandchildren on screen; every other session below the root."""
    root = client.call("session.open", {"driver": "tether:Scripted", "slug": "root"})["session"]
    spawn = {"driver": "tether:Scripted"}
    kids = [
        client.call("subagent.spawn", {**spawn, "parent": root, "slug": f"c{i}"})["session"]
        for i in range(CHILDREN)
    ]
    grand: list[list[str]] = []
    for i, kid in enumerate(kids):
        calls = [
            ("subagent.spawn", {**spawn, "parent": kid, "slug": f"g{i}-{j}"})
            for j in range(GRANDCHILDREN)
        ]
        answers = client.batch(calls)
        bad = [a for a in answers if not isinstance(a, dict)]
        if bad:
            raise RuntimeError(f"spawn refused: {bad[0]}")
        grand.append([str(a["session"]) for a in answers])
    on_screen = grand[0][:ON_SCREEN]
    rest = [*kids, *grand[0][ON_SCREEN:], *(g for row in grand[1:] for g in row)]
    return root, on_screen, rest


def _load(
    client: Any, root: str, on_screen: list[str], rest: list[str], stop: threading.Event
) -> None:
    """``SENDS_PER_S`` no-wake sends a second, alternately on screen and off it."""
    near, far = itertools.cycle(on_screen), itertools.cycle(rest)
    parents: dict[str, str] = {}
    for info in client.call("subagent.list", {"root": root, "scope": "descendants"})["agents"]:
        parents[str(info["id"])] = str(info["parent"])
    period = 1.0 / SENDS_PER_S
    next_at = time.monotonic()
    for i in itertools.count():
        if stop.is_set():
            return
        sid = next(near) if i % 2 == 0 else next(far)
        address = {"session": sid, "parent": parents[sid], "mode": "continuable"}
        client.call("subagent.send", {"address": address, "content": "x", "wake": False})
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)


async def _run(
    cfg: Cfg, server: _Server, root: str, on_screen: list[str], rest: list[str]
) -> list[Samples]:
    from tether.cli.client import Client
    from tether.tui import TetherTui

    app = TetherTui(Client(server.url, token=server.token), root=root, name="bench")
    drawn: list[float] = []
    measuring = False

    def on_drawn(_sid: str, ts: float) -> None:
        if measuring:
            drawn.append((time.time() - ts) * 1000)

    reps: list[Samples] = []
    async with app.run_test(size=SIZE, headless=True) as pilot:
        app.tree_view.on_drawn = on_drawn
        deadline = time.monotonic() + 120
        while len(app.model.order) < CHILDREN * (GRANDCHILDREN + 1):
            if time.monotonic() > deadline:
                raise RuntimeError("the tree of 1,000 never listed")
            await pilot.pause(0.05)
        await pilot.pause(1.0)  # its budgets read, its first frames drawn
        stop = threading.Event()
        load = threading.Thread(
            target=_load, args=(Client(server.url, token=server.token), root, on_screen, rest, stop)
        )
        load.start()
        try:
            await pilot.pause(1.0)  # the load under way
            window = cfg.n(8, 20)
            for _ in range(cfg.n(3, 5)):
                drawn.clear()
                feed = app.feed
                assert feed is not None
                before, t0 = feed.received, time.monotonic()
                measuring = True
                await pilot.pause(window)
                measuring = False
                rate = (feed.received - before) / (time.monotonic() - t0)
                cfg.note(
                    f"{len(drawn)} rows drawn a window of {window} s, {rate:.0f} events/s reached "
                    f"the UI over the 1,000-session tree",
                    key=f"rate{len(reps)}",
                )
                reps.append({"event_to_screen_ms": list(drawn), "events_per_s": [rate]})
        finally:
            stop.set()
            load.join(timeout=30)
    return reps


def tui_event_to_screen(cfg: Cfg) -> Iterator[Samples]:
    """An event → its row drawn, 100 events a second over a 1,000-session tree."""
    try:
        import textual  # noqa: F401
    except ImportError as e:
        raise Skip(f"Textual is not installed ({e}); pip install 'tether-runtime[tui]'") from e
    with tempfile.TemporaryDirectory() as tmp:
        server = _Server(Path(tmp))
        try:
            from tether.cli.client import Client

            client = Client(server.url, token=server.token)
            root, on_screen, rest = _spawn_tree(client)
            reps = asyncio.run(_run(cfg, server, root, on_screen, rest))
        finally:
            with contextlib.suppress(Exception):
                server.stop()
        yield from reps
