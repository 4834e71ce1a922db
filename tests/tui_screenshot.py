"""Make the README's screenshot of the terminal UI (docs/tui.svg, Textual's SVG export).

    .venv/bin/python tests/tui_screenshot.py

A live ``tether serve`` with the console screenshots' small scripted tree (a budget on the
lead, a steered researcher with a message waiting, a cancelled coder, a tester running a
unit run), shown by ``TetherTui`` headless with the researcher selected. Not a test: pytest
does not collect it.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from drivers import ROOT
from tether.cli.client import Client
from tether.tui import TetherTui
from tether_server import LiveServer, rpc_address, running_server

DOCS = ROOT / "docs"
SIZE = (132, 30)


def _spawn(server: LiveServer, parent: str, slug: str, prompt: str, *steps: Any) -> str:
    params = {"parent": parent, "driver": "tether:Scripted", "slug": slug, "prompt": prompt}
    child: str = server.call("subagent.spawn", {**params, "data": {"steps": list(steps)}})[
        "session"
    ]
    return child


def _scene(server: LiveServer) -> dict[str, str]:
    opened = {"driver": "tether:Scripted", "slug": "lead", "budget": {"turns": 20}}
    root = server.call("session.open", opened)["session"]
    hang = {"op": "hang"}
    ids = {
        "root": root,
        "researcher": _spawn(
            server,
            root,
            "researcher",
            "Find why CI fails on main",
            {"op": "say", "text": "Reading the CI logs of the last 20 runs."},
            {"op": "say", "text": "3 of 20 failed, all in test_http_retry."},
            hang,
        ),
        "coder": _spawn(
            server,
            root,
            "coder",
            "Make the HTTP client retry on 503",
            {"op": "say", "text": "Rewriting the HTTP client from scratch."},
            hang,
        ),
        "tester": _spawn(server, root, "tester", "Run the suite", hang),
    }
    ids["unit"] = _spawn(server, ids["tester"], "unit", "Run the unit tests", hang)
    for key in ("researcher", "coder", "unit"):
        server.wait_state(ids[key], "running")
    steer = "Focus on the flaky retry test, not the network."
    server.call(
        "subagent.interrupt",
        {
            "address": rpc_address(ids["researcher"], root),
            "kind": "steer",
            "reason": steer,
            "name": "alice",
        },
    )
    server.call(
        "subagent.interrupt",
        {
            "address": rpc_address(ids["coder"], root),
            "kind": "cancel",
            "reason": "Wrong approach: keep the client, fix the retry policy.",
            "name": "alice",
        },
    )
    server.wait_state(ids["coder"], "parked")
    server.call(
        "subagent.send",
        {
            "address": rpc_address(ids["researcher"], root),
            "content": "Also check the retry settings.",
            "name": "alice",
        },
    )
    return ids


async def _shoot(server: LiveServer, ids: dict[str, str]) -> str:
    app = TetherTui(Client(server.url, token=server.token), root=ids["root"], name="alice")
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 30
        while not (
            len(app.model.order) == 4
            and app.model.rows[ids["unit"]].state == "running"
            and app.model.gauge(ids["researcher"]) is not None
        ):
            assert time.monotonic() < deadline, "the tree never drew"
            await pilot.pause(0.05)
        await pilot.press("j")  # the researcher
        while not any("Steered" in line for line in app.pane.lines) or not app.pane.inbox:
            assert time.monotonic() < deadline, "the researcher's view never drew"
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        return app.export_screenshot(title="tether tui")


def main() -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(Path(tmp), "--workers", "4") as server,
    ):
        ids = _scene(server)
        svg = asyncio.run(_shoot(server, ids))
    path = DOCS / "tui.svg"
    path.write_text(svg)
    print(f"{path} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
