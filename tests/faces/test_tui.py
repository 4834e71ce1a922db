"""The terminal UI (SPEC §17.3) driven by Textual's own pilot against a live ``tether serve``.

Each test runs ``TetherTui`` headless (``App.run_test``) on the module's shared server and
presses the keys a person would; child turns are held open by the Scripted driver's
``hang`` step. Every wait polls a condition of the app or the server with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
from textual.widgets import Input

from drivers import HANG
from tether.cli.client import Client
from tether.testing import ModelServer
from tether.tui import TetherTui
from tether.tui.actions import UNSET
from tether.tui.approvals import Approvals
from tether.tui.menus import KeyMenu, Prompt
from tether.tui.report import Reports
from tether.tui.roots import RootPicker
from tether.tui.stream import Feed
from tether.tui.text import row_text
from tether_server import TETHER, LiveServer, running_server, wait_until

pytestmark = pytest.mark.timeout(90)

T = TypeVar("T")
SIZE = (160, 40)
ME = "alice"


async def until(check: Callable[[], T | None], what: str, timeout: float = 15.0) -> T:
    """Poll ``check`` on the app's loop until it is truthy; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """A blocking wait on the server, off the app's loop (the app keeps drawing)."""
    return await asyncio.to_thread(fn, *args)


def _tree(server: LiveServer) -> dict[str, str]:
    """lead -> researcher (says, then hangs) -> grandkid (hangs); lead -> writer (idle)."""
    lead = server.call("session.open", {"driver": "tether:Scripted", "slug": "lead"})["session"]
    spawn = {"parent": lead, "driver": "tether:Scripted"}
    steps = {"steps": [{"op": "say", "text": "reading the logs"}, {"op": "hang"}]}
    kid = server.call(
        "subagent.spawn", {**spawn, "slug": "researcher", "prompt": "read", "data": steps}
    )["session"]
    grandkid = server.call(
        "subagent.spawn",
        {**spawn, "parent": kid, "slug": "grandkid", "prompt": "dig", "data": HANG},
    )["session"]
    writer = server.call("subagent.spawn", {**spawn, "slug": "writer"})["session"]
    server.wait_state(kid, "running")
    server.wait_state(grandkid, "running")
    return {"lead": lead, "researcher": kid, "grandkid": grandkid, "writer": writer}


def _app(server: LiveServer, root: str | None, name: str | None = ME) -> TetherTui:
    return TetherTui(Client(server.url, token=server.token), root=root, name=name)


async def _loaded(app: TetherTui, ids: dict[str, str]) -> None:
    want = [ids["researcher"], ids["grandkid"], ids["writer"]]
    await until(lambda: app.model.order == want, "the tree listed")


async def _select(pilot: Any, app: TetherTui, sid: str) -> None:
    """Move the tree's cursor (↓/j) until ``sid`` is the session shown."""
    for _ in range(10):
        if app.pane.session == sid:
            return
        await pilot.press("j")
    raise AssertionError(f"{sid} never came under the cursor")


async def _type(pilot: Any, text: str) -> None:
    """Text into the focused box, as typing it would put it there (pressing each key
    is the terminal test's; a pilot's press waits for the app to idle, a second under load)."""
    box = pilot.app.focused
    assert isinstance(box, Input), box
    box.insert_text_at_cursor(text)
    await pilot.pause()


def _running_turn(server: LiveServer, sid: str) -> str:
    info = server.call("subagent.status", {"session": sid})
    assert info["state"] == "running" and info["turn"], info
    return str(info["turn"])


def _markers(server: LiveServer, sid: str) -> list[dict[str, Any]]:
    entries = server.call("subagent.transcript", {"session": sid})["entries"]
    return [e for e in entries if e["kind"] == "marker"]


def _last_turn(server: LiveServer, sid: str) -> dict[str, Any]:
    turns: list[dict[str, Any]] = server.call("subagent.turns", {"session": sid})["turns"]
    return turns[-1]


