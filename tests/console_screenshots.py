"""Make the README's screenshots of the web console (docs/console-*.png).

    .venv/bin/python tests/console_screenshots.py

A live ``tether serve`` with a small scripted tree, shown in Debian's headless Chromium
(``make browser``). Not a test: pytest does not collect it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, expect, sync_playwright

from console_page import LAUNCH_ARGS, browser_path, item, select
from drivers import ROOT
from tether_server import LiveServer, rpc_address, running_server

DOCS = ROOT / "docs"


def _spawn(server: LiveServer, parent: str, slug: str, prompt: str, *steps: Any) -> str:
    params = {"parent": parent, "driver": "tether:Scripted", "slug": slug, "prompt": prompt}
    child: str = server.call("subagent.spawn", {**params, "data": {"steps": list(steps)}})[
        "session"
    ]
    return child


def _scene(server: LiveServer) -> dict[str, str]:
    # A budget on the lead: every row shows its bar (a tree of Scripted turns counts turns).
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
    server.call(
        "subagent.interrupt",
        {
            "address": rpc_address(ids["researcher"], root),
            "kind": "steer",
            "reason": "Focus on the flaky retry test, not the network.",
        },
    )
    server.call(
        "subagent.interrupt",
        {
            "address": rpc_address(ids["coder"], root),
            "kind": "cancel",
            "reason": "Wrong approach: keep the client, fix the retry policy.",
        },
    )
    server.wait_state(ids["coder"], "parked")
    server.call(
        "subagent.send",
        {
            "address": rpc_address(ids["researcher"], root),
            "content": "Also check the retry settings.",
        },
    )
    return ids


def _shoot(page: Page, name: str) -> None:
    path = DOCS / name
    page.screenshot(path=str(path))
    print(f"{path} ({path.stat().st_size // 1024} KiB)")


def main() -> None:
    path = browser_path()
    assert path, "no Chromium: run `make browser`"
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(Path(tmp), "--workers", "4") as server,
        sync_playwright() as pw,
    ):
        ids = _scene(server)
        browser = pw.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": 600})
        page.goto(f"{server.url}/#token={server.token}&root={ids['root']}")  # signed in
        expect(item(page, "unit")).to_be_visible()
        select(page, "researcher")
        expect(page.get_by_role("list", name="Transcript")).to_contain_text("↪ Steered")
        expect(page.get_by_role("list", name="Inbox")).to_contain_text("retry settings")
        _shoot(page, "console-session.png")

        page.get_by_role("button", name="Stop", exact=True).click()
        expect(page.get_by_role("menuitem", name="Cancel")).to_be_visible()
        _shoot(page, "console-stop-menu.png")
        page.keyboard.press("Escape")

        server.call("session.release", {"session": ids["root"]})
        select(page, "unit")  # its parent (tester) is live: Send works
        select(page, "tester")  # its parent (lead) was released: Send is off, Stop is not
        expect(page.get_by_role("button", name="Send", exact=True)).to_be_disabled()
        _shoot(page, "console-parent-offline.png")
        browser.close()


if __name__ == "__main__":
    main()
