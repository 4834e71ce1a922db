"""Tether as a new user installs it (issue 42, items 13 and 14): the wheel built from this
checkout, installed in a fresh venv with one extra, runs an agent of that framework.

Real pip, real venv, real framework: the venv gets its packages from the package index
(this machine's pip configuration, the same in CI). First the wheel alone, whose adapter
is refused naming the extra to install; then with ``[pydantic-ai]``, whose Pydantic AI
agent runs to completion against ``tether.testing.ModelServer``, with no key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from drivers import ROOT

# The install is most of it: a few minutes on a busy 2-core machine.
pytestmark = [pytest.mark.install, pytest.mark.timeout(240)]

ADAPTER = "tether.adapters.pydantic_ai:PydanticAIAgent"

# The factory as docs/adapters-pydantic_ai.md writes one; config.model replaces its model.
FACTORY = """\
from pydantic_ai import Agent


def research_agent(config: dict) -> Agent:
    return Agent("openai:gpt-4o", instructions="You are a careful researcher.")
"""

OPEN = f"""\
import tether

with tether.Runtime() as rt:
    try:
        rt.open_session({ADAPTER!r}, config={{"agent": "myapp.agents:research_agent"}})
    except tether.DriverNotFound as exc:
        print(exc.message)
    else:
        print("opened")
"""

RUN = f"""\
import tether
from tether.testing import ModelServer

with ModelServer([{{"text": "Installed, and running."}}]) as model, tether.Runtime() as rt:
    sid = rt.open_session({ADAPTER!r}, config={{
        "agent": "myapp.agents:research_agent",
        "model": {{"base_url": model.url, "name": "replay"}},
    }})
    rt.prompt(sid, "hello")
    rt.wait(sid, timeout=60)
    turn = rt.turns(sid)[-1]
    print(turn.outcome, turn.error)
    print([e.text for e in rt.transcript(sid) if e.kind == "assistant"])
"""


def _run(argv: list[str], cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OPENAI_API_KEY")}
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_wheel_with_the_pydantic_ai_extra_alone_runs_a_pydantic_ai_agent(
    tmp_path: Path,
) -> None:
    dist, venv, project = tmp_path / "dist", tmp_path / "venv", tmp_path / "project"
    python = str(venv / "bin" / "python")
    # This venv's pip installs into the new one (pip --python): no pip of its own to set
    # up; and no bytecode compiled ahead for packages of which the scripts use little.
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile"]
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
        tmp_path,
        120,
    )
    [wheel] = dist.glob("tether_runtime-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, 60)
    (project / "myapp").mkdir(parents=True)
    (project / "myapp" / "__init__.py").write_text("")
    (project / "myapp" / "agents.py").write_text(FACTORY)
    (project / "open.py").write_text(OPEN)
    (project / "run.py").write_text(RUN)

    # Without the extra: refused at open, saying which extra brings it.
    _run([*pip, str(wheel)], tmp_path, 180)
    refused = _run([python, "open.py"], project, 60)
    assert "needs the extra tether-runtime[pydantic-ai]" in refused, refused
    assert "pip install 'tether-runtime[pydantic-ai]'" in refused, refused

    # With it (and nothing else): a Pydantic AI agent's turn runs to its end.
    _run([*pip, f"{wheel}[pydantic-ai]"], tmp_path, 200)
    out = _run([python, "run.py"], project, 90).splitlines()
    assert out[0] == "completed None", out
    assert out[1] == "['Installed, and running.']", out
