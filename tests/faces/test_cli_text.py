"""Text the ``tether`` command prints cannot drive the terminal (docs/serve.md, the CLI).

A model's reply, a tool's output, a person's reason or message reach the terminal through
``transcript``, ``turns``, ``report``, ``inbox``, ``watch``: each control character shows
escaped (``\\x1b``), in the human output and in ``--json`` alike, and a slug may not hold
one at all.
"""

from __future__ import annotations

import getpass
import json
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Any

import pytest

import tether
from drivers import SCRIPTED, Recorder
from tether_server import TETHER, LiveServer, rpc_error, tether_cli, wait_until

pytestmark = pytest.mark.timeout(90)

# Clear the screen, retitle the window (OSC ... BEL), a C1 CSI, a right-to-left override,
# DEL: each acts on a terminal when printed raw.
NASTY = "\x1b[2J\x1b]0;pwned\x07\x9b31m\u202eevil\x7f"
SHOWN = "\\x1b[2J\\x1b]0;pwned\\x07\\x9b31m\\u202eevil\\x7f"
ME = getpass.getuser()  # the CLI's --as by default: its stops read "by user ME"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\x7f")
HANG = json.dumps([{"op": "hang"}])


def _printed(server: LiveServer, *args: str) -> str:
    done = tether_cli(server, *args)
    assert done.returncode == 0, (args, done.stderr)
    assert not any(c in done.stdout for c in RAW), (args, done.stdout)
    return done.stdout


def _assistant_said(server: LiveServer, session: str) -> bool:
    entries = server.call("subagent.transcript", {"session": session})["entries"]
    return any(e["kind"] == "assistant" for e in entries)


def test_transcript_turns_report_and_inbox_show_control_characters_escaped(
    server: LiveServer,
) -> None:
    root = tether_cli(server, "open").stdout.strip()
    said = f"line one\n\tline two {NASTY}"
    steps = json.dumps([{"op": "say", "text": said}, {"op": "hang"}])
    kid = _printed(server, "spawn", root, "--prompt", "go", "--steps", steps).strip()
    wait_until(lambda: _assistant_said(server, kid), what="the reply")
    turn = server.call("subagent.status", {"session": kid})["turn"]
    _printed(server, "send", kid, f"queued {NASTY}", "--no-wake")
    _printed(server, "cancel", kid, "--reason", f"why {NASTY}")
    server.wait_state(kid, "parked")

    transcript = _printed(server, "transcript", kid)
    # a multi-line reply prints as such: its newline and tab are kept
    assert f"assistant: line one\n\tline two {SHOWN}\n" in transcript
    assert f"⊘ Cancelled by user {ME}: why {SHOWN}" in transcript
    assert f"why {SHOWN}" in _printed(server, "turns", kid)
    report = _printed(server, "report", turn)
    assert f"by user {ME}: why {SHOWN}" in report and "partial    cancelled after" in report
    assert f"queued {SHOWN}" in _printed(server, "inbox", kid)

    # --json is the same value, every character in it escaped
    lines = _printed(server, "transcript", kid, "--json").splitlines()
    assert json.loads(lines[1])["text"] == said
    inbox = json.loads(_printed(server, "inbox", kid, "--json"))["messages"]
    assert inbox[0]["preview"] == f"queued {NASTY}"


def test_watch_shows_a_markers_control_characters_escaped(server: LiveServer) -> None:
    root = tether_cli(server, "open", "--slug", "lead").stdout.strip()
    kid = tether_cli(server, "spawn", root, "--slug", "kid", "--prompt", "go", "--steps", HANG)
    kid_id = kid.stdout.strip()
    server.wait_state(kid_id, "running")
    for as_json in (False, True):
        out = _watched(server, root, kid_id, as_json=as_json)
        assert not any(c in out for c in RAW), out
        if as_json:
            markers = [json.loads(x) for x in out.splitlines() if '"event": "marker"' in x]
            assert markers[0]["data"]["data"]["entry"]["reason"] == f"steer {NASTY}"
        else:
            assert f"kid ↪ Steered by user {ME}: steer {SHOWN}" in out, out


def _plain_env() -> dict[str, str]:
    """A pipe's environment, with room for a marker on one line and no forced colours
    (whose escapes would be the command's own, not the text's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, "COLUMNS": "400"}


def _watched(server: LiveServer, root: str, kid: str, *, as_json: bool) -> str:
    """What ``tether watch root`` printed until the steer of ``kid`` showed."""
    extra = ["--json"] if as_json else []
    proc = subprocess.Popen(
        [TETHER, "watch", root, "--url", server.url, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_plain_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def expect(needle: str) -> None:
        deadline = time.monotonic() + 20.0
        while not any(needle in line for line in seen):
            try:
                seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.0)))
            except queue.Empty:
                raise AssertionError(f"no {needle!r} in {seen}") from None

    try:
        expect("snapshot" if as_json else "kid")  # subscribed: the first tree is out
        steered = tether_cli(server, "steer", kid, f"steer {NASTY}")
        assert steered.returncode == 0, steered.stderr
        expect('"marker"' if as_json else "Steered")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
            reader.join(timeout=5)
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            proc.stderr.close()
    while not lines.empty():
        seen.append(lines.get())
    return "".join(seen)


BAD_SLUGS = ("a\x1b[2Jb", "a\x9bb", "a\u202eb", "a\x7fb", "two\nlines", "a\tb")


def test_a_slug_with_a_control_character_is_refused_over_rpc_and_the_cli(
    server: LiveServer,
) -> None:
    root = server.call("session.open", {"driver": SCRIPTED, "slug": "fine"})["session"]
    for slug in BAD_SLUGS:
        opened = server.rpc("session.open", {"driver": SCRIPTED, "slug": slug})
        assert rpc_error(opened)[1] == "invalid-params", slug
        spawned = server.rpc("subagent.spawn", {"parent": root, "driver": SCRIPTED, "slug": slug})
        assert rpc_error(spawned)[1] == "invalid-params", slug
    done = tether_cli(server, "open", "--slug", "x\x1b[2J")
    assert done.returncode == 1 and "invalid-params" in done.stderr, done.stderr
    assert not any(c in done.stderr for c in RAW), done.stderr
    agents = server.call("subagent.list", {"root": root, "scope": "descendants"})["agents"]
    assert agents == []


def test_a_slug_with_a_control_character_is_refused_by_the_api_and_the_tools(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session("drivers:ToolCaller", slug="fine")
    for slug in BAD_SLUGS:
        with pytest.raises(tether.InvalidParams, match="control character"):
            rt.open_session(SCRIPTED, slug=slug)
        with pytest.raises(tether.InvalidParams, match="control character"):
            rt.spawn(root, SCRIPTED, slug=slug)
    calls: list[list[Any]] = [["spawn_agent", {"slug": s}] for s in BAD_SLUGS]
    rec = Recorder(rt)
    rt.send(root, "spawn", authority=tether.User(parent=root), data={"calls": calls})
    assert rec.turn_ended(root, timeout=30.0)["outcome"] == "completed"
    results = [json.loads(e.text) for e in rt.transcript(root) if e.kind == "assistant"]
    assert [r.get("error") for r in results] == ["invalid-params"] * len(BAD_SLUGS), results
    assert rt.list_agents(root) == []
