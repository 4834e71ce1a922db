"""The web console in a real browser, against a live ``tether serve`` (issue 11).

Playwright for Python drives Debian's headless Chromium through ``executable_path``
(``make browser`` installs it; ``playwright install`` cannot download here). Without a
browser these tests skip, unless ``REQUIRE_BROWSER=1`` (set by ``.ci/run``), where they
fail. Child turns are held open by the Scripted driver's ``hang`` step, and a wedged
``sleep`` tool stands for a turn stuck in a command. Every wait is Playwright's
auto-waiting ``expect`` or a polled deadline; there are no fixed sleeps.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest

import tether.serve.web
from console_page import BROWSERS, LAUNCH_ARGS, browser_path, item, select
from drivers import HANG, ROOT, TESTS, all_frozen, none_frozen
from tether_server import (
    LiveServer,
    rpc_address,
    running_server,
    settle,
    shared_server,
    tether_cli,
    wait_until,
)

try:
    from playwright.sync_api import (
        Browser,
        Dialog,
        Page,
        Playwright,
        Route,
        expect,
        sync_playwright,
    )

    HAVE_PLAYWRIGHT = True
except ImportError:  # pragma: no cover - the dev extra installs it
    HAVE_PLAYWRIGHT = False

pytestmark = pytest.mark.timeout(60)

HOSTILE = "<img src=x onerror=alert(1)>"
TOKEN = "console-test-token"
WAIT_MS = 15_000
SPENDER = "drivers:Spender"  # reports data["tokens"] with ctx.add_usage per step
AMBER, RED = "rgb(217, 119, 6)", "rgb(180, 35, 24)"  # console.css --soft and --stopped
STEER, PARKED = "rgb(15, 118, 110)", "rgb(161, 92, 0)"  # console.css --steer and --parked


@pytest.fixture(scope="module")
def playwright() -> Iterator[tuple[Playwright, str]]:
    """Playwright's driver for this module, and the Chromium it launches."""
    path = browser_path()
    missing = None
    if not HAVE_PLAYWRIGHT:
        missing = "playwright is not installed (pip install -e '.[dev]')"
    elif path is None:
        missing = f"no Chromium ({' or '.join(BROWSERS)}): run `make browser`"
    if missing is not None:
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"REQUIRE_BROWSER=1 but {missing}")
        pytest.skip(missing)
    assert path is not None
    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as pw:
        yield pw, path


@pytest.fixture
def browser(playwright: tuple[Playwright, str]) -> Iterator[Browser]:
    """One browser per test: closing it ends all of its processes before the leak check."""
    pw, path = playwright
    launched = pw.chromium.launch(executable_path=path, args=LAUNCH_ARGS)
    try:
        yield launched
    finally:
        launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 760})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))

    def on_dialog(d: Dialog) -> None:
        errors.append(f"a {d.type} opened: {d.message}")
        d.dismiss()

    pg.on("dialog", on_dialog)
    try:
        yield pg
    finally:
        context.close()
    assert not errors, errors


def _server_args(kind: str) -> list[str]:
    args = ["--workers", "4"]
    if kind == "token":
        args += ["--token", TOKEN]
    return args


@pytest.fixture(scope="module")
def shared_loopback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # The test drivers (drivers:Spender) import in its workers too.
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    with shared_server(
        tmp_path_factory.mktemp("loopback"), *_server_args("loopback"), env={"PYTHONPATH": path}
    ) as live:
        yield live


@pytest.fixture(scope="module")
def shared_token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with shared_server(tmp_path_factory.mktemp("token"), *_server_args("token")) as live:
        yield live


@pytest.fixture(params=["loopback", "token"])
def server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """A live server: loopback-only, and (the same flows) with ``--token``. One of each
    for the module: each test opens its own root and names it to the console, and what
    it leaves running is aborted (and the server's processes checked) before the next."""
    live: LiveServer = request.getfixturevalue(f"shared_{request.param}")
    yield live
    settle(live)


@pytest.fixture(params=["loopback", "token"])
def fresh_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveServer]:
    """A server of the test's own, for a test that needs it empty or leaves a one-shot
    running (a one-shot has no address: only stopping the server ends it)."""
    with running_server(tmp_path, *_server_args(request.param)) as live:
        yield live


@pytest.fixture
def loopback(shared_loopback: LiveServer) -> Iterator[LiveServer]:
    yield shared_loopback
    settle(shared_loopback)


# ---- helpers ---------------------------------------------------------------------------


def open_root(server: LiveServer, slug: str = "lead") -> str:
    root: str = server.call("session.open", {"driver": "tether:Scripted", "slug": slug})["session"]
    return root


