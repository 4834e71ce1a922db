"""An agent stays inside its tree (semantics §17.4): what its commands can reach of the
host, tried for real against a running ``tether serve``.

A ChatAgent (against the model server over HTTP) runs a command that looks for the
server's token, its own model key and a named secret in its environment, reads the
token's file, the store and the host's memory, and tries to abort another tree's
subagent over ``/rpc`` with whatever token it found. Without ``--tool-user`` the command
runs as the host's user (the docs say what that can read); with it, as a user this test
makes, it can read none of the host's files nor its processes.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from tether.testing import ModelServer
from tether_server import LiveServer, running_server, wait_until

pytestmark = [pytest.mark.timeout(120)]

CHAT = "tether.agents:ChatAgent"
KEY_ENV = "TETHER_TEST_SECRET_KEY"
KEY = "sk-tether-secret-key-5f1e2d"
TOKEN = "tether-secret-token-93ab1c"
NAMED = "TETHER_TEST_NAMED_SECRET"
NAMED_VALUE = "named-secret-value-7c4d"
VALUES = (KEY, TOKEN, NAMED_VALUE)
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by any user, wherever the checkout is

# What the agent's command tries: each line says what it got. The other tree's address
# and the places to read come in the environment the test gives the script's argv.
_ATTACK = textwrap.dedent(
    """
    import json, os, sys, urllib.error, urllib.request
    url, victim, parent, token_file, db, host_pid = sys.argv[1:7]
    print("uid", os.getuid())
    print("env", json.dumps(dict(os.environ)))
    for path in (token_file, db, f"/proc/{host_pid}/environ", f"/proc/{os.getppid()}/environ"):
        try:
            with open(path, "rb") as f:
                print("read", path, len(f.read()))
        except OSError as exc:
            print("denied", path, exc.errno)
    token = os.environ.get("TETHER_TOKEN", "")
    try:
        with open(token_file) as f:
            token = f.read().strip()
    except OSError:
        pass
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "subagent.interrupt", "params": {
        "address": {"session": victim, "parent": parent}, "kind": "abort", "reason": "x"}})
    req = urllib.request.Request(url + "/rpc", body.encode(), {
        "Content-Type": "application/json", "Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            print("rpc", r.status, r.read().decode())
    except urllib.error.HTTPError as exc:
        print("rpc", exc.code)
    """
)


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    with ModelServer(process=True, realtime=True) as s:
        yield s


@pytest.fixture(scope="module")
def tool_user() -> Iterator[str]:
    """A user of this machine for the tools, made for these tests and removed after."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("making a user needs root and useradd (CI and these sessions have both)")
    name = f"tt{os.getpid()}"
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert made.returncode == 0, made.stderr
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)


def _victim(serve: LiveServer) -> tuple[str, str]:
    """Another tree: a root with a child whose turn runs until stopped."""
    root: str = serve.call("session.open", {"driver": "tether:Scripted", "slug": "other"})[
        "session"
    ]
    child: str = serve.call(
        "subagent.spawn",
        {
            "parent": root,
            "driver": "tether:Scripted",
            "slug": "victim",
            "prompt": "work",
            "data": {"steps": [{"op": "hang"}]},
        },
    )["session"]
    serve.wait_state(child, "running")
    return root, child


def _attack(serve: LiveServer, model: ModelServer, script: str) -> tuple[dict[str, list[str]], str]:
    """Run the attack as an agent's command; what it printed, by what it tried, and the
    other tree's child (for the caller to check it was not touched)."""
    other_root, victim = _victim(serve)
    assert serve.proc is not None
    argv = [
        SYSTEM_PYTHON,
        "-c",
        _ATTACK,
        serve.url,
        victim,
        other_root,
        str(serve.workdir / "token"),
        str(serve.workdir / "state.db"),
        str(serve.proc.pid),
    ]
    model.script(
        script,
        [
            {"tool_calls": [{"name": "run_command", "arguments": {"argv": argv}}]},
            {"text": "done"},
        ],
    )
    config = {
        "model": {"base_url": model.url, "name": script, "api_key_env": KEY_ENV, "timeout": 30},
        "tools": ["run_command"],
    }
    agent: str = serve.call("session.open", {"driver": CHAT, "config": config, "slug": "agent"})[
        "session"
    ]
    serve.call("session.prompt", {"session": agent, "content": "look around"})

    def output() -> str | None:
        entries = serve.call("subagent.transcript", {"session": agent})["entries"]
        tools = [e for e in entries if e["kind"] == "tool"]
        return json.dumps(tools) if tools else None

    found = json.loads(wait_until(output, timeout=60, what="the command's tool entry"))
    serve.wait_state(agent, "idle", "parked")
    text = "\n".join(str(e.get("text", "")) + json.dumps(e.get("data")) for e in found)
    lines: dict[str, list[str]] = {}
    for line in _stdout(found).splitlines():
        what, _, rest = line.partition(" ")
        lines.setdefault(what, []).append(rest)
    assert "uid" in lines, text  # the command ran and said what it saw
    # the key reached the model client, as a header of its request, and only there
    assert all(r.authorization == f"Bearer {KEY}" for r in model.requests_for(script))
    return lines, victim


def _stdout(tools: list[dict[str, Any]]) -> str:
    """The command's standard output, from its tool entry (the result as the model read it)."""
    result = json.loads(tools[0]["text"])
    return str(result["stdout"])


def _server_env() -> dict[str, str]:
    return {"TETHER_TOKEN": TOKEN, KEY_ENV: KEY, NAMED: NAMED_VALUE}


def test_an_agents_command_sees_neither_the_token_nor_a_key_nor_a_named_secret(
    tmp_path: Path, model: ModelServer
) -> None:
    with running_server(tmp_path, "--secret-env", NAMED, env=_server_env()) as serve:
        lines, victim = _attack(serve, model, "no-tool-user")
        env = json.loads(lines["env"][0])
        assert "TETHER_COMMAND" in env  # the command's own environment, as Tether made it
        for name in ("TETHER_TOKEN", KEY_ENV, NAMED):
            assert name not in env, name
        assert lines["rpc"] == ["401"]  # no token in reach: the other tree is not touched
        assert serve.call("subagent.status", {"session": victim})["state"] == "running"
        # and no value of them is in anything the store keeps of the agent's turn
        entries = serve.call("subagent.transcript", {"session": victim})
        assert not any(v in json.dumps(entries) for v in VALUES)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user may enter (pytest's own are 0700): what keeps the tool user
    out of the store's files must be their own modes."""
    path = Path(tempfile.mkdtemp(prefix="tether-open-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_with_a_tool_user_an_agents_command_reads_neither_the_token_file_nor_the_host(
    open_dir: Path, model: ModelServer, tool_user: str
) -> None:
    args = ("--secret-env", NAMED, "--tool-user", tool_user)
    env = {KEY_ENV: KEY, NAMED: NAMED_VALUE, "TETHER_TOKEN": ""}  # the server makes one
    with running_server(open_dir, *args, env=env) as serve:
        assert serve.token and (open_dir / "token").stat().st_mode & 0o777 == 0o600
        assert (open_dir / "state.db").stat().st_mode & 0o077 == 0
        lines, victim = _attack(serve, model, "tool-user")
        user = pwd.getpwnam(tool_user)
        assert lines["uid"] == [str(user.pw_uid)]
        env = json.loads(lines["env"][0])
        assert env["HOME"] == user.pw_dir and env["USER"] == tool_user
        # the token file, the store, the host's memory and the worker's: none opened
        assert "read" not in lines, lines["read"]
        assert len(lines["denied"]) == 4
        printed = "\n".join(line for found in lines.values() for line in found)
        assert not any(v in printed for v in (KEY, NAMED_VALUE, serve.token))
        assert lines["rpc"] == ["401"]
        assert serve.call("subagent.status", {"session": victim})["state"] == "running"


def test_a_tool_user_the_host_cannot_become_is_refused_when_the_runtime_starts(
    tool_user: str,
) -> None:
    for name, why in (
        ("tether-no-such-user-x", "no user"),
        ("root", "root"),
        (pwd.getpwuid(os.geteuid()).pw_name, "root"),
    ):
        with pytest.raises(tether.InvalidParams, match=why):
            tether.Runtime(tool_user=name)
    with pytest.raises(tether.InvalidParams, match="local backend"):
        tether.Runtime(tool_user=tool_user, backend="ray")
    with pytest.raises(tether.InvalidParams, match="secret_env"):
        tether.Runtime(secret_env="TETHER_TOKEN")


@pytest.mark.parametrize("containment", ["auto", "walk"])
def test_a_tool_users_command_is_still_cut_by_a_stop(tool_user: str, containment: str) -> None:
    uid = pwd.getpwnam(tool_user).pw_uid

    def theirs() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid]

    with tether.Runtime(workers=1, grace=1.0, tool_user=tool_user, containment=containment) as rt:
        root = rt.open_session("tether:Scripted", slug="lead")
        # a command, and an escapee of its own session that ignores SIGTERM
        escape = "setsid sh -c 'trap \"\" TERM; sleep 300' & sleep 300"
        step = {"op": "tool", "argv": ["sh", "-c", escape]}
        me = tether.User(parent=root)
        rt.send(root, "work", authority=me, data={"steps": [step]})

        def started() -> list[psutil.Process] | None:
            now = theirs()
            return now if len(now) >= 3 else None

        found = wait_until(started, what="the tool user's tree")
        assert all(p.uids().real == uid for p in found)
        assert rt.interrupt(root, authority=me, kind="abort", reason="stop") is not None
        rt.wait(root, until="parked", timeout=30)
        _, alive = psutil.wait_procs(found, timeout=10)
        assert not alive, alive
        assert rt.turns(root)[-1].outcome == "aborted"
