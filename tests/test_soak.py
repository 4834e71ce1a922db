"""The short soak (issue 10 item 4): 40 s of chaos against a real host, checked against
its ledger. ``make soak`` runs the same thing for 10 minutes (``benchmarks/soak.py``).

It fails on any violation of the promise, printing each violation with the ledger
entries it involves. ``SOAK_SEED`` picks the seed (default 1).
"""

from __future__ import annotations

import os

import pytest
from benchmarks.soak import run_soak

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