async def _stop(pilot: Any, app: TetherTui, key: str, reason: str) -> None:
    """``Esc``, the kind's key, the reason, ``Enter``."""
    await pilot.press("escape")
    await until(lambda: isinstance(app.screen, KeyMenu), "the stop menu")
    await pilot.press(key)
    await until(lambda: isinstance(app.screen, Prompt), "the reason prompt")
    await _type(pilot, reason)
    await pilot.press("enter")
    await until(lambda: not isinstance(app.screen, Prompt), "the prompt closed")


def test_the_tree_the_transcript_and_send_follow_the_server_live(server: LiveServer) -> None:
    ids = _tree(server)

    async def scenario() -> None:
        app = _app(server, ids["lead"])
        async with app.run_test(size=SIZE) as pilot:
            await _loaded(app, ids)
            # The tree: state and structure, as the server says them.
            await until(lambda: app.model.rows[ids["grandkid"]].state == "running", "states")
            assert app.model.rows[ids["writer"]].state == "idle"
            assert app.link == "live"
            # ↓ moves to the researcher: its transcript shows, following live.
            await _select(pilot, app, ids["researcher"])
            await until(lambda: any("reading the logs" in x for x in app.pane.lines), "its say")
            # Text stays text: markup is not read, a control character shows escaped.
            hostile = "[bold]now[/bold] \x1b[2J"
            server.call(
                "subagent.interrupt",
                {
                    "address": {"session": ids["researcher"], "parent": ids["lead"]},
                    "kind": "steer",
                    "reason": hostile,
                    "name": ME,
                },
            )
            escaped = "↪ Steered by user alice: [bold]now[/bold] \\x1b[2J"
            await until(lambda: any(escaped in x for x in app.pane.lines), "the steer as text")
            in_row = "↪ Steered by user alice: [bold]now[/bold] \\x1"  # cut at 48 characters
            await until(
                lambda: in_row in row_text(app.model.rows[ids["researcher"]], app.model).plain,
                "the row's marker as text",
            )
            # A spawn elsewhere is an event for a session the tree does not hold: listed.
            late = server.call(
                "subagent.spawn",
                {
                    "parent": ids["lead"],
                    "driver": "tether:Scripted",
                    "slug": "late",
                    "prompt": "hi",
                },
            )["session"]
            await until(lambda: late in app.model.order, "the new session in the tree")
            # Enter opens the message box; Enter there sends, as alice.
            await pilot.press("enter")
            await until(lambda: app.focused is app.query_one("#message"), "the message box")
            await _type(pilot, "also check the tests")
            await pilot.press("enter")
            await until(lambda: app.said.startswith("sent m_"), "the send's outcome")
            inbox = server.call("subagent.inbox", {"session": ids["researcher"]})["messages"]
            assert [(m["sender"], m["preview"]) for m in inbox] == [(ME, "also check the tests")]
            # The pending count reaches the tree from the event stream.
            await until(lambda: app.model.rows[ids["researcher"]].pending == 1, "pending 1")
            # Esc goes back to the tree; i shows the inbox, t the turns, t again the transcript.
            await pilot.press("escape")
            await until(lambda: app.focused is app.tree_view, "the tree focused")
            await pilot.press("i")
            await until(lambda: [m["sender"] for m in app.pane.inbox] == [ME], "the inbox pane")
            assert app.pane.pane == "inbox"
            await pilot.press("t")
            await until(lambda: app.pane.turns and app.pane.pane == "turns", "the turns pane")
            assert app.pane.turns[-1]["outcome"] is None  # still running
            await pilot.press("t")
            assert app.pane.pane == "transcript"
            await pilot.press("q")
        assert app.return_code == 0

    run(scenario)