def spawn(server: LiveServer, parent: str, slug: str, data: Any = HANG) -> str:
    params = {"parent": parent, "driver": "tether:Scripted", "slug": slug, "prompt": "work"}
    child: str = server.call("subagent.spawn", {**params, "data": data})["session"]
    return child


def console(page: Page, server: LiveServer, root: str | None = None) -> None:
    """Open the console (on ``root`` if given): through the link ``tether console`` prints
    when the server made its token, else giving the given token in the page's dialog."""
    at = f"root={root}" if root else ""
    if "--token" not in server.args:
        link = tether_cli(server, "console")
        assert link.returncode == 0, link.stderr
        page.goto(link.stdout.strip() + (f"&{at}" if at else ""))
    else:
        page.goto(server.url + "/" + (f"#{at}" if at else ""))
        dialog = page.get_by_role("dialog", name="This server needs its token")
        dialog.get_by_label("Token").fill(TOKEN)
        dialog.get_by_role("button", name="Connect").click()
    expect(page.locator("#link")).to_have_text("live")
    assert "token" not in page.url  # the link's token is not left in the address bar


def row_state(page: Page, name: str) -> Any:
    return item(page, name).locator(":scope > .row .state")


def state(page: Page) -> Any:
    return page.get_by_label("State", exact=True)


def stop(
    page: Page, kind: str, reason: str, *, grace: str | None = None, deadline: str | None = None
) -> None:
    """Stop → ``kind``, the reason (and Cancel's fields), Confirm."""
    choose(page, kind)
    fill_and_confirm(page, reason, grace=grace, deadline=deadline)


def choose(page: Page, kind: str) -> None:
    page.get_by_role("button", name="Stop", exact=True).click()
    page.get_by_role("menuitem", name=kind, exact=True).click()
    expect(page.get_by_role("dialog")).to_be_visible()


def fill_and_confirm(
    page: Page, reason: str, *, grace: str | None = None, deadline: str | None = None
) -> None:
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Reason").fill(reason)
    if grace is not None:
        dialog.get_by_label("Grace (s)").fill(grace)
    if deadline is not None:
        dialog.get_by_label("Deadline (s)").fill(deadline)
    dialog.get_by_role("button", name="Confirm").click()
    expect(dialog).to_be_hidden()


def send(page: Page, text: str) -> str:
    """Send ``text`` with the composer; the new message's id."""
    outcome = page.locator("#outcome")
    before = outcome.inner_text()  # the previous send's answer must not be read as this one's
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_role("button", name="Send", exact=True).click()
    expect(outcome).not_to_have_text(before)
    expect(outcome).to_contain_text(re.compile(r"Sent m_\w+"))
    found = re.search(r"Sent (m_\w+)", outcome.inner_text())
    assert found, outcome.inner_text()
    return found.group(1)


def transcript(page: Page) -> Any:
    return page.get_by_role("list", name="Transcript")


def descendants(server: LiveServer) -> list[psutil.Process]:
    assert server.proc is not None
    return psutil.Process(server.proc.pid).children(recursive=True)


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- the Done-when points -------------------------------------------------------------


def test_tree_shows_a_root_and_three_children_live(fresh_server: LiveServer, page: Page) -> None:
    server = fresh_server  # empty: the picker must find this root by itself
    root = open_root(server)
    kids = {slug: spawn(server, root, slug) for slug in ("scout", "coder", "tester")}
    for kid in kids.values():
        server.wait_state(kid, "running")
    console(page, server)  # no root named: the picker finds it on the event stream
    expect(page.get_by_label("Root", exact=True)).to_contain_text("lead")
    expect(item(page, "lead")).to_be_visible()
    for slug in kids:
        expect(row_state(page, slug)).to_have_text("running")
    page.evaluate("window.notReloaded = true")

    # A state change made elsewhere shows without a reload, with its marker.
    server.call(
        "subagent.interrupt",
        {"address": rpc_address(kids["coder"], root), "kind": "cancel", "reason": "from elsewhere"},
    )
    expect(row_state(page, "coder")).to_have_text("parked")
    expect(item(page, "coder")).to_contain_text("⊘ Cancelled by user")
    # ... and so does a child spawned after the page loaded.
    late = spawn(server, kids["tester"], "late")
    server.wait_state(late, "running")
    expect(item(page, "tester").get_by_role("treeitem", name="late")).to_be_visible()
    expect(row_state(page, "late")).to_have_text("running")
    assert page.evaluate("window.notReloaded") is True


