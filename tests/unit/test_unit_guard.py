"""``make test-unit`` starts no process: under the ``unit`` mark, every way to start one
raises, so a unit test that would start a process fails instead of passing slowly."""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

pytestmark = pytest.mark.unit


def test_a_unit_test_cannot_start_a_subprocess_fork_or_multiprocessing_process() -> None:
    with pytest.raises(AssertionError, match="may not start a process"):
        subprocess.run(["true"], check=False)
    with pytest.raises(AssertionError, match="may not start a process"):
        os.fork()
    with pytest.raises(AssertionError, match="may not start a process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