def test_the_stop_menu_stops_the_turn_on_screen_when_it_opened(server: LiveServer) -> None:
    ids = _tree(server)
    kid, lead = ids["researcher"], ids["lead"]

    async def scenario() -> None:
        app = _app(server, lead)
        async with app.run_test(size=SIZE) as pilot:
            await _loaded(app, ids)
            await _select(pilot, app, kid)
            first = await until(lambda: app.model.rows[kid].turn, "the running turn")
            # Steer: the guidance is required; the marker names alice.
            await _stop(pilot, app, "s", "focus on the failing test")
            await until(lambda: app.said.startswith("steered: issued to turn " + first), "steer")
            assert _markers(server, kid)[-1]["reason"] == "focus on the failing test"
            want = "↪ Steered by user alice: focus on the failing test"
            await until(lambda: any(want in x for x in app.pane.lines), "the steer marker")
            # A menu opened on turn 1 that ended meanwhile (a cancel from elsewhere, a new
            # turn running now) stops nothing: the screen says so.
            await pilot.press("escape")
            await until(lambda: isinstance(app.screen, KeyMenu), "the stop menu")
            server.call(
                "subagent.interrupt",
                {"address": {"session": kid, "parent": lead}, "kind": "cancel", "turn": first},
            )
            await off_loop(server.wait_state, kid, "parked", "idle")
            server.call(
                "subagent.send",
                {"address": {"session": kid, "parent": lead}, "content": "again", "data": HANG},
            )
            second = await until(
                lambda: (
                    (t := _last_turn(server, kid))["id"] != first
                    and t["outcome"] is None
                    and t["id"]
                ),
                "a second turn",
            )
            await pilot.press("a")
            await until(lambda: isinstance(app.screen, Prompt), "the reason prompt")
            await _type(pilot, "stale")
            await pilot.press("enter")
            await until(lambda: app.said.startswith("already finished: turn " + first), "no-op")
            assert _running_turn(server, kid) == second  # the later turn runs on
            # Cancel, with a reason: the turn ends cancelled, by alice; the marker shows.
            await until(lambda: app.model.rows[kid].turn == second, "the second turn on screen")
            await _stop(pilot, app, "c", "wrong approach")
            done = f"cancelled: issued to turn {second} of researcher"
            await until(lambda: app.said == done, "cancelled")
            await off_loop(server.wait_state, kid, "parked", "idle")
            ended = _last_turn(server, kid)
            assert (ended["id"], ended["outcome"], ended["by"]) == (second, "cancelled", ME)
            want = "⊘ Cancelled by user alice: wrong approach"
            await until(lambda: any(want in x for x in app.pane.lines), "the cancel marker")
            # r: the stop report under that marker.
            await pilot.press("r")
            reports = await until(
                lambda: app.screen if isinstance(app.screen, Reports) else None, "reports"
            )
            await until(lambda: "cancel by user alice: wrong approach" in reports.shown, "report")
            await pilot.press("escape")
            await until(lambda: not isinstance(app.screen, Reports), "reports closed")
            # Abort the grandkid's turn (↓ to it).
            gk = ids["grandkid"]
            await _select(pilot, app, gk)
            turn = _running_turn(server, gk)
            await _stop(pilot, app, "a", "enough")
            await until(lambda: app.said == f"aborted: issued to turn {turn} of grandkid", "abort")
            await off_loop(server.wait_state, gk, "parked", "idle")
            assert _last_turn(server, gk)["outcome"] == "aborted"
            # A session with no running turn: Esc says so, and opens nothing.
            await _select(pilot, app, ids["writer"])
            await pilot.press("escape")
            await until(lambda: app.said.startswith("nothing to stop: writer"), "nothing to stop")
            assert not isinstance(app.screen, KeyMenu)

    run(scenario)


def test_preempt_kills_the_command_and_the_turn_goes_on(server: LiveServer) -> None:
    lead = server.call("session.open", {"driver": "tether:Scripted", "slug": "lead"})["session"]
    steps = [{"op": "tool", "argv": ["sleep", "60"]}, {"op": "say", "text": "after"}]
    kid = server.call(
        "subagent.spawn",
        {
            "parent": lead,
            "driver": "tether:Scripted",
            "slug": "runner",
            "prompt": "go",
            "data": {"steps": steps},
        },
    )["session"]
    assert server.proc is not None
    host = psutil.Process(server.proc.pid)
    wait_until(
        lambda: any(p.name() == "sleep" for p in host.children(recursive=True)),
        what="the tool subprocess",
    )

    async def scenario() -> None:
        app = _app(server, lead)
        async with app.run_test(size=SIZE) as pilot:
            await until(lambda: app.model.order == [kid], "the tree")
            await _select(pilot, app, kid)
            await until(lambda: app.model.rows[kid].turn, "the running turn")
            # Until the worker has registered the command there is nothing to kill and the
            # turn goes on; a preempt is bound to the turn all the same, so press again.
            for _ in range(20):
                await _stop(pilot, app, "p", "stuck")
                await until(lambda: app.said.startswith("preempted: issued to turn"), "p")
                app.said = ""
                try:
                    await until(
                        lambda: any(m["action"] == "preempted" for m in _markers(server, kid)),
                        "the preempted marker",
                        timeout=2.0,
                    )
                    break
                except AssertionError:
                    continue
            await until(lambda: any("assistant: after" in x for x in app.pane.lines), "goes on")
            assert _last_turn(server, kid)["outcome"] == "completed"

    run(scenario)