def test_a_childs_stop_marker_leaves_its_tree_row_once_its_next_turn_runs(
    server: LiveServer, page: Page
) -> None:
    root = open_root(server)
    kid = spawn(server, root, "worker")
    first = server.wait_state(kid, "running")["turn"]
    console(page, server, root)
    marker = item(page, "worker").locator(":scope > .row .marker-line")
    server.call(
        "subagent.interrupt",
        {"address": rpc_address(kid, root), "kind": "cancel", "reason": "wrong approach"},
    )
    expect(row_state(page, "worker")).to_have_text("parked")
    expect(marker).to_have_text("⊘ Cancelled by user: wrong approach")  # why it is parked

    # A new message wakes it and its turn completes: the cancel no longer describes it.
    server.call("subagent.send", {"address": rpc_address(kid, root), "content": "try again"})

    def second_completed() -> bool:
        turns = server.call("subagent.turns", {"session": kid})["turns"]
        return [t["outcome"] for t in turns if t["id"] != first] == ["completed"]

    wait_until(second_completed, what="the second turn, completed")
    expect(row_state(page, "worker")).to_have_text("idle")
    expect(marker).to_have_text("")
    expect(marker).to_be_hidden()


def test_a_steer_marker_has_its_own_glyph_and_colour_in_the_transcript_and_the_tree(
    loopback: LiveServer, page: Page
) -> None:
    server = loopback
    root = open_root(server)
    kid = spawn(server, root, "guided")
    server.wait_state(kid, "running")
    console(page, server, root)
    select(page, "guided")
    line = item(page, "guided").locator(":scope > .row .marker-line")

    stop(page, "Steer", "take the fast path")
    steer = transcript(page).locator("li.marker.action-steered")
    expect(steer.locator(".text")).to_have_text("↪ Steered by user: take the fast path")
    expect(steer).to_have_css("border-left-color", STEER)
    expect(line).to_have_text("↪ Steered by user: take the fast path")
    expect(line).to_have_css("color", STEER)

    # A cancel after it is a stop: the stop's glyph and colour, in both places.
    stop(page, "Cancel", "enough")
    cancel = transcript(page).locator("li.marker.action-cancelled")
    expect(cancel.locator(".text")).to_have_text("⊘ Cancelled by user: enough")
    expect(cancel).to_have_css("border-left-color", PARKED)
    expect(line).to_have_text("⊘ Cancelled by user: enough")
    expect(line).to_have_css("color", PARKED)


def test_cancel_keeps_a_pending_send_and_send_resumes_the_queue_in_order(
    server: LiveServer, page: Page
) -> None:
    root = open_root(server)
    kid = spawn(server, root, "worker")
    first_turn = server.wait_state(kid, "running")["turn"]
    console(page, server, root)
    select(page, "worker")
    expect(state(page)).to_have_text("running")
    # While the turn runs, Send and Stop are both usable.
    expect(page.get_by_role("button", name="Send", exact=True)).to_be_enabled()
    expect(page.get_by_role("button", name="Stop", exact=True)).to_be_enabled()
    queued = send(page, "check the tests too")
    expect(page.get_by_role("list", name="Inbox")).to_contain_text("check the tests too")

    stop(page, "Cancel", "wrong approach", grace="2")
    expect(transcript(page)).to_contain_text("⊘ Cancelled by user")
    expect(transcript(page)).to_contain_text("wrong approach")
    expect(state(page)).to_have_text("parked")
    inbox = page.get_by_role("list", name="Inbox")
    expect(inbox.locator("li")).to_have_count(1)
    expect(inbox).to_contain_text(queued)

    # "don't wake" only queues; a waking Send resumes the queue, oldest first.
    page.get_by_label("don't wake").check()
    held = send(page, "and the docs")
    expect(inbox.locator("li")).to_have_count(2)
    expect(state(page)).to_have_text("parked")
    expect(page.get_by_label("don't wake")).not_to_be_checked()  # one message at a time
    resumed = send(page, "then summarise")
    expect(state(page)).to_have_text("idle")
    expect(inbox.locator("li")).to_have_count(0)
    users = transcript(page).locator("li.user .text")
    expect(users).to_have_text(["work", "check the tests too", "and the docs", "then summarise"])
    turns = server.call("subagent.turns", {"session": kid})["turns"]
    assert [(t["message"], t["outcome"]) for t in turns][1:] == [
        (queued, "completed"),
        (held, "completed"),
        (resumed, "completed"),
    ]
    assert turns[0]["id"] == first_turn and turns[0]["outcome"] == "cancelled"


