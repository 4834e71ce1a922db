"""The short soak (issue 10 item 4): 40 s of chaos against a real host, checked against
its ledger. ``make soak`` runs the same thing for 10 minutes (``benchmarks/soak.py``).

It fails on any violation of the promise, printing each violation with the ledger
entries it involves. ``SOAK_SEED`` picks the seed (default 1).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from benchmarks.soak import HostProc, run_soak

SECONDS = float(os.environ.get("SOAK_SECONDS", "40"))


@pytest.mark.timeout(240)
def test_soak_short() -> None:
    seed = int(os.environ.get("SOAK_SEED", "1"))
    res = run_soak(SECONDS, seed, host_kills=1)
    f = res.figures
    assert not res.violations, f"seed {seed}: {len(res.violations)} violations\n" + res.explain()
    # the run did what it says: it stopped turns, killed workers and the host
    assert f["host_kills"] == 1
    assert f["worker_kills"] >= 1
    assert f["stops"].get("abort", {}).get("n", 0) > 0
    assert f["stops"].get("cancel", {}).get("n", 0) > 0


@pytest.mark.timeout(60)
def test_the_drains_wait_waits_for_the_session_to_stop_running(tmp_path: Path) -> None:
    # The drain at the end of a soak aborts what runs, then waits for it: a wait that
    # returned at once (its timeout taken as the call's own) made a slow abort a violation.
    host = HostProc(str(tmp_path / "soak.db"), 1, 1.0, 1, tmp_path / "host.log")
    try:
        root = host.call("open", slug="w").ok
        host.call("prompt", target=root, content="hang", data={"steps": [{"op": "hang"}]})
        start = time.monotonic()
        r = host.call("wait", target=root, seconds=1.0)
        assert r.err == "python:TimeoutError", r
        assert time.monotonic() - start >= 1.0
    finally:
        host.close()