def test_pause_resume_subtree_stop_and_a_refusal_on_one_line(server: LiveServer) -> None:
    ids = _tree(server)
    kid, lead, gk = ids["researcher"], ids["lead"], ids["grandkid"]

    async def scenario() -> None:
        app = _app(server, lead)
        async with app.run_test(size=SIZE) as pilot:
            await _loaded(app, ids)
            await _select(pilot, app, kid)
            turn = await until(lambda: app.model.rows[kid].turn, "the running turn")
            # z asks a reason and pauses the turn on screen; the tree reads paused.
            await pilot.press("z")
            await until(lambda: isinstance(app.screen, Prompt), "the pause prompt")
            await _type(pilot, "let me look")
            await pilot.press("enter")
            await until(lambda: app.said == f"paused turn {turn} of researcher", "paused")
            await until(lambda: app.model.rows[kid].state == "paused", "paused in the tree")
            assert server.call("subagent.status", {"session": kid})["state"] == "paused"
            # z again resumes at once (no reason).
            await pilot.press("z")
            await until(lambda: app.said == f"resumed turn {turn} of researcher", "resumed")
            await until(lambda: app.model.rows[kid].state == "running", "running again")
            # Esc backs out of a menu and of a prompt: nothing is stopped.
            await pilot.press("escape")
            await until(lambda: isinstance(app.screen, KeyMenu), "the stop menu")
            await pilot.press("escape")
            await until(lambda: not isinstance(app.screen, KeyMenu), "backed out")
            assert _running_turn(server, kid) == turn
            # S on the lead (idle itself, its subtree running): cancel or abort, then a reason.
            await pilot.press("k")
            await until(lambda: app.pane.session == lead, "the lead under the cursor")
            await pilot.press("S")
            await until(lambda: isinstance(app.screen, KeyMenu), "the subtree menu")
            await pilot.press("a")
            await until(lambda: isinstance(app.screen, Prompt), "the reason prompt")
            await _type(pilot, "start over")
            await pilot.press("enter")
            await until(lambda: app.said.startswith("aborted the subtree of lead: turns"), "S")
            for sid in (kid, gk):
                await off_loop(server.wait_state, sid, "parked", "idle")
                assert _last_turn(server, sid)["outcome"] == "aborted"
            await until(lambda: app.model.rows[gk].state in ("parked", "idle"), "the tree")
            # Where nothing runs (the writer, idle: the lead may be running a turn for its
            # children's notices now), z says so on one line.
            await _select(pilot, app, ids["writer"])
            await pilot.press("z")
            await until(lambda: app.said == "nothing to pause: writer has no running turn", "z")

        # A refused action is one line, never a traceback: a name the server refuses.
        bad = _app(server, lead, name="al\x1bice")
        async with bad.run_test(size=SIZE) as pilot:
            await until(lambda: bad.model.order, "the tree")
            await pilot.press("enter")
            await _type(pilot, "hello")
            await pilot.press("enter")
            await until(lambda: bad.said.startswith("refused: invalid-params: "), "refused")
            assert "\n" not in bad.said

    run(scenario)


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with ModelServer() as server:
        yield server


def _touch(path: Path) -> list[str]:
    """A command that leaves ``path`` behind: whether it ran shows on disk."""
    return [sys.executable, "-c", f"open({str(path)!r}, 'a').write('ran\\n')"]


