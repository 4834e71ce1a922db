"""``tether demo --adapters`` (src/tether/cli/demo_adapters.py) end to end: it runs each
installed framework's agent against the local model server and what it prints is true."""

from __future__ import annotations

import importlib.util
import re

import pytest

from drivers import escapee_procs


@pytest.mark.timeout(240)
@pytest.mark.long
def test_the_adapters_demo_steers_cancels_and_aborts_each_framework_leaving_no_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tether.cli.demo import main

    assert main(["--adapters"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    frameworks = {
        "Pydantic AI": ("pydantic_ai", "pydantic-ai"),
        "OpenAI Agents SDK": ("agents", "openai-agents"),
        "Claude Code": ("claude_agent_sdk", "claude"),
    }
    parts = re.split(r"─+ \d\. ", out)[1:]
    assert [p.split(" ─")[0] for p in parts] == list(frameworks)
    for part, (title, (module, extra)) in zip(parts, frameworks.items(), strict=True):
        if importlib.util.find_spec(module) is None:
            assert f"skipped: pip install 'tether-runtime[{extra}]' brings {title}" in part
            continue
        # the steer reached the next request and its marker sits before the reply to it
        assert 'its next model request carries: <steer origin="user" by="user">take the' in part
        steered = part.index("marker ↪ Steered by user: take the fast path")
        assert steered < part.index("switched to the fast path, as asked.")
        # the cancel closed the stream and kept what had streamed
        kept = re.search(r"turn cancelled; partial reply kept: '([^']*)'", part)
        assert kept is not None and kept.group(1).startswith("Here is the full"), part
        assert re.search(r"server saw the disconnect \d+ ms after the cancel", part)
    claude = parts[2]
    if "skipped" not in claude:
        token = re.search(r"left an escapee behind: (tether-demo-escapee-\w+), pid (\d+)", claude)
        assert token is not None, claude
        assert "turn aborted" in claude
        assert f"pid {token.group(2)} SIGKILL dead {token.group(1)} ← the escapee" in claude
        assert "SIGKILL dead the Claude Code CLI" in claude
        assert 'fates ["dead"]; escapees still alive: 0' in claude
        assert escapee_procs(token.group(1)) == []  # nothing of it, anywhere on the machine
    assert "demo finished" in out
