"""An adapter's factory as a new user writes it (issue 42, items 11 and 15).

The factory is the one docs/adapters-pydantic_ai.md shows, copied from the page into a
project directory of the test's own, and run by real workers against
``tether.testing.ModelServer`` with the real framework.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import tether
from drivers import ROOT, SCRIPTED, Recorder, family, runtime, texts
from tether.testing import ModelServer

pytest.importorskip("pydantic_ai")

pytestmark = pytest.mark.timeout(90)

ADAPTER = "tether.adapters.pydantic_ai:PydanticAIAgent"
DOC = ROOT / "docs" / "adapters-pydantic_ai.md"


def documented_factory() -> str:
    """The page's ``myapp/agents.py`` block, as written there."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    [factory] = [b for b in blocks if b.startswith("# myapp/agents.py\n")]
    return str(factory)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project directory holding ``myapp/agents.py`` from the page, on the import path
    of the workers started after it (they take the host's path)."""
    app = tmp_path / "project" / "myapp"
    app.mkdir(parents=True)
    (app / "__init__.py").write_text("")
    (app / "agents.py").write_text(documented_factory())
    monkeypatch.syspath_prepend(str(app.parent))
    return app.parent


def test_the_documented_pydantic_ai_factory_runs_against_the_configured_model_with_no_key(
    project: Path, server: ModelServer, db_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the factory names "openai:gpt-4o"; config.model replaces it, so no key is needed
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    server.script("pyd-doc-factory", [{"text": "Found it, with no key at all."}])
    config: dict[str, Any] = {
        "agent": "myapp.agents:research_agent",
        "model": {"base_url": server.url, "name": "pyd-doc-factory"},
    }
    with runtime(db_path, workers=1, grace=1.0) as rt:
        rec = Recorder(rt)
        _, child, me = family(rt, ADAPTER, root_driver=SCRIPTED, config=config)
        rt.send(child, "find the paper", authority=me)
        ended = rec.turn_ended(child, timeout=60.0)
        assert ended["outcome"] == "completed", ended.get("error")
        assert texts(rt, child, "assistant") == ["Found it, with no key at all."]
    [request] = server.requests_for("pyd-doc-factory")
    assert request.body["messages"][-1]["content"] == "find the paper"


def test_a_factory_that_cannot_be_imported_is_refused_when_the_session_is_opened(
    project: Path, server: ModelServer, db_path: str
) -> None:
    model = {"base_url": server.url, "name": "pyd-never-asked"}
    with runtime(db_path, workers=1, grace=1.0) as rt:
        root = rt.open_session(SCRIPTED)
        for factory, missing in [
            ("myapp.nowhere:research_agent", "myapp.nowhere"),
            ("myapp.agents:no_such_agent", "no_such_agent"),
        ]:
            with pytest.raises(tether.DriverNotFound) as refused:
                rt.spawn(root, ADAPTER, config={"agent": factory, "model": model})
            assert refused.value.code == "driver-not-found"
            assert missing in refused.value.message and "config.agent" in refused.value.message
            with pytest.raises(tether.DriverNotFound):
                rt.open_session(ADAPTER, config={"agent": factory, "model": model})
        assert [s.id for s in rt.list_agents(root, scope="children")] == []
    assert server.requests_for("pyd-never-asked") == []
