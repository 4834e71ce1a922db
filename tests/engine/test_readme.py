"""Issue 26, item 12: every Python block of README.md (and of the reference pages its
sections moved to) runs as written.

Each ```python block is run alone, as a script, in a fresh temporary directory, with a
deadline; it must exit 0 and leave no process behind. A block that is not meant to run
alone (a fragment, or one that needs a key, a cluster or a server of your own) is marked
in the README by the comment ``<!-- not-a-script: why -->`` on the line just before it:
those are skipped here, each with its reason, so the list stays visible.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from drivers import ROOT

README = ROOT / "README.md"
# The reference pages the README's sections moved to: their blocks run as the README's do.
PAGES = [
    README,
    *(ROOT / "docs" / n for n in ("tools.md", "scaling.md", "protocols.md", "model-server.md")),
]
_MARK = re.compile(r"<!--\s*not-a-script:\s*(.*?)\s*-->")
_DEADLINE = 120.0  # seconds for one block: the slowest waits out a grace or two


@dataclass(frozen=True)
class Block:
    line: int  # where its fence opens, 1-based
    code: str
    skip: str | None  # why it is not run, from its marker


def python_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            mark = _MARK.fullmatch(lines[start - 1].strip()) if start else None
            code = "\n".join(lines[start + 1 : j]) + "\n"
            blocks.append(Block(start + 1, code, mark.group(1) if mark else None))
            i = j
        i += 1
    return blocks


BLOCKS = [
    (page, block) for page in PAGES for block in python_blocks(page.read_text(encoding="utf-8"))
]


def _tagged(tag: str) -> list[psutil.Process]:
    """The processes whose environment carries ``tag``: what one block's run started."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("TETHER_README_RUN") == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def test_every_not_a_script_mark_sits_on_a_python_block() -> None:
    """A mark left behind when its block moved would hide nothing, or the wrong block."""
    marks = sum(len(_MARK.findall(page.read_text(encoding="utf-8"))) for page in PAGES)
    assert marks == sum(b.skip is not None for _, b in BLOCKS)
    assert sum(b.skip is None for _, b in BLOCKS) >= 5  # most of the API's blocks run


@pytest.mark.timeout(_DEADLINE + 30)
@pytest.mark.parametrize(
    ("page", "block"), BLOCKS, ids=[f"{p.relative_to(ROOT)}:{b.line}" for p, b in BLOCKS]
)
def test_a_readme_python_block_runs_as_written(page: Path, block: Block, tmp_path: Path) -> None:
    if block.skip is not None:
        pytest.skip(f"not a script: {block.skip}")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    tag = uuid.uuid4().hex
    env = {**os.environ, "TETHER_README_RUN": tag}
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=_DEADLINE,
        )
    finally:
        left = _tagged(tag)
        _, alive = psutil.wait_procs(left, timeout=5.0)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
    where = f"{page.relative_to(ROOT)}:{block.line}"
    assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stderr}"
    names = [f"{p.pid}:{' '.join(p.cmdline())[-60:]}" for p in alive]
    assert names == [], f"{where} left processes running: {names}"