def test_abort_of_a_child_wedged_in_sleep_kills_its_processes(
    loopback: LiveServer, page: Page
) -> None:
    server = loopback
    root = open_root(server)
    kid = spawn(server, root, "wedged", {"steps": [{"op": "tool", "argv": ["sleep", "300"]}]})

    def sleeping() -> psutil.Process | None:
        return next((p for p in descendants(server) if p.name() == "sleep"), None)

    tool = wait_until(sleeping, what="the sleep tool")
    worker = tool.parent()
    assert worker is not None
    console(page, server, root)
    select(page, "wedged")
    expect(state(page)).to_have_text("running")
    stop(page, "Abort", "stuck in sleep")
    expect(transcript(page)).to_contain_text("⊘ Aborted by user")
    expect(state(page)).to_have_text("parked")
    wait_until(lambda: gone(tool) and gone(worker), what="the tool and its worker to be gone")
    assert not [p for p in descendants(server) if p.name() == "sleep"]
    assert server.call("subagent.turns", {"session": kid})["turns"][0]["outcome"] == "aborted"


def test_pause_freezes_a_hanging_child_and_resume_thaws_it(
    loopback: LiveServer, page: Page
) -> None:
    server = loopback
    root = open_root(server)
    kid = spawn(server, root, "held", {"steps": [{"op": "tool", "argv": ["sleep", "300"]}]})

    def sleeping() -> psutil.Process | None:
        return next((p for p in descendants(server) if p.name() == "sleep"), None)

    worker = wait_until(sleeping, what="the sleep tool").parent()
    assert worker is not None
    procs = [worker, *worker.children(recursive=True)]
    turn = server.wait_state(kid, "running")["turn"]
    console(page, server, root)
    select(page, "held")
    expect(state(page)).to_have_text("running")

    # While it runs, Stop offers Pause and no Resume.
    page.get_by_role("button", name="Stop", exact=True).click()
    expect(page.get_by_role("menuitem", name="Resume", exact=True)).to_be_hidden()
    page.get_by_role("menuitem", name="Pause", exact=True).click()
    fill_and_confirm(page, "let me look")
    expect(page.locator("#outcome")).to_contain_text(f"Pause: issued to turn {turn}")
    expect(state(page)).to_have_text("paused")
    expect(row_state(page, "held")).to_have_text("paused")
    # "paused" once: the state says it, no badge repeats it (view and tree alike).
    expect(page.locator("#badge")).to_be_hidden()
    expect(item(page, "held").locator(":scope > .row .badge")).to_be_hidden()
    expect(transcript(page)).to_contain_text("‖ Paused by user: let me look")
    wait_until(lambda: all_frozen(procs), what="the worker and its sleep to be stopped")
    assert server.call("subagent.status", {"session": kid})["state"] == "paused"

    # Paused: Stop offers Resume (it asks no reason) instead of Pause.
    page.get_by_role("button", name="Stop", exact=True).click()
    expect(page.get_by_role("menuitem", name="Pause", exact=True)).to_be_hidden()
    page.get_by_role("menuitem", name="Resume", exact=True).click()
    expect(page.get_by_role("dialog")).to_be_hidden()
    expect(page.locator("#outcome")).to_contain_text(f"Resume: issued to turn {turn}")
    expect(state(page)).to_have_text("running")
    expect(row_state(page, "held")).to_have_text("running")
    expect(transcript(page)).to_contain_text("▶ Resumed by user")
    wait_until(lambda: none_frozen(procs), what="the worker and its sleep to run again")
    stop(page, "Abort", "done looking")
    expect(state(page)).to_have_text("parked")


def test_a_stop_from_the_console_says_who_by_the_name_kept_in_this_browser(
    loopback: LiveServer, page: Page
) -> None:
    server = loopback
    root = open_root(server)
    kid = spawn(server, root, "worker")
    grand = spawn(server, kid, "helper")  # its parent is an agent: its id must not show
    turn = server.wait_state(grand, "running")["turn"]
    console(page, server, root)
    select(page, "helper")
    markers = transcript(page).locator("li.marker .text")
    # No name given: "by user", never the parent agent's id.
    stop(page, "Steer", "look left")
    expect(markers).to_have_text(["↪ Steered by user: look left"])

    # The name is a setting of the page, kept in this browser: a new page of it has it.
    page.get_by_label("Your name", exact=True).fill("alice")
    page.get_by_label("Your name", exact=True).press("Enter")
    again = page.context.new_page()
    console(again, server, root)
    expect(again.get_by_label("Your name", exact=True)).to_have_value("alice")
    select(again, "helper")
    stop(again, "Cancel", "wrong way")
    cancelled = transcript(again).locator("li.marker.action-cancelled summary")
    expect(cancelled).to_have_text("⊘ Cancelled by user alice: wrong way")
    expect(again.get_by_label("State", exact=True)).to_have_text("parked")
    cancelled.click()
    report = again.get_by_role("region", name=f"Stop report of {turn}")
    expect(report).to_contain_text("cancel by user alice: wrong way")
    texts = [e["text"] for e in server.call("subagent.transcript", {"session": grand})["entries"]]
    assert not any(kid in t for t in texts), texts
    turns = server.call("subagent.turns", {"session": grand})["turns"]
    assert (turns[-1]["cause"], turns[-1]["by"]) == ("user", "alice")
    again.close()


