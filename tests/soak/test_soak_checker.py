"""The soak's checks bite: each one, given a history that breaks it, reports it.

No processes here: a hand-written ledger and audit (what ``soak_host``'s ``audit``
returns) go through ``benchmarks.soak.Checker`` directly.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from benchmarks.soak import Checker, Node, ProcessesSeen


def _turn(
    tid: str,
    msg: str,
    start: float,
    end: float | None,
    outcome: str | None,
    cause: str | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    return {
        "id": tid,
        "message": msg,
        "started_at": start,
        "ended_at": end,
        "outcome": outcome,
        "cause": cause,
        "error": error,
        "reason": None,
    }


def _sess(
    turns: list[dict[str, Any]],
    inbox: tuple[str, ...] = (),
    state: str = "idle",
    entries: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "status": {"state": state, "pending": len(inbox)},
        "turns": turns,
        "inbox": [{"id": m, "preview": ""} for m in inbox],
        "entries": entries or [],
    }


def _check(
    ledger: list[dict[str, Any]],
    sessions: dict[str, Any],
    notices: list[dict[str, Any]] | None = None,
    restarts: list[dict[str, float]] | None = None,
) -> set[str]:
    for i, e in enumerate(ledger):
        e.setdefault("seq", i)
        e.setdefault("gen", 1)
    soak = SimpleNamespace(
        _llock=threading.Lock(),
        ledger=ledger,
        restarts=restarts or [],
        grace=1.0,
        nodes={"r": Node("r", None, 0, "r"), "c": Node("c", "r", 1, "c")},
    )
    audit = {"sessions": sessions, "notices": notices or [], "messages": {}}
    return {v.check for v in Checker(soak, audit, True).run()}  # type: ignore[arg-type]


def _send(
    target: str, mid: str, t: float, wake: bool = True, tok: str = "tok-1-end"
) -> dict[str, Any]:
    return {
        "op": "send",
        "target": target,
        "wake": wake,
        "token": tok,
        "result": "accepted",
        "value": mid,
        "t0": t,
        "t1": t + 0.001,
    }


def _abort_of_t1(tok: str) -> dict[str, Any]:
    """An abort of r's turn t1, accepted at 1.1."""
    return {
        "op": "interrupt",
        "kind": "abort",
        "target": "r",
        "result": "accepted",
        "value": "t1",
        "t0": 1.1,
        "t1": 1.101,
        "args": {},
        "token": tok,
    }


@pytest.mark.unit
def test_clean_history_passes() -> None:
    ledger = [_send("r", "m_1", 1.0), _send("r", "m_2", 1.1)]
    sessions = {
        "r": _sess(
            [_turn("t1", "m_1", 1.01, 1.2, "completed"), _turn("t2", "m_2", 1.2, 1.3, "completed")]
        ),
        "c": _sess([]),
    }
    assert _check(ledger, sessions) == set()


@pytest.mark.unit
def test_lost_and_twice_and_fifo() -> None:
    ledger = [_send("r", "m_1", 1.0), _send("r", "m_2", 1.1), _send("r", "m_3", 1.2)]
    sessions = {
        "r": _sess(
            [_turn("t1", "m_2", 1.15, 1.2, "completed"), _turn("t2", "m_2", 1.2, 1.3, "completed")]
        ),
        "c": _sess([]),
    }
    found = _check(ledger, sessions)
    assert {"lost", "claimed-twice", "fifo"} <= found


@pytest.mark.unit
def test_parked_session_woken_without_a_send() -> None:
    stop = _abort_of_t1(tok="tok-9-end")
    ledger = [_send("r", "m_1", 1.0), _send("r", "m_2", 1.05), stop]
    marker = {"kind": "marker", "turn": "t1", "action": "aborted", "text": "", "reason": ""}
    sessions = {
        "r": _sess(
            [_turn("t1", "m_1", 1.01, 1.102, "aborted"), _turn("t2", "m_2", 1.2, 1.3, "completed")],
            entries=[marker],
        ),
        "c": _sess([]),
    }
    assert "parked-woke" in _check(ledger, sessions)


@pytest.mark.unit
def test_stop_bound_outcome_and_refusal() -> None:
    stop = _abort_of_t1(tok="tok-2-end")
    refused = {
        "op": "send",
        "target": "r",
        "wake": True,
        "token": "tok-3-end",
        "result": "refused",
        "code": "subagent-unauthorized",
        "t0": 1.0,
        "t1": 1.0,
    }
    ledger = [_send("r", "m_1", 1.0), stop, refused]
    sessions = {
        "r": _sess(
            [_turn("t1", "m_1", 1.01, 30.0, "completed")],
            entries=[
                {"kind": "user", "text": "tok-3-end", "reason": "", "turn": None, "action": None}
            ],
        ),
        "c": _sess([]),
    }
    assert {"stop-bound", "stop-outcome", "refusal-touched"} <= _check(ledger, sessions)


