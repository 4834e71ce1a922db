"""The web console's page in Debian's headless Chromium, for the browser tests
(``test_console.py``) and the README's screenshots (``console_screenshots.py``).

Playwright is imported only where a page is used, so that a module importing this one
still loads (and its tests skip) where Playwright is not installed.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import Page

BROWSERS = ("chromium-headless-shell", "chromium")
# As root Chromium needs --no-sandbox; the rest keep it off this machine's closed network.
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def browser_path() -> str | None:
    """The first of ``BROWSERS`` on PATH (``make browser`` installs the first)."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def item(page: Page, name: str) -> Any:
    """The tree's row of the session ``name``."""
    return page.get_by_role("tree").get_by_role("treeitem", name=name, exact=True)


def select(page: Page, name: str) -> None:
    """Click the session ``name`` in the tree and wait for its view."""
    from playwright.sync_api import expect

    item(page, name).locator(":scope > .row").click()
    expect(page.locator("#view-title")).to_have_text(name)