def test_parent_offline_child_keeps_stop_and_loses_send(
    fresh_server: LiveServer, page: Page
) -> None:
    server = fresh_server
    root = open_root(server)
    kid = spawn(server, root, "orphan")
    server.wait_state(kid, "running")
    # The root spawns a one-shot (it has no Stop) and ends its own turn.
    spawn_once = {"op": "spawn", "slug": "once", "mode": "one-shot", "data": HANG}
    prompt = {"session": root, "content": "go", "data": {"steps": [spawn_once]}}
    server.call("session.prompt", prompt)
    server.wait_state(root, "idle")
    console(page, server, root)
    select(page, "orphan")
    message = page.get_by_label("Message", exact=True)
    send_button = page.get_by_role("button", name="Send", exact=True)
    stop_button = page.get_by_role("button", name="Stop", exact=True)
    expect(send_button).to_be_enabled()

    server.call("session.release", {"session": root})  # the parent goes offline, live
    expect(row_state(page, "lead")).to_have_text("dormant")
    expect(message).to_be_disabled()
    expect(send_button).to_be_disabled()
    expect(page.locator("#send-note")).to_contain_text("lead is dormant (offline)")
    expect(stop_button).to_be_enabled()
    stop(page, "Cancel", "parent went away")
    expect(transcript(page)).to_contain_text("⊘ Cancelled by user")
    expect(state(page)).to_have_text("parked")

    select(page, "once")
    expect(state(page)).to_have_text("running")
    expect(page.locator("#mode")).to_have_text("one-shot")
    expect(stop_button).to_be_hidden()


def test_a_session_picked_while_the_tree_loads_stays_picked(
    loopback: LiveServer, page: Page
) -> None:
    """The console's first load of a root can answer after the event stream has drawn the
    tree (a re-list): a session the person picked meanwhile stays on screen."""
    root = open_root(loopback)
    kid = spawn(loopback, root, "busy")
    loopback.wait_state(kid, "running")
    held: list[Route] = []

    def hold_the_first_list(route: Route) -> None:
        body = route.request.post_data_json
        if not held and isinstance(body, dict) and body.get("method") == "subagent.list":
            held.append(route)  # answered below, after the click
        else:
            route.continue_()

    page.route("**/rpc", hold_the_first_list)
    console(page, loopback, root)
    wait_until(lambda: bool(held), what="the console's first subagent.list")
    expect(page.get_by_role("tree")).to_have_attribute("aria-busy", "true")
    spawn(loopback, root, "late")  # its events make the console re-list, past the held load
    select(page, "busy")
    held[0].continue_()
    expect(page.get_by_role("tree")).not_to_have_attribute("aria-busy", "true")
    expect(page.locator("#view-title")).to_have_text("busy")
    expect(item(page, "busy")).to_have_attribute("aria-selected", "true")
    assert f"session={kid}" in page.url


def test_a_stale_stop_stops_nothing_and_says_so(server: LiveServer, page: Page) -> None:
    root = open_root(server)
    kid = spawn(server, root, "busy")
    first = server.wait_state(kid, "running")["turn"]
    console(page, server, root)
    select(page, "busy")
    expect(page.get_by_label("Turn", exact=True)).to_have_text(first)
    choose(page, "Cancel")  # the person clicks Stop on the turn on screen ...

    # ... meanwhile that turn ends and a new one starts.
    server.call(
        "subagent.interrupt", {"address": rpc_address(kid, root), "kind": "cancel", "turn": first}
    )
    server.wait_state(kid, "parked")
    server.call(
        "subagent.send", {"address": rpc_address(kid, root), "content": "again", "data": HANG}
    )

    def second_turn() -> str | None:
        info = server.call("subagent.status", {"session": kid})
        return info["turn"] if info["state"] == "running" and info["turn"] != first else None

    second = wait_until(second_turn, what="the second turn")

    fill_and_confirm(page, "late click")
    expect(page.locator("#outcome")).to_contain_text("already finished")
    expect(page.locator("#outcome")).to_contain_text(f"turn {first}")
    expect(page.get_by_label("Turn", exact=True)).to_have_text(second)
    status = server.call("subagent.status", {"session": kid})
    assert (status["state"], status["turn"], status["stopping"]) == ("running", second, None)
    entries = server.call("subagent.transcript", {"session": kid})["entries"]
    assert not [e for e in entries if e["reason"] == "late click"]