def _call_shown(screen: Approvals, other_than: str | None = None) -> dict[str, Any] | None:
    """The approval under the list's cursor, once read whole (not ``other_than``)."""
    got = screen.current()
    return got if got is not None and "tool" in got and got["id"] != other_than else None


def test_approvals_are_marked_in_the_tree_and_decided_from_the_keyboard(
    server: LiveServer, model: ModelServer, tmp_path: Path
) -> None:
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    edited = tmp_path / "edited"
    model.script(
        "tui",
        [
            *[
                {"tool_calls": [{"name": "run_command", "arguments": {"argv": _touch(path)}}]}
                for path in (first, second, third)
            ],
            {"text": "Done."},
        ],
    )
    config = {
        "model": {"base_url": model.url, "name": "tui", "retries": 0},
        "tools": ["run_command"],
        "tool_policy": {"run_command": {"approval": "required"}},
    }
    lead = server.call("session.open", {"driver": "tether:Scripted", "slug": "lead"})["session"]
    kid = server.call(
        "subagent.spawn",
        {
            "parent": lead,
            "driver": "tether.agents:ChatAgent",
            "slug": "coder",
            "config": config,
            "prompt": "go",
        },
    )["session"]

    async def scenario() -> None:
        app = _app(server, lead)
        async with app.run_test(size=SIZE) as pilot:
            await until(lambda: app.model.order == [kid], "the tree")
            # The call waiting for a decision marks its session in the tree.
            await until(lambda: app.model.rows[kid].approvals == 1, "the mark", timeout=20)
            assert "! approval" in row_text(app.model.rows[kid], app.model).plain
            # A lists the tree's pending calls; y approves the one under the cursor.
            await pilot.press("A")
            screen = await until(
                lambda: app.screen if isinstance(app.screen, Approvals) else None, "the list"
            )
            a = await until(lambda: _call_shown(screen), "the call")
            assert (a["session"], a["arguments"]) == (kid, {"argv": _touch(first)})
            await pilot.press("y")
            await until(lambda: app.said == f"approved {a['id']}", "approved")
            assert (
                server.call("subagent.approval", {"approval": a["id"]})["approval"]["decided_by"]
                == ME
            )
            await until(first.exists, "the tool ran", timeout=20)
            # The model asks again: the next call comes into the open list live.
            b = await until(lambda: _call_shown(screen, a["id"]), "the next call")
            assert app.model.rows[kid].approvals == 1
            # e: an edit that is no JSON is refused on one line, and decides nothing.
            await pilot.press("e")
            await until(
                lambda: isinstance(app.screen, Prompt) and isinstance(app.focused, Input), "edit"
            )
            box = app.focused
            assert isinstance(box, Input) and json.loads(box.value) == b["arguments"]
            box.value = "{not json"
            await pilot.press("enter")
            await until(lambda: app.said.startswith("refused: the arguments are not JSON"), "no")
            assert screen.note_text == app.said and "\n" not in app.said
            assert app.model.rows[kid].approvals == 1
            # e again, with JSON: the call runs with the edited arguments.
            await pilot.press("e")
            await until(
                lambda: isinstance(app.screen, Prompt) and isinstance(app.focused, Input), "edit"
            )
            box = app.focused
            assert isinstance(box, Input)
            box.value = json.dumps({"argv": _touch(edited)})
            await pilot.press("enter")
            await until(lambda: app.said == f"approved {b['id']} with edited arguments", "edited")
            await until(edited.exists, "the edited call ran", timeout=20)
            c = await until(lambda: _call_shown(screen, b["id"]), "the third call")
            # A decision made already is refused on one line (as a stale list would be).
            app.decide(a, "approve", None, UNSET)
            await until(lambda: app.said.startswith("refused: already-decided: "), "refused")
            assert "\n" not in app.said
            # n asks a reason and denies: the model is told who and why, and goes on.
            await pilot.press("n")
            await until(lambda: isinstance(app.screen, Prompt), "the reason prompt")
            await _type(pilot, "not that one")
            await pilot.press("enter")
            await until(lambda: app.said == f"denied {c['id']}: not that one", "denied")
            await until(lambda: app.model.rows[kid].approvals == 0, "the mark gone")
            await until(lambda: screen.ids == [], "the list empty")
            await until(lambda: _last_turn(server, kid)["outcome"] == "completed", "completed")
            await pilot.press("escape")
            await until(lambda: not isinstance(app.screen, Approvals), "the list closed")
        tools = [m for m in model.requests_for("tui")[-1].body["messages"] if m["role"] == "tool"]
        assert tools[-1]["content"] == "denied by user alice: not that one"
        assert first.read_text() == "ran\n" and edited.read_text() == "ran\n"
        assert not second.exists() and not third.exists()

    run(scenario)


