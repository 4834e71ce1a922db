"""The real ``tether`` command, in a subprocess, against a live ``tether serve``."""

from __future__ import annotations

import argparse
import getpass
import io
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from drivers import ROOT
from tether_server import (
    TETHER,
    LiveServer,
    running_server,
    tether_cli,
    wait_until,
)

HANG = json.dumps([{"op": "hang"}])


def ok(server: LiveServer, *args: str) -> str:
    done = tether_cli(server, *args)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout.strip()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Streaming:
    """A long-running ``tether`` command whose output lines are read on a thread."""

    def __init__(self, server: LiveServer, *args: str) -> None:
        self.proc = subprocess.Popen(
            [TETHER, *args, "--url", server.url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # As in a terminal, Ctrl-C must reach the command: a test run started in the
            # background of a shell inherits SIGINT ignored, and Python keeps it ignored.
            preexec_fn=_default_sigint,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, needle: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if needle in line:
                    return line
            try:
                self.seen.append(self.lines.get(timeout=max(deadline - time.monotonic(), 0.0)))
            except queue.Empty:
                raise AssertionError(f"no {needle!r} in output; got {self.seen}") from None

    def interrupt(self) -> int:
        """Ctrl-C, as a person ends --follow or watch; the exit code."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=15)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self._reader.join(timeout=5)  # EOF once the process is gone
            assert self.proc.stdout is not None and self.proc.stderr is not None
            self.proc.stdout.close()
            self.stderr = self.proc.stderr.read()
            self.proc.stderr.close()


def _tree(server: LiveServer) -> tuple[str, str, str, str]:
    root = ok(server, "open", "--slug", "main")
    a = ok(server, "spawn", root, "--slug", "worker-a", "--prompt", "dig", "--steps", HANG)
    b = ok(server, "spawn", root, "--slug", "worker-b")
    a1 = ok(server, "spawn", a, "--slug", "helper", "--prompt", "dig", "--steps", HANG)
    assert ok(server, "send", b, "queued", "--no-wake").startswith("m_")
    server.wait_state(a, "running")
    server.wait_state(a1, "running")
    return root, a, b, a1


def test_tree_is_indented_with_state_pending_and_slug(server: LiveServer) -> None:
    root, a, b, a1 = _tree(server)
    lines = ok(server, "tree", root).splitlines()
    assert lines[0].startswith(f"{root}  main  idle")
    assert lines[1] == f"  {a}  worker-a  running  pending=0"
    assert lines[2] == f"    {a1}  helper  running  pending=0"
    assert lines[3].startswith(f"  {b}  worker-b  ") and lines[3].endswith("pending=1")
    as_json = json.loads(ok(server, "tree", root, "--json"))
    assert as_json["root"]["id"] == root
    assert [x["slug"] for x in as_json["agents"]] == ["worker-a", "helper", "worker-b"]


def _running_turn(server: LiveServer, session: str) -> str:
    turn: str = server.call("subagent.status", {"session": session})["turn"]
    assert turn.startswith("t_")
    return turn


def test_steer_cancel_abort_and_their_exit_codes(server: LiveServer) -> None:
    root, a, _, a1 = _tree(server)
    a_turn, a1_turn = _running_turn(server, a), _running_turn(server, a1)
    # steer: the parent is looked up with subagent.status when --parent is left out.
    assert ok(server, "steer", a1, "look at the tests") == f"steered {a1_turn}"

    def steered() -> bool:
        entries = server.call("subagent.transcript", {"session": a1})["entries"]
        return any(e["kind"] == "marker" and e["action"] == "steered" for e in entries)

    wait_until(steered, what="the steer marker")
    cancel = ("cancel", a, "--reason", "wrong approach", "--grace", "2", "--parent", root)
    assert ok(server, *cancel) == f"cancelled {a_turn}"
    assert server.wait_state(a, "parked")["state"] == "parked"
    assert server.call("subagent.turns", {"session": a})["turns"][-1]["outcome"] == "cancelled"
    assert server.call("subagent.status", {"session": a1})["state"] == "running"  # no cascade

    refused = tether_cli(server, "abort", a1, "--parent", root)  # root is not a1's parent
    assert refused.returncode == 1
    assert "subagent-unauthorized" in refused.stderr
    assert server.call("subagent.status", {"session": a1})["state"] == "running"

    assert json.loads(ok(server, "abort", a1, "--json")) == {"accepted": True, "turn": a1_turn}
    server.wait_state(a1, "parked")
    assert server.call("subagent.turns", {"session": a1})["turns"][-1]["outcome"] == "aborted"

    assert tether_cli(server, "cancel").returncode == 2  # no target: usage
    assert tether_cli(server, "steer", a1).returncode == 2  # a steer without guidance
    # A root's owner holds the root's own address; the root is idle: an accepted no-op.
    assert ok(server, "cancel", root) == "no-op: no running turn"
    assert ok(server, "steer", root, "hi") == "no-op: no running turn, or it is stopping"
    assert json.loads(ok(server, "abort", root, "--json")) == {"accepted": True, "turn": None}
    stranger = tether_cli(server, "cancel", root, "--parent", a)
    assert stranger.returncode == 1 and "subagent-unauthorized" in stranger.stderr
    missing = tether_cli(server, "tree", "s_nobody")
    assert missing.returncode == 1 and "not-found" in missing.stderr


def test_turn_guard_and_a_later_turn(server: LiveServer) -> None:
    root = ok(server, "open")
    kid = ok(server, "spawn", root, "--prompt", "one", "--steps", HANG)
    server.wait_state(kid, "running")
    first = _running_turn(server, kid)
    assert ok(server, "cancel", kid, "--turn", first) == f"cancelled {first}"
    server.wait_state(kid, "parked")
    assert ok(server, "send", kid, "two", "--steps", HANG).startswith("m_")
    server.wait_state(kid, "running")
    second = _running_turn(server, kid)
    assert second != first
    # A Stop aimed at the first turn never lands on the second.
    for kind in ("cancel", "abort", "preempt"):
        assert ok(server, kind, kid, "--turn", first) == f"no-op: {first} is not the running turn"
    stale = json.loads(ok(server, "steer", kid, "hello", "--turn", first, "--json"))
    assert stale == {"accepted": True, "turn": None}
    info = server.call("subagent.status", {"session": kid})
    assert (info["state"], info["turn"], info["stopping"]) == ("running", second, None)
    assert ok(server, "abort", kid, "--turn", second) == f"aborted {second}"
    server.wait_state(kid, "parked")
    turns = server.call("subagent.turns", {"session": kid})["turns"]
    assert [(t["id"], t["outcome"]) for t in turns] == [(first, "cancelled"), (second, "aborted")]


def test_send_prompt_and_inbox(server: LiveServer) -> None:
    root = ok(server, "open")
    kid = ok(server, "spawn", root)
    assert ok(server, "inbox", kid) == ""
    first = ok(server, "send", kid, "look at\n  the logs", "--no-wake")
    second = json.loads(ok(server, "send", kid, "x" * 300, "--no-wake", "--json"))
    assert first.startswith("m_") and second["accepted"] is True
    assert second["message"].startswith("m_") and second["message"] != first
    lines = ok(server, "inbox", kid).splitlines()
    me = getpass.getuser()  # the sender: the name the CLI sends by default
    assert lines[0] == f"{first}  user  {me}  look at the logs"
    assert lines[1].startswith(f"{second['message']}  user  {me}  xxx") and lines[1].endswith("…")
    listed = json.loads(ok(server, "inbox", kid, "--json"))["messages"]
    assert [m["id"] for m in listed] == [first, second["message"]]
    assert listed[1]["preview"] == "x" * 200
    missing = tether_cli(server, "inbox", "s_nobody")
    assert missing.returncode == 1 and "not-found" in missing.stderr
    prompted = ok(server, "prompt", root, "hello")
    assert prompted.startswith("m_")
    server.wait_state(root, "idle")
    turns = server.call("subagent.turns", {"session": root})["turns"]
    assert turns[-1]["message"] == prompted
    as_json = json.loads(ok(server, "prompt", root, "again", "--json"))
    assert as_json["accepted"] is True and as_json["message"].startswith("m_")


def test_status_and_tree_show_a_turn_waiting_for_a_worker(server: LiveServer) -> None:
    root, a, _, _ = _tree(server)  # a and its helper hang on the server's two workers
    c = ok(server, "spawn", root, "--slug", "worker-c", "--prompt", "dig", "--steps", HANG)
    server.wait_state(c, "running")
    assert ok(server, "status", c).endswith("running  pending=0  waiting for a worker")
    assert ok(server, "status", a) == f"{a}  worker-a  running  pending=0"
    lines = ok(server, "tree", root).splitlines()
    assert lines[-1] == f"  {c}  worker-c  running  pending=0  waiting for a worker"
    assert json.loads(ok(server, "status", c, "--json"))["dispatched"] is False
    waiting = _running_turn(server, c)
    assert ok(server, "abort", c) == f"aborted {waiting}"
    server.wait_state(c, "parked")


def test_preempt_kills_the_command_and_the_turn_goes_on(server: LiveServer) -> None:
    root = ok(server, "open")
    steps = json.dumps([{"op": "tool", "argv": ["sleep", "60"]}, {"op": "say", "text": "after"}])
    kid = ok(server, "spawn", root, "--prompt", "go", "--steps", steps)
    assert server.proc is not None
    host = psutil.Process(server.proc.pid)

    def sleeping() -> bool:
        return any(p.name() == "sleep" for p in host.children(recursive=True))

    wait_until(sleeping, what="the tool subprocess")

    turn = _running_turn(server, kid)

    def preempted() -> bool:
        # Bound to the running turn; until the worker has registered the command, the
        # worker has nothing to kill and the turn simply goes on.
        assert ok(server, "preempt", kid, "--reason", "stuck") == f"preempted {turn}"
        entries = server.call("subagent.transcript", {"session": kid})["entries"]
        return any(e["kind"] == "marker" and e["action"] == "preempted" for e in entries)

    wait_until(preempted, what="the preempted marker")
    server.wait_state(kid, "idle")
    assert server.call("subagent.turns", {"session": kid})["turns"][-1]["outcome"] == "completed"
    transcript = ok(server, "transcript", kid)
    assert "marker: ⊘ Preempted by user" in transcript and "assistant: after" in transcript


def test_transcript_prints_and_follows(server: LiveServer) -> None:
    root = ok(server, "open")
    steps = json.dumps([{"op": "say", "text": "hello"}, {"op": "hang"}])
    child = ok(server, "spawn", root, "--prompt", "start", "--steps", steps)
    server.wait_state(child, "running")
    follow = Streaming(server, "transcript", child, "--follow")
    try:
        follow.expect("user: start")
        follow.expect("assistant: hello")
        ok(server, "cancel", child, "--reason", "enough")
        follow.expect("⊘ Cancelled by user")
        follow.expect("cancelled after")
    finally:
        assert follow.interrupt() == 0
    lines = ok(server, "transcript", child).splitlines()
    assert [line.split("]", 1)[1].split(":", 1)[0] for line in lines] == [
        " user",
        " assistant",
        " marker",
        " assistant",
    ]
    entries = [json.loads(x) for x in ok(server, "transcript", child, "--json").splitlines()]
    marker = entries[2]
    assert marker["action"] == "cancelled" and marker["reason"] == "enough"
    after = ok(server, "transcript", child, "--after", str(marker["seq"]))
    assert after.count("\n") == 0 and "cancelled after" in after


def test_transcript_names_the_calls_of_a_reply_that_is_only_tool_calls(server: LiveServer) -> None:
    from tether.testing import ModelServer

    with ModelServer() as model:
        call = {"name": "run_command", "arguments": {"argv": ["echo", "hi"]}}
        model.script("cli", [{"tool_calls": [call]}, {"text": "done"}])
        config: dict[str, Any] = {"model": {"base_url": model.url, "name": "cli", "retries": 0}}
        config["tools"] = ["run_command"]
        root = ok(
            server, "open", "--driver", "tether.agents:ChatAgent", "--config", json.dumps(config)
        )
        ok(server, "prompt", root, "go")
        wait_until(
            lambda: server.call("subagent.turns", {"session": root})["turns"][-1]["outcome"],
            what="the model turn to end",
        )
    lines = ok(server, "transcript", root).splitlines()
    kinds = [line.split("] ", 1)[1].split(":", 1)[0] for line in lines]
    assert kinds == ["user", "assistant", "tool", "assistant"], lines
    assert lines[1].endswith("] assistant: (calls run_command)"), lines
    assert lines[3].endswith("] assistant: done"), lines
    assert "gap is\nnot a missing entry" in ok(server, "transcript", "--help")


def test_watch_redraws_and_prints_markers(server: LiveServer) -> None:
    root, a, _, a1 = _tree(server)
    watch = Streaming(server, "watch", root, "--json")
    try:
        snapshot = json.loads(watch.expect('"event": "snapshot"'))
        assert [x["slug"] for x in snapshot["data"]["agents"]] == ["worker-a", "helper", "worker-b"]
        ok(server, "cancel", a1, "--reason", "watched")
        line = watch.expect('"event": "marker"')
        assert json.loads(line)["data"]["session"] == a1
    finally:
        assert watch.interrupt() == 0
    live = Streaming(server, "watch", root)
    try:
        live.expect("worker-a")  # the first snapshot
        ok(server, "abort", a)
        live.expect("⊘ Aborted by user")
    finally:
        assert live.interrupt() == 0


def test_help_and_usage(server: LiveServer) -> None:
    commands = ("open", "prompt", "spawn", "send", "tree", "steer", "cancel", "abort", "inbox")
    for command in (*commands, "pause", "resume"):
        done = subprocess.run(
            [TETHER, command, "--help"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0 and "example:" in done.stdout and "--url" in done.stdout
    for command in ("preempt", "transcript", "watch", "serve"):
        done = subprocess.run(
            [TETHER, command, "--help"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0 and "example:" in done.stdout
    assert subprocess.run([TETHER], capture_output=True, timeout=30).returncode == 2
    assert subprocess.run([TETHER, "explode"], capture_output=True, timeout=30).returncode == 2
    bad_json = tether_cli(server, "prompt", "s_x", "hi", "--data", "{nope")
    assert bad_json.returncode == 2 and "not valid JSON" in bad_json.stderr


def test_unreachable_server_is_a_refusal(tmp_path: Path) -> None:
    done = subprocess.run(
        [TETHER, "tree", "s_x", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1 and "unreachable" in done.stderr


def test_token_from_flag_or_environment(tmp_path: Path) -> None:
    with running_server(tmp_path, "--token", "t0ken") as server:
        denied = tether_cli(server, "open")
        assert denied.returncode == 1 and "unauthorized" in denied.stderr
        assert ok(server, "open", "--token", "t0ken").startswith("s_")
        from_env = subprocess.run(
            [TETHER, "open", "--url", server.url],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "TETHER_TOKEN": "t0ken"},
        )
        assert from_env.returncode == 0 and from_env.stdout.startswith("s_")


def test_watch_labels_a_turn_waiting_for_a_worker() -> None:
    from rich.console import Console

    from tether.cli.watch import render_tree

    def info(slug: str, depth: int, **fields: object) -> dict[str, object]:
        return {"id": f"s_{slug}", "slug": slug, "depth": depth, "state": "running", **fields}

    root = info("root", 0, dispatched=True)
    agents = [info("queued", 1, dispatched=False), info("older-server", 1)]
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_tree(root, agents))
    lines = console.export_text().splitlines()
    assert "waiting for a worker" not in lines[0]
    assert lines[1].endswith("waiting for a worker")
    assert "waiting for a worker" not in lines[2]  # no field: not said


# ---- pause, resume and --stall (semantics §14.4, §14.5) ----------------------------------------


@pytest.mark.timeout(60)
def test_pause_and_resume_print_their_turns(server: LiveServer) -> None:
    root, a, _, a1 = _tree(server)
    a_turn, a1_turn = _running_turn(server, a), _running_turn(server, a1)
    assert ok(server, "pause", root) == "no-op: no running turn"  # the root is idle
    assert ok(server, "resume", a) == "no-op: nothing paused"

    assert ok(server, "pause", a, "--reason", "let me look") == f"paused {a_turn}"
    assert ok(server, "status", a).startswith(f"{a}  worker-a  paused  ")
    lines = ok(server, "tree", root).splitlines()
    assert lines[1] == f"  {a}  worker-a  paused  pending=0"
    assert lines[2] == f"    {a1}  helper  running  pending=0"  # a session pause: a alone
    marker = server.call("subagent.transcript", {"session": a})["entries"][-1]
    assert (marker["action"], marker["reason"]) == ("paused", "let me look")
    refused = tether_cli(server, "pause", a1, "--parent", root)  # root is not a1's parent
    assert refused.returncode == 1 and "subagent-unauthorized" in refused.stderr
    assert ok(server, "resume", a) == f"resumed {a_turn}"
    assert server.call("subagent.status", {"session": a})["state"] == "running"

    # A subtree: every running turn below (and at) the target, one line each.
    paused = ok(server, "pause", a, "--subtree", "--json")
    assert sorted(json.loads(paused)["turns"]) == sorted([a_turn, a1_turn])
    assert server.call("subagent.status", {"session": a1})["state"] == "paused"
    resumed = ok(server, "resume", a, "--subtree").splitlines()
    assert sorted(resumed) == sorted([f"resumed {a_turn}", f"resumed {a1_turn}"])
    assert ok(server, "resume", a, "--subtree") == "no-op: nothing paused in the subtree"
    for sid in (a1, a):
        ok(server, "abort", sid)


def _stalled_turn_ends(server: LiveServer, session: str) -> str:
    def ended() -> str | None:
        out = ok(server, "turns", session)
        return out if out and "running" not in out else None

    return wait_until(ended, timeout=20.0, what=f"{session}'s turn to end")


@pytest.mark.timeout(60)
def test_stall_on_open_and_spawn_lets_the_watchdog_abort(server: LiveServer) -> None:
    sleep = json.dumps([{"op": "sleep", "seconds": 30}])
    root = ok(server, "open", "--stall", "after=0.4,steps=abort")
    ok(server, "prompt", root, "go", "--steps", sleep)
    assert _stalled_turn_ends(server, root).split("  ")[1:3] == ["aborted", "by system (watchdog)"]

    plain = ok(server, "open")
    nudge = "after=0.4,every=0.4,steps=steer+abort,nudge=say where you are, then go on"
    kid = ok(server, "spawn", plain, "--stall", nudge, "--prompt", "go", "--steps", sleep)
    assert _stalled_turn_ends(server, kid).split("  ")[1:3] == ["aborted", "by system (watchdog)"]
    markers = [
        e
        for e in server.call("subagent.transcript", {"session": kid})["entries"]
        if e["kind"] == "marker"
    ]
    assert [m["action"] for m in markers] == ["aborted"]  # the steer is never delivered


def test_a_bad_stall_spec_is_a_usage_error() -> None:
    def tether_offline(*args: str) -> subprocess.CompletedProcess[str]:
        # A usage error is found before any call: no server is needed (port 9 is discard).
        argv = [TETHER, *args, "--url", "http://127.0.0.1:9"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    for spec, says in (
        ("every=3", "after=SECONDS is required"),
        ("after=0", "after must be a positive number"),
        ("after=soon", "after must be a positive number"),
        ("after=1,steps=steer+explode", "not 'explode'"),
        ("after=1,repeat=1", "repeat must be an integer of at least 2"),
        ("after=1,bogus=2", "unknown key 'bogus'"),
        ("after=1,after=2", "after given twice"),
        ("60", "is not KEY=VALUE"),
        ("after=1,nudge= ", "nudge must not be empty"),
    ):
        for command in (("open",), ("spawn", "s_x")):
            done = tether_offline(*command, "--stall", spec)
            assert done.returncode == 2, (spec, done.stderr)
            assert "usage error" in done.stderr and says in done.stderr, (spec, done.stderr)


def test_stall_spec_parses_into_the_policy() -> None:
    from tether.cli.main import _stall_arg

    spec = "after=60, every=30,steps=steer+cancel+abort,nudge=say where you are, then stop,repeat=3"
    assert _stall_arg(spec) == {
        "after": 60.0,
        "every": 30.0,
        "steps": ["steer", "cancel", "abort"],
        "nudge": "say where you are, then stop",
        "repeat": 3,
    }
    assert _stall_arg("after=0.5,grace=2,steps=preempt") == {
        "after": 0.5,
        "grace": 2.0,
        "steps": ["preempt"],
    }


def test_watch_shows_a_paused_session() -> None:
    from rich.console import Console

    from tether.cli.watch import render_tree

    root = {"id": "s_root", "slug": "root", "depth": 0, "state": "running"}
    kid = {"id": "s_kid", "slug": "kid", "depth": 1, "state": "paused", "turn": "t_1"}
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_tree(root, [kid]))
    assert "kid s_kid paused pending=0" in console.export_text().splitlines()[1]


@pytest.mark.timeout(120)
def test_the_demo_names_the_lead_by_its_slug_and_ends_on_how_things_ended(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tether.cli.demo import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "lead  (idle)" in out and not re.search(r"lead [0-9a-f]{6}", out), out
    before = out.split("Transcripts (last lines)")[0].splitlines()
    last_frame = [line for line in before if line.strip() and not line.startswith("─")][-1]
    assert last_frame.startswith("every subagent's turns have ended"), last_frame
    assert "waiting for researcher" not in last_frame
    assert "demo finished" in out


# ---- a new user's first hour (issue 42) ---------------------------------------------------------


def _log_events(server: LiveServer, event: str) -> list[dict[str, Any]]:
    """The server's log lines (one JSON object each, at the default level) of ``event``."""
    lines = server.log_text().splitlines()
    found = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in found if e.get("event") == event]


@pytest.mark.timeout(60)
def test_a_failed_turn_is_a_warning_in_the_log_and_turns_prints_its_error(
    server: LiveServer,
) -> None:
    # A step the driver cannot take raises inside the turn: the turn fails.
    bad = json.dumps([{"op": "work", "every": "soon"}])
    root = ok(server, "open")
    ok(server, "prompt", root, "go", "--steps", bad)
    server.wait_state(root, "parked")
    turn = server.call("subagent.turns", {"session": root})["turns"][-1]
    assert turn["outcome"] == "failed" and "could not convert" in turn["error"], turn

    def logged() -> list[dict[str, Any]]:
        return [e for e in _log_events(server, "turn.failed") if e.get("turn") == turn["id"]]

    warning = wait_until(logged, what="the turn.failed line")
    assert len(warning) == 1, warning
    assert warning[0]["level"] == "warning" and warning[0]["session"] == root
    assert warning[0]["error"] == turn["error"]
    assert ok(server, "turns", root) == f"{turn['id']}  failed  {turn['error']}"


@pytest.mark.timeout(60)
def test_a_malformed_turn_guard_is_refused_and_stops_nothing(server: LiveServer) -> None:
    root = ok(server, "open")
    kid = ok(server, "spawn", root, "--prompt", "one", "--steps", HANG)
    server.wait_state(kid, "running")
    turn = _running_turn(server, kid)
    for args in (
        ("cancel", kid, "--turn", "t_nope"),
        ("abort", kid, "--turn", turn[2:]),  # the id without its prefix
        ("steer", kid, "go left", "--turn", "nope"),
    ):
        typo = tether_cli(server, *args)
        assert typo.returncode == 1, (args, typo.stdout)
        assert "invalid-params: turn must be a turn id" in typo.stderr, typo.stderr
    # A well-formed id of another turn is still the stale guard's no-op.
    other = "t_" + "0" * 32
    assert ok(server, "cancel", kid, "--turn", other) == f"no-op: {other} is not the running turn"
    info = server.call("subagent.status", {"session": kid})
    assert (info["state"], info["turn"], info["stopping"]) == ("running", turn, None)


def _markers(server: LiveServer, session: str) -> list[str]:
    entries = server.call("subagent.transcript", {"session": session})["entries"]
    return [e["text"] for e in entries if e["kind"] == "marker"]


def _hanging_kid(server: LiveServer, parent: str) -> str:
    """A child of ``parent`` with a turn held open, made over RPC (the CLI is what is tested)."""
    params = {
        "parent": parent,
        "driver": "tether:Scripted",
        "prompt": "go",
        "data": {"steps": [{"op": "hang"}]},
    }
    kid: str = server.call("subagent.spawn", params)["session"]
    server.wait_state(kid, "running")
    return kid


@pytest.mark.timeout(120)
def test_a_stop_from_the_cli_says_who_by_name_and_never_the_parent_agents_id(
    server: LiveServer,
) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    a = _hanging_kid(server, root)
    a1 = _hanging_kid(server, a)  # a grandchild: its parent a is an agent
    # --as names the person: the marker, the turn and the report say it, not a's id.
    ok(server, "steer", a1, "look left", "--as", "alice")
    wait_until(lambda: "↪ Steered by user alice: look left" in _markers(server, a1), what="steer")
    turn = _running_turn(server, a1)
    assert ok(server, "cancel", a1, "--reason", "wrong way", "--as", "alice") == f"cancelled {turn}"
    server.wait_state(a1, "parked")
    assert "⊘ Cancelled by user alice: wrong way" in _markers(server, a1)
    assert not any(a in text for text in _markers(server, a1))
    assert ok(server, "turns", a1) == f"{turn}  cancelled  by user alice  wrong way"
    assert f"{turn} ({a1}): cancel by user alice: wrong way" in ok(server, "report", turn)
    # A send says who sent it too.
    sent = ok(server, "send", a1, "and the docs", "--no-wake", "--as", "alice")
    assert ok(server, "inbox", a1) == f"{sent}  user  alice  and the docs"


@pytest.mark.timeout(120)
def test_a_stop_from_the_cli_is_by_the_login_name_unless_told_otherwise(
    server: LiveServer,
) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    a = _hanging_kid(server, root)
    me = getpass.getuser()
    turn = _running_turn(server, a)
    assert ok(server, "pause", a) == f"paused {turn}"
    assert ok(server, "resume", a, "--as", "") == f"resumed {turn}"  # '': no name
    # A name a terminal would act on is refused, and stops nothing.
    bad = tether_cli(server, "abort", a, "--as", "eve\x1b[2J")
    assert bad.returncode == 1 and "invalid-params" in bad.stderr, bad.stderr
    assert server.call("subagent.status", {"session": a})["stopping"] is None
    ok(server, "abort", a, "--as", "")
    server.wait_state(a, "parked")
    assert _markers(server, a) == [
        f"⏸ Paused by user {me}",
        "▶ Resumed by user",
        "⊘ Aborted by user",
    ]
    assert ok(server, "turns", a) == f"{turn}  aborted  by user"


@pytest.mark.timeout(120)
def test_a_steer_a_later_cancel_discarded_leaves_a_note_in_the_transcript(
    server: LiveServer,
) -> None:
    root = server.call("session.open", {"driver": "tether:Scripted"})["session"]
    # A step with no boundary in it: the steer waits for one, and the cancel comes first.
    steps = json.dumps([{"op": "sleep", "seconds": 60, "say": "thinking"}])
    kid = ok(server, "spawn", root, "--prompt", "go", "--steps", steps)
    wait_until(lambda: _assistant_texts(server, kid) == ["thinking"], what="the blocking step")
    turn = _running_turn(server, kid)
    assert ok(server, "steer", kid, "look left", "--as", "alice") == f"steered {turn}"
    stop = ("cancel", kid, "--reason", "enough", "--deadline", "0.5", "--as", "bob")
    assert ok(server, *stop) == f"cancelled {turn}"
    server.wait_state(kid, "parked")
    lines = ok(server, "transcript", kid).splitlines()
    markers = [line.split("] ", 1)[1] for line in lines if "] marker: " in line]
    assert markers == [
        "marker: ⊘ Cancelled by user bob: enough",
        "marker: ⊘ Escalated: no boundary before the deadline",
        "marker: ⊘ Discarded steer by user alice (the cancel came first): look left",
    ], lines
    entries = [json.loads(x) for x in ok(server, "transcript", kid, "--json").splitlines()]
    [note] = [e for e in entries if e.get("action") == "discarded"]
    assert (note["turn"], note["reason"], note["data"]) == (turn, "look left", {"stop": "cancel"})


def _assistant_texts(server: LiveServer, session: str) -> list[str]:
    entries = server.call("subagent.transcript", {"session": session})["entries"]
    return [e["text"] for e in entries if e["kind"] == "assistant"]


@pytest.mark.timeout(60)
def test_serve_and_mcp_help_say_the_default_of_every_option() -> None:
    for command in ("serve", "mcp"):
        done = subprocess.run(
            [TETHER, command, "--help"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0 and "example" in done.stdout, done.stderr
        # Each option's block: its line and the lines its help text wraps onto.
        blocks = re.split(r"\n(?=  -)", done.stdout.split("options:", 1)[1].split("example")[0])
        options = {b.split()[0].rstrip(","): " ".join(b.split()) for b in blocks if b.strip()}
        assert "--workers" in options and "--grace" in options, options
        for option, text in options.items():
            if option != "-h":
                assert "default: " in text, (command, option, text)
        if command == "serve":
            for option, default in {
                "--host": "127.0.0.1",
                "--port": "7777",
                "--workers": "2",
                "--grace": "5.0",
                "--max-body": "1048576",
                "--max-streams": "64",
                "--fd-reserve": "64",
                "--path": ".tether/state.db",
            }.items():
                assert f"(default: {default}" in options[option], (option, options[option])


def test_the_cli_table_in_serve_md_names_every_option_of_every_command() -> None:
    from tether.cli.main import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    doc = (ROOT / "docs" / "serve.md").read_text(encoding="utf-8")
    table = doc.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    cells = [row.split(" | ")[0].replace("\\|", "|") for row in table.splitlines()[2:]]
    shared = {"--help", "--url", "--token", "--json"}  # every command's, said above the table
    missing = []
    for name, command in sub.choices.items():
        if name in ("serve", "mcp", "demo"):  # their own sections and --help
            continue
        rows = " ".join(c for c in cells if re.search(rf"(?<![\w-]){name}(?![\w-])", c))
        if not rows:
            missing.append(name)
            continue
        for action in command._actions:
            for option in action.option_strings:
                if option.startswith("--") and option not in shared and option not in rows:
                    missing.append(f"{name} {option}")
    assert not missing, f"docs/serve.md's command table does not name {missing}"
