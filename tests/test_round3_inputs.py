"""Round 3 of the stop promise (issue 16): bad input refused up front, clocks that cannot
be broken, the watchdog's clock, history by size, one-shots under a subtree pause, and a
worker that leaves quietly when its host is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import tether
from tether import User

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def _child_env() -> dict[str, str]:
    path = os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


# ---- item 16: a worker whose host was SIGKILLed leaves quietly ---------------------------


@pytest.mark.timeout(180)
def test_workers_of_a_sigkilled_host_leave_quietly_without_a_traceback(tmp_path: Path) -> None:
    """Each try kills a host whose three workers are writing to it; their stderr (they
    inherit the host's) must hold no traceback, and every worker must be gone."""
    for attempt in range(4):
        db = tmp_path / f"state{attempt}.db"
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "round3_host_child.py"), str(db)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_child_env(),
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, proc.communicate(timeout=30)[1].decode(errors="replace")
            workers = [psutil.Process(pid) for pid in json.loads(line)["workers"]]
            os.kill(proc.pid, signal.SIGKILL)
            # EOF on stderr once every process that inherited it (workers, forkserver)
            # has exited: the whole tree is gone by then.
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=10.0)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
        text = err.decode(errors="replace")
        assert "Traceback" not in text, text
        assert "Process tether-worker" not in text, text  # the header of one, cut short
        assert len(text.splitlines()) <= len(workers), text


# ---- item 13: a subtree pause passes a one-shot by -------------------------------------


def test_a_subtree_pause_never_freezes_a_one_shot_and_its_holder_gets_the_result() -> None:
    with tether.Runtime(workers=3, grace=1.0) as rt:
        lead = rt.open_session("tether:Scripted", slug="lead")
        me = User(parent=lead)
        kid = rt.spawn(lead, "tether:Scripted", slug="kid")
        assert isinstance(kid, str)
        rt.send(kid, "hang", authority=User(parent=lead), data={"steps": [{"op": "hang"}]})
        work = {
            "steps": [{"op": "work", "steps": 10, "every": 0.05}, {"op": "say", "text": "done"}]
        }
        job = rt.spawn(lead, "tether:Scripted", mode="one-shot", prompt="one task", data=work)
        assert isinstance(job, tether.OneShot)
        rt.wait(kid, until="running")
        rt.wait(job.id, until="running")
        paused = rt.pause(lead, authority=me, scope="subtree", reason="look")
        assert rt.status(kid).state == "paused"
        assert rt.status(job.id).state != "paused"
        assert rt.status(kid).turn in paused
        assert job.result(timeout=10.0) == "done"  # while the subtree is paused
        assert rt.status(kid).state == "paused"
        resumed = rt.resume(lead, authority=me, scope="subtree")
        assert resumed == paused
        rt.interrupt(kid, authority=me, kind="abort")