def test_the_event_stream_resumes_after_a_dropped_connection_without_a_gap(
    server: LiveServer,
) -> None:
    """The UI's reader (``stream.Feed``) alone: its connection cut, it reconnects with
    ``Last-Event-ID`` and gets what happened meanwhile, in order, with nothing to re-read."""
    lead = server.call("session.open", {"driver": "tether:Scripted", "slug": "lead"})["session"]
    kid = server.call("subagent.spawn", {"parent": lead, "driver": "tether:Scripted"})["session"]
    address = {"session": kid, "parent": lead}
    links: list[str] = []
    resyncs: list[bool] = []
    feed = Feed(
        Client(server.url, token=server.token),
        lead,
        wake=lambda: None,
        status=links.append,
        resync=lambda: resyncs.append(True),
    )
    got: list[dict[str, Any]] = []

    def pending_seen(n: int) -> bool:
        got.extend(feed.take())
        return any(e["event"] == "state" and e["data"]["pending"] == n for e in got)

    feed.start()
    try:
        wait_until(lambda: links[-1:] == ["live"], what="the stream open")
        server.call("subagent.send", {"address": address, "content": "1", "wake": False})
        wait_until(lambda: pending_seen(1), what="the first event")
        resumed_from = feed.last_id
        # Cut the connection (as a network drop would), and send while it is down.
        stream = feed._stream
        assert stream is not None and resumed_from
        stream.close()
        server.call("subagent.send", {"address": address, "content": "2", "wake": False})
        wait_until(lambda: links[-1:] == ["live"] and len(links) >= 3, what="back live")
        wait_until(lambda: pending_seen(2), what="the event sent while it was down")
        assert "reconnecting" in links and not resyncs  # resumed: no gap, nothing re-read
        ids = [e["id"] for e in got]
        assert ids == sorted(set(ids))  # in order, none twice
    finally:
        feed.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_picks_a_root_and_reconnects_when_the_server_restarts(tmp_path: Path) -> None:
    # A fixed port (its last --port wins), so the same URL reaches the restarted server.
    with running_server(tmp_path, "--port", str(_free_port())) as server:
        older = server.call("session.open", {"driver": "tether:Scripted", "slug": "older"})
        lead = server.call("session.open", {"driver": "tether:Scripted", "slug": "lead"})
        lead_id = lead["session"]
        kid = server.call(
            "subagent.spawn",
            {
                "parent": lead_id,
                "driver": "tether:Scripted",
                "slug": "kid",
                "prompt": "go",
                "data": HANG,
            },
        )["session"]
        server.wait_state(kid, "running")
        client = Client(server.url, token=server.token)

        async def scenario() -> None:
            app = TetherTui(client, name=ME)
            async with app.run_test(size=SIZE) as pilot:
                # Without ROOT: the roots, newest first (session.list); Enter opens one.
                picker = await until(
                    lambda: app.screen if isinstance(app.screen, RootPicker) else None, "picker"
                )
                await until(lambda: len(picker.roots) >= 2, "the roots listed")
                assert picker.roots[:2] == [lead_id, older["session"]]
                await pilot.press("enter")
                await until(lambda: app.model.order == [kid], "the lead's tree")
                await until(lambda: app.model.rows[kid].state == "running", "running")
                address = {"session": kid, "parent": lead_id}
                send = {"address": address, "content": "queued", "wake": False}
                server.call("subagent.send", send)
                await until(lambda: app.model.rows[kid].pending == 1, "an event")
                # The server stops (its drain cancels the turn): the link says so, and an
                # action meanwhile is refused on one line.
                assert await off_loop(server.stop) == 0
                await until(lambda: app.link != "live", "the link lost")
                await _select(pilot, app, kid)
                await pilot.press("enter")
                await _type(pilot, "are you there")
                await pilot.press("enter")
                await until(lambda: app.said.startswith("refused: unreachable: "), "refused")
                await pilot.press("escape")
                # It comes back on the same port and store: the UI reconnects by itself,
                # resumes its stream (Last-Event-ID: a restarted server has a gap) and
                # reads the tree again.
                await off_loop(server.start)
                await until(lambda: app.link == "live", "the link back", timeout=30)
                await until(lambda: app.model.rows[kid].state == "dormant", "the tree re-read")
                # Events of the new server reach the screen: a waking send runs both turns.
                server.call("subagent.send", {"address": address, "content": "hi"})
                await until(lambda: any("ok: hi" in x for x in app.pane.lines), "the reply")
                await until(lambda: app.model.rows[kid].state == "idle", "idle again")
                assert app.model.rows[kid].pending == 0

        run(scenario)