@pytest.mark.unit
def test_notices_and_recovery() -> None:
    sessions = {
        "r": _sess([]),
        "c": _sess(
            [_turn("t1", "m_1", 1.0, 1.5, "completed"), _turn("t2", "m_2", 2.0, 9.0, "completed")]
        ),
    }
    notices = [
        {"id": "m_5", "session": "r", "state": "pending", "turn": "t2"},
        {"id": "m_6", "session": "r", "state": "pending", "turn": "t2"},
    ]
    found = _check([], sessions, notices, restarts=[{"kill": 3.0, "ready": 8.0}])
    assert {"notice-missing", "notice-twice", "recovery"} <= found


@pytest.mark.unit
def test_wake_latch_and_cold_resume() -> None:
    # a stop accepted, then a waking send while it converges: the queue must resume
    stop = {
        "op": "interrupt",
        "kind": "cancel",
        "target": "r",
        "result": "accepted",
        "value": "t1",
        "t0": 1.1,
        "t1": 1.101,
        "args": {"grace": None, "deadline": 1.0},
        "token": "tok-4-end",
    }
    marker = {"kind": "marker", "turn": "t1", "action": "cancelled", "text": "", "reason": ""}
    ledger = [_send("r", "m_1", 1.0), stop, _send("r", "m_2", 1.2)]
    sessions = {
        "r": _sess(
            [_turn("t1", "m_1", 1.01, 1.5, "cancelled")],
            inbox=("m_2",),
            state="parked",
            entries=[marker],
        ),
        "c": _sess([]),
    }
    assert "wake-lost" in _check(ledger, sessions)
    # a released session that a waking send did not bring back
    release = {"op": "release", "target": "c", "result": "accepted", "t0": 2.0, "t1": 2.01}
    ledger = [release, _send("c", "m_3", 3.0)]
    sessions = {"r": _sess([]), "c": _sess([], inbox=("m_3",), state="dormant")}
    assert "wake-lost" in _check(ledger, sessions)


@pytest.mark.unit
def test_the_hosts_order_decides_a_wake_that_the_callers_clocks_misplace() -> None:
    """Issue 16 item 18: a waking send that returned (t1 = 1.10) just before the host
    handled a crash report (recorded at 1.102) is, in the host's order, after the crash,
    and rightly woke the queue. The clocks alone called it `parked-woke`; the turn's
    `woken_by` (the host's own record) settles it. A turn that names no waking send, or
    one the ledger does not have, is still reported."""
    crashed = _turn("t1", "m_1", 1.01, 1.102, "crashed", cause="system", error="worker died")
    ledger = [_send("r", "m_1", 1.0), _send("r", "m_2", 1.099)]
    woke = _turn("t2", "m_2", 1.103, 1.3, "completed") | {"woken_by": "m_2"}
    sessions = {"r": _sess([crashed, woke]), "c": _sess([])}
    assert "parked-woke" not in _check(ledger, sessions)
    for bad in (None, "m_7"):
        woke = _turn("t2", "m_2", 1.103, 1.3, "completed") | {"woken_by": bad}
        sessions = {"r": _sess([crashed, woke]), "c": _sess([])}
        assert "parked-woke" in _check(ledger, sessions), bad


# ---- the leak check and reused pids ------------------------------------------------------------


@contextlib.contextmanager
def _sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def _reuse(pid: int) -> subprocess.Popen[bytes] | None:
    """A new process with ``pid`` (the kernel hands out ns_last_pid + 1 next; another
    process may take it first, so a few tries), or None."""
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


@pytest.mark.skipif(
    not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK), reason="needs root (ns_last_pid)"
)
def test_a_dead_workers_pid_given_to_another_process_is_no_leak() -> None:
    """A soak beside a test run read a test's process, which had been given the pid of a
    worker the soak saw die long before, as a leaked worker: the check made its
    psutil.Process from the pid at the end. The seen set keeps each process's identity."""
    seen = ProcessesSeen()
    with _sleeper() as worker:
        seen.add([worker.pid])
        assert [p.pid for p in seen.alive()] == [worker.pid]
    assert seen.alive() == []  # it died
    other = _reuse(worker.pid)
    if other is None:
        pytest.skip("could not get the pid reused")
    try:
        assert psutil.Process(worker.pid).is_running()  # what the old check looked at
        assert seen.alive() == []  # not ours
    finally:
        other.kill()
        other.wait()