def test_a_hostile_reason_renders_as_text_and_a_refusal_shows_its_code(
    loopback: LiveServer, page: Page
) -> None:
    server = loopback
    root = open_root(server)
    kid = spawn(server, root, "target")
    server.wait_state(kid, "running")
    console(page, server, root)
    select(page, "target")

    # Steer requires text.
    choose(page, "Steer")
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_role("button", name="Confirm")).to_be_disabled()
    fill_and_confirm(page, HOSTILE)
    expect(transcript(page).locator("li.marker")).to_contain_text("↪ Steered by user: ")

    # A refused action shows the error code and message, never a stack trace.
    stop(page, "Cancel", "needs a deadline", deadline="0")
    outcome = page.locator("#outcome")
    expect(outcome).to_contain_text("invalid-params: invalid params")
    expect(page.get_by_role("alert")).to_contain_text("deadline")
    assert "Traceback" not in outcome.inner_text()
    expect(state(page)).to_have_text("running")

    stop(page, "Cancel", HOSTILE)
    marker = transcript(page).locator("li.marker.action-cancelled .text")
    expect(marker).to_have_text(f"⊘ Cancelled by user: {HOSTILE}")
    expect(page.get_by_role("list", name="Turns")).to_contain_text(HOSTILE)
    expect(item(page, "target")).to_contain_text(HOSTILE)
    assert page.locator("img").count() == 0  # nothing was parsed as HTML anywhere


def test_the_token_is_asked_once_and_only_ever_sent_in_a_header(tmp_path: Path, page: Page) -> None:
    with running_server(tmp_path, "--token", TOKEN) as server:
        root = open_root(server)
        requests: list[tuple[str, dict[str, str]]] = []
        page.on("request", lambda r: requests.append((r.url, r.headers)))
        page.goto(server.url + f"/#root={root}")
        dialog = page.get_by_role("dialog", name="This server needs its token")
        dialog.get_by_label("Token").fill("not the token")
        dialog.get_by_role("button", name="Connect").click()
        expect(dialog).to_be_visible()
        expect(dialog).to_contain_text("refused")
        dialog.get_by_label("Token").fill(TOKEN)
        dialog.get_by_role("button", name="Connect").click()
        expect(page.locator("#link")).to_have_text("live")
        expect(item(page, "lead")).to_be_visible()

        page.reload()  # kept for this tab: not asked again
        expect(page.locator("#link")).to_have_text("live")
        expect(page.get_by_role("dialog", name="This server needs its token")).to_be_hidden()
        assert page.evaluate("sessionStorage.getItem('tether.token')") == TOKEN
        assert page.evaluate("document.cookie") == ""
        assert page.context.cookies() == []
        assert all(TOKEN not in url for url, _ in requests)
        paths = [(urlsplit(url).path, h.get("authorization")) for url, h in requests]
        bearer = f"Bearer {TOKEN}"
        assert ("/events", bearer) in paths and ("/rpc", bearer) in paths
        for path, auth in paths:
            if path in ("/events", "/rpc"):
                assert auth == bearer, (path, auth)
            elif auth is None:
                assert path in ("/", "/health") or path.startswith("/console/"), path


# ---- without a browser: how the page is served -----------------------------------------


def test_the_page_is_served_from_the_package_without_a_cdn(tmp_path: Path) -> None:
    web = ROOT / "src" / "tether" / "serve" / "web"
    for asset in web.iterdir():
        if asset.suffix in {".html", ".js", ".css"}:
            text = asset.read_text()
            assert not re.search(r"(src|href|from|import)\s*=?\s*[\"']?(https?:)?//", text), asset
            assert "innerHTML" not in text and "insertAdjacentHTML" not in text, asset
    (tmp_path / "open").mkdir()
    (tmp_path / "token").mkdir()
    with running_server(tmp_path / "open") as server:
        status, body = server.request("GET", "/")
        assert status == 200 and b'<ul id="tree" role="tree"' in body
        status, body = server.request("GET", "/console/app.js")
        assert status == 200 and b"EventStream" in body
        assert server.request("GET", "/console/../rpc")[0] == 404
        assert server.request("GET", "/console/nope.js")[0] == 404
        # A token the server made holds as one given: the page is free, its calls are not.
        assert server.request("GET", "/events", auth=False)[0] == 401
    with running_server(tmp_path / "token", "--token", TOKEN) as server:
        # The page's files hold no secret; everything it calls needs the token.
        assert server.request("GET", "/", auth=False)[0] == 200
        assert server.request("GET", "/console/rpc.js", auth=False)[0] == 200
        assert server.request("GET", "/events", auth=False)[0] == 401
        rpc = b'{"jsonrpc":"2.0","id":1,"method":"subagent.list","params":{"root":"x"}}'
        assert server.request("POST", "/rpc", rpc, auth=False)[0] == 401
        assert server.request("HEAD", "/health", auth=False)[0] in (401, 405)


