"""Helpers for the tests of agents against the scripted model server (ChatAgent, the
adapters): what the worker has read of a stream, cancels cut mid-stream, an MCP server to
open, the parent's notice. They run in the test process only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil

import tether
from drivers import ROOT, SCRIPTED, Recorder, entries, eventually
from tether import User
from tether.testing import ModelServer
from tether.testing.mcp_server import LOG_ENV


def server_port(server: ModelServer) -> int:
    return int(server.url.rsplit(":", 1)[1].split("/")[0])


def all_read(server: ModelServer) -> bool:
    """Every client connection to the server has read all that arrived (its receive
    queue in /proc/net/tcp is empty): the agent has the streamed text, with no await
    between reading it and adding it to its reply."""
    hexport = f"{server_port(server):04X}"
    found = False
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[2].endswith(f":{hexport}") and fields[3] == "01":  # established, to us
                found = True
                if int(fields[4].split(":")[1], 16):
                    return False
    return found


def talking_to(rt: tether.Runtime, server: ModelServer) -> psutil.Process | None:
    """The worker with a connection open to the model server (the agent's)."""
    at = server_port(server)
    for pid in rt.worker_pids:
        try:
            proc = psutil.Process(pid)
            if any(c.raddr and c.raddr.port == at for c in proc.net_connections(kind="tcp")):
                return proc
        except psutil.Error:
            continue
    return None


CUT_TRIES = 60
CUT_TEXT = "a partial answer that will never end"
CUT_REPLIES = [{"text": CUT_TEXT, "chunk": 6, "hang": True}] * CUT_TRIES  # for cut_every_time


def cut_every_time(
    rt: tether.Runtime, server: ModelServer, script: str, child: str, me: User
) -> None:
    """Cancel ``CUT_TRIES`` turns of ``child`` (its script: ``CUT_TEXT`` in chunks, then a
    hang) as soon as the worker has read what was sent: each keeps a partial reply, a
    prefix of the text, marked ``cut``. Bytes the worker had read but not yet parsed
    when the cancel came were lost with the whole partial (once in ~50-300 tries)."""
    rec = Recorder(rt)
    for i in range(CUT_TRIES):
        after = max((e.seq for e in rt.transcript(child)), default=0)
        rt.send(child, "go", authority=me)
        server.wait_requests(i + 1, script=script, timeout=60.0)

        def hanging(s: ModelServer, i: int = i) -> bool:
            return s.requests_for(script)[i].hanging

        server.wait_for(hanging, what="the hang")
        eventually(lambda: all_read(server), timeout=10.0, what="the agent to read the reply")
        rt.interrupt(child, authority=me, kind="cancel", reason=f"try {i}")
        ended = rec.turn_ended(child, count=i + 1, timeout=30.0)
        assert ended["outcome"] == "cancelled", (i, ended)
        said = [e for e in rt.transcript(child, after=after) if e.kind == "assistant"]
        assert said, f"try {i}/{CUT_TRIES}: the cancelled turn kept no partial reply"
        assert said[-1].text and CUT_TEXT.startswith(said[-1].text), (i, said[-1])
        assert (said[-1].data or {}).get("cut") is True, (i, said[-1])


def mcp_files(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """The ``mcp`` config of one MCP stdio server named ``files`` (the SDK's, tests' own
    build) logging what it receives, and its log."""
    log = tmp_path / "mcp.log"
    src = str(ROOT / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    server = {
        "command": [sys.executable, "-m", "tether.testing.mcp_server"],
        "env": {LOG_ENV: str(log), "PYTHONPATH": path},
    }
    return {"servers": {"files": server}, "grace": 2.0}, log


def last_notice(rt: tether.Runtime, root: str) -> dict[str, Any]:
    """The last notice ``root`` got (of its child's turn), once there is one."""
    eventually(lambda: entries(rt, root, "notice"), what="the parent's notice")
    data = entries(rt, root, "notice")[-1].data
    assert data is not None
    found: dict[str, Any] = data["notice"]
    return found


def check_a_cut_reply_is_counted(server: ModelServer, driver: str, config: dict[str, Any]) -> None:
    """A turn of ``driver`` (``config``'s model: a script of ``server``'s, which this sets)
    whose reply is cut by a cancel mid-stream counts it (semantics §15.2): about the
    prompt tokens the server counts for the same request when it reports them (four
    characters a token), the completion that streamed at the same rate, ``estimated``; and
    its budget spent what its record says. The grace is long: a turn killed at the end
    of its grace could say nothing more, whatever it counts."""
    script = config["model"]["name"]
    server.script(
        script, [{"text": "I am halfway through a long answer", "chunk": 4, "hang": True}]
    )
    with tether.Runtime(workers=1, grace=30.0) as rt:
        rec = Recorder(rt)
        root = rt.open_session(SCRIPTED)
        sid = rt.spawn(root, driver, slug="agent", config=config, budget={"tokens": 10**6})
        assert isinstance(sid, str)
        me = User(parent=root)
        rt.send(sid, "tell me everything", authority=me)
        [request] = server.wait_requests(1, script=script, timeout=60.0)
        server.wait_for(lambda s: s.requests_for(script)[0].hanging, what="the hang")
        eventually(lambda: all_read(server), timeout=10.0, what="the agent to read what was sent")
        rt.interrupt(sid, authority=me, kind="cancel", reason="enough")
        ended = rec.turn_ended(sid, timeout=30.0)
        assert (ended["outcome"], ended["forced"]) == ("cancelled", False), ended
        cut = "".join(e.text for e in entries(rt, sid, "assistant"))
        body = request.body
        server_count = len(json.dumps([body.get("messages", []), "", body.get("tools") or []])) // 4
        usage = rt.turns(sid)[-1].usage
        assert usage is not None, "the cut reply cost nothing"
        assert usage.get("estimated") is True, usage
        assert abs(usage["prompt_tokens"] - server_count) <= server_count / 4, (usage, server_count)
        assert abs(usage.get("completion_tokens", 0) - len(cut) / 4) <= 1, (usage, cut)
        spent = rt.budget(sid).spent["tokens"]
        assert spent == usage["prompt_tokens"] + usage.get("completion_tokens", 0), (spent, usage)