def test_tether_tui_says_how_to_install_the_extra_when_textual_is_missing(
    tmp_path: Path,
) -> None:
    # A textual package that fails to import stands for one that is not installed.
    fake = tmp_path / "textual"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no textual', name='textual')\n")
    path = os.pathsep.join([str(tmp_path), *sys.path])
    got = subprocess.run(
        [sys.executable, "-c", "from tether.cli import main; raise SystemExit(main(['tui']))"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert got.returncode == 1, got
    want = "tether tui: needs the extra tether-runtime[tui]: pip install 'tether-runtime[tui]'\n"
    assert got.stderr == want
    assert got.stdout == ""


# ---- a real terminal -------------------------------------------------------------------


class _Tmux:
    """``tether tui`` in a pane of a tmux server of its own (its own socket, no config)."""

    def __init__(self, command: list[str], env: dict[str, str], workdir: Path) -> None:
        self.socket = f"tether-tui-{os.getpid()}"
        self.session = "tui"
        self.status_file = workdir / "exit-status"
        # COLUMNS and LINES, where the environment has them (80 and 24 under pytest), would
        # win over the pane's own size.
        argv = ["env", "-u", "COLUMNS", "-u", "LINES", *_env_args(env), *command]
        # The pane's shell waits for the program and writes how it ended to a file (tmux's
        # own account of a dead pane waits for it to reap the shell, which it may do late).
        line = " ".join(shlex.quote(part) for part in argv)
        line += f"; echo $? > {shlex.quote(str(self.status_file))}"
        # One tmux command, so the options hold before the program starts: the window's
        # size (a server with no client sizes windows by default-size), an Esc that is a
        # key at once (tmux waits half a second for a sequence by default), and a pane that
        # stays once its program exits (what it showed last can be read).
        self._tmux(
            "-f", "/dev/null", "start-server", ";",
            "set-option", "-g", "default-size", "150x42", ";",
            "set-option", "-g", "escape-time", "10", ";",
            "set-option", "-g", "remain-on-exit", "on", ";",
            "new-session", "-d", "-s", self.session, "-x", "150", "-y", "42", line,
        )  # fmt: skip

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done
        return done.stdout

    def keys(self, *keys: str, literal: bool = False) -> None:
        self._tmux("send-keys", "-t", self.session, *(["-l"] if literal else []), *keys)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", self.session)

    def shows(self, text: str, what: str | None = None, timeout: float = 20.0) -> str:
        def found() -> str | None:
            screen = self.screen()
            return screen if text in screen else None

        return wait_until(
            found,
            timeout=timeout,
            what=what or f"{text!r} on the terminal",
        )

    def exit_status(self) -> int | None:
        text = self.status_file.read_text() if self.status_file.exists() else ""
        return int(text) if text.endswith("\n") else None

    def close(self) -> None:
        """Stop the tmux server; the program in the pane (not a child of the tests: tmux
        runs it) must be gone too, as the leak check would have it for a child."""
        panes = subprocess.run(
            ["tmux", "-L", self.socket, "list-panes", "-a", "-F", "#{pane_pid}"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        procs = []
        for pid in panes:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(int(pid)))
        procs += [c for p in procs for c in _children(p)]
        socket_path = subprocess.run(
            ["tmux", "-L", self.socket, "display-message", "-p", "#{socket_path}"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)
        if socket_path:  # tmux leaves its socket file behind
            Path(socket_path).unlink(missing_ok=True)

        def running() -> list[psutil.Process]:
            out = []
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
            return out

        try:
            wait_until(lambda: not running(), timeout=10, what="the pane's processes gone")
        except AssertionError:
            left = running()
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            raise AssertionError(f"left running after its tmux server stopped: {left}") from None


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _env_args(env: dict[str, str]) -> list[str]:
    return [f"{key}={value}" for key, value in env.items()]


def test_every_key_in_a_real_terminal(server: LiveServer, tmp_path: Path) -> None:
    if shutil.which("tmux") is None:
        if os.environ.get("REQUIRE_TMUX") == "1":
            pytest.fail("tmux is missing (make tmux installs it)")
        pytest.skip("tmux is missing (make tmux installs it)")
    ids = _tree(server)
    kid = ids["researcher"]
    env = {"TETHER_TOKEN": server.token or "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    tui = _Tmux([TETHER, "tui", ids["lead"], "--url", server.url, "--as", ME], env, tmp_path)
    try:
        tui.shows("grandkid  running", "the tree drawn")
        tui.shows(
            "⏎ message  esc stop  z pause/resume  S subtree stop  A approvals", "the footer's keys"
        )
        # A: the tree's pending approvals (none here); Esc backs out.
        tui.keys("A")
        tui.shows("No tool call waits for a decision in this tree.")
        tui.keys("Escape")
        wait_until(lambda: "No tool call waits" not in tui.screen(), what="the list closed")
        # ↓ (j) to the researcher: its transcript follows.
        tui.keys("j")
        tui.shows("assistant: reading the logs")
        # Esc, s, the guidance, Enter: a steer of the turn on screen.
        turn = _running_turn(server, kid)
        tui.keys("Escape")
        tui.shows(f"Stop researcher, turn {turn}")
        tui.keys("s")
        tui.shows(f"Steer researcher, turn {turn}")
        tui.keys("focus on the tests", literal=True)
        tui.keys("Enter")
        tui.shows(f"steered: issued to turn {turn} of researcher")
        tui.shows("↪ Steered by user alice: focus on the tests")
        # Enter: the message box; Enter sends; Esc goes back to the tree.
        tui.keys("Enter")
        tui.shows("Message to researcher")
        tui.keys("also check zSq", literal=True)  # keys of verbs are text in the box
        tui.keys("Enter")
        tui.shows("sent m_")
        assert [
            m["preview"] for m in server.call("subagent.inbox", {"session": kid})["messages"]
        ] == ["also check zSq"]
        tui.keys("Escape")
        # (An Esc and the next key at once would read as Alt and that key.)
        tui.shows("⏎ message  esc stop", "the tree's keys back in the footer")
        # z: pause with a reason, z again: resume.
        tui.keys("z")
        tui.shows(f"Pause researcher, turn {turn}")
        tui.keys("let me look", literal=True)
        tui.keys("Enter")
        tui.shows(f"paused turn {turn} of researcher")
        tui.shows("researcher  paused")
        tui.keys("z")
        tui.shows(f"resumed turn {turn} of researcher")
        # S on the lead: abort the subtree, with a reason.
        tui.keys("k")
        tui.shows("lead  s_")
        tui.keys("S")
        tui.shows("Stop the subtree of lead")
        tui.keys("a")
        tui.shows("Abort the subtree of lead")
        tui.keys("start over", literal=True)
        tui.keys("Enter")
        tui.shows("aborted the subtree of lead: turns")
        tui.shows("grandkid  parked")
        # q quits, with status 0.
        tui.keys("q")
        try:
            wait_until(lambda: tui.exit_status() is not None, timeout=30, what="the exit")
        except AssertionError:
            raise AssertionError(f"tether tui did not exit on q:\n{tui.screen()}") from None
        assert tui.exit_status() == 0
    finally:
        tui.close()