# ---- stop reports and subtree stops (issue 19) --------------------------------------------


def test_a_stop_marker_opens_to_its_report(loopback: LiveServer, page: Page) -> None:
    server = loopback
    root = open_root(server)
    kid = spawn(server, root, "wedged", {"steps": [{"op": "tool", "argv": ["sleep", "300"]}]})
    wait_until(
        lambda: next((p for p in descendants(server) if p.name() == "sleep"), None),
        what="the sleep tool",
    )
    turn = server.wait_state(kid, "running")["turn"]
    console(page, server, root)
    select(page, "wedged")
    stop(page, "Abort", "stuck in sleep")
    expect(state(page)).to_have_text("parked")
    marker = transcript(page).locator("li.marker.action-aborted")
    expect(marker).to_contain_text("⊘ Aborted by user")
    report = page.get_by_role("region", name=f"Stop report of {turn}")
    expect(report).to_be_hidden()
    marker.locator("summary").click()
    expect(report).to_be_visible()
    expect(report).to_contain_text("abort by user: stuck in sleep")
    expect(report).to_contain_text("aborted")
    expect(report).to_contain_text("Tool calls (1)")
    expect(report.locator(".report-tools li")).to_have_text(["run_command · killed"])
    expect(report).to_contain_text(re.compile(r"Effective.*\d+\.\d ms"))
    marker.locator("summary").click()  # closes again
    expect(report).to_be_hidden()


def test_stop_subtree_aborts_every_running_turn_below_an_idle_parent(
    loopback: LiveServer, page: Page
) -> None:
    server = loopback
    root = open_root(server)
    kids = {slug: spawn(server, root, slug) for slug in ("scout", "coder")}
    kids["deep"] = spawn(server, kids["coder"], "deep")
    turns = {slug: server.wait_state(sid, "running")["turn"] for slug, sid in kids.items()}
    console(page, server, root)
    select(page, "lead")
    expect(state(page)).to_have_text("idle")
    # The lead runs nothing, but the sessions below it do: Stop offers the subtree only.
    page.get_by_role("button", name="Stop", exact=True).click()
    expect(page.get_by_role("menuitem", name="Abort", exact=True)).to_be_hidden()
    page.get_by_role("menuitem", name="Stop subtree…", exact=True).click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("its running descendants")
    dialog.get_by_label("Abort").check()
    fill_and_confirm(page, "wrong plan")
    outcome = page.locator("#outcome")
    expect(outcome).to_contain_text("Stop subtree: issued to turn")
    for slug, sid in kids.items():
        expect(outcome).to_contain_text(turns[slug])
        expect(row_state(page, slug)).to_have_text("parked")
        last = server.call("subagent.turns", {"session": sid})["turns"][-1]
        assert (last["id"], last["outcome"], last["reason"]) == (
            turns[slug],
            "aborted",
            "wrong plan",
        )
    # Nothing runs below it any more: Stop is off again.
    expect(page.get_by_role("button", name="Stop", exact=True)).to_be_disabled()


def test_a_turn_no_worker_has_taken_reads_waiting_for_a_worker_in_the_tree(
    tmp_path: Path, page: Page
) -> None:
    with running_server(tmp_path, "--workers", "1") as server:
        root = open_root(server)
        first = spawn(server, root, "first")
        server.wait_state(first, "running")
        second = spawn(server, root, "second")  # the one worker is busy: its turn waits
        info = server.wait_state(second, "running")
        assert info["dispatched"] is False
        console(page, server, root)
        expect(row_state(page, "first")).to_have_text("running")
        expect(row_state(page, "second")).to_have_text("waiting for a worker")
        server.call(
            "subagent.interrupt",
            {"address": rpc_address(first, root), "kind": "abort", "reason": "x"},
        )
        expect(row_state(page, "first")).to_have_text("parked")
        expect(row_state(page, "second")).to_have_text("running")
        server.call(
            "subagent.interrupt",
            {"address": rpc_address(second, root), "kind": "abort", "reason": "x"},
        )
        server.wait_state(second, "parked")


# ---- budgets (issue 29) -------------------------------------------------------------------


def budget_bar(page: Page, name: str) -> Any:
    return item(page, name).locator(":scope > .row").get_by_role("meter", name="Budget")


def test_a_budget_bar_shows_spent_of_the_limit_amber_past_soft_and_red_once_exhausted(
    loopback: LiveServer, page: Page
) -> None:
    server = loopback
    budget = {"tokens": 2000, "soft": 0.5, "on_soft": "none"}
    root = server.call("session.open", {"driver": SPENDER, "slug": "frugal", "budget": budget})[
        "session"
    ]
    kid = server.call("subagent.spawn", {"parent": root, "driver": SPENDER, "slug": "helper"})[
        "session"
    ]
    free = open_root(server, "unbudgeted")
    console(page, server, root)
    bar, kid_bar = budget_bar(page, "frugal"), budget_bar(page, "helper")
    expect(bar).to_have_text("0 of 2,000 tokens")
    expect(bar).to_have_attribute("aria-valuemax", "2000")
    # A session with no budget of its own shows the budget it is governed by.
    expect(kid_bar).to_have_text("0 of 2,000 tokens (frugal's tree)")
    expect(bar).to_have_attribute("data-level", "ok")

    # The child spends 1,200 tokens: the tree is past its soft threshold (50%).
    spend = {"tokens": 400, "steps": 3, "every": 0.01}
    server.call("subagent.send", {"address": rpc_address(kid, root), "content": "s", "data": spend})
    expect(bar).to_have_text("1,200 of 2,000 tokens · soft")
    expect(bar).to_have_attribute("aria-valuenow", "1200")
    expect(bar.locator(".budget-fill")).to_have_css("background-color", AMBER)
    expect(kid_bar).to_have_text("1,200 of 2,000 tokens (frugal's tree) · soft")
    select(page, "helper")  # the session view has the same bar
    facts = page.locator(".facts").get_by_role("meter", name="Budget")
    expect(facts).to_have_text("1,200 of 2,000 tokens (frugal's tree) · soft")

    # Spending on until the limit: the budget cancels the turn, and the tree is exhausted.
    server.call(
        "subagent.send",
        {"address": rpc_address(kid, root), "content": "s", "data": {"tokens": 400, "every": 0.05}},
    )
    expect(bar).to_have_text(re.compile(r"^2,[0-9]00 of 2,000 tokens · exhausted$"))
    expect(bar.locator(".budget-fill")).to_have_css("background-color", RED)
    expect(bar).to_have_attribute("aria-valuenow", "2000")  # held at its maximum
    expect(kid_bar).to_contain_text("· exhausted")
    expect(item(page, "helper")).to_contain_text("⊘ Cancelled by budget")
    expect(facts).to_contain_text("· exhausted")
    status = server.call("subagent.budget", {"session": root})["budget"]
    assert status["state"] == "exhausted" and status["decided_by"] == root

    # A tree with no budget has no bar.
    select(page, "frugal")
    page.get_by_label("or id").fill(free)
    page.get_by_role("button", name="Open", exact=True).click()
    expect(item(page, "unbudgeted")).to_be_visible()
    expect(item(page, "unbudgeted").get_by_role("meter")).to_have_count(0)
    expect(page.locator(".facts").get_by_role("meter")).to_have_count(0)
    # ... until one is set there (its `budget` event has the console read it).
    server.call(
        "subagent.setBudget", {"address": {"session": free, "parent": free}, "budget": {"turns": 5}}
    )
    expect(budget_bar(page, "unbudgeted")).to_have_text("0 of 5 turns")


def test_every_marker_glyph_is_drawn_by_the_default_font() -> None:
    # Debian's chromium falls back to DejaVu Sans; a glyph it lacks shows as an empty box
    # where no symbol font is installed (U+23F8 did).
    if shutil.which("fc-list") is None:
        pytest.skip("fc-list (fontconfig) is not installed")
    if not subprocess.run(
        ["fc-list", ":family=DejaVu Sans"], capture_output=True, text=True
    ).stdout:
        pytest.skip("DejaVu Sans is not installed")
    view = (Path(tether.serve.web.__file__).parent / "view.js").read_text()
    glyphs = set(re.findall(r'^\s+\w+: \["(.)", "\w+"\],', view, re.M))
    assert len(glyphs) >= 3, glyphs
    for glyph in glyphs:
        query = f":family=DejaVu Sans:charset={ord(glyph):x}"
        found = subprocess.run(["fc-list", query], capture_output=True, text=True).stdout
        assert found, f"{glyph!r} (U+{ord(glyph):04X}) is not in DejaVu Sans"
