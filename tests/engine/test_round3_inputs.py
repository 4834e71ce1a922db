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
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from drivers import ROOT, TESTS
from tether import User
from tether.actors._timers import TimerQueue
from tether.runtime.runtime import MAX_CONTENT
from tether.wire.vocab import MAX_SECONDS
from tether_server import wait_until

SRC = ROOT / "src"


def _child_env() -> dict[str, str]:
    path = os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


# ---- item 16: a worker whose host was SIGKILLed leaves quietly ---------------------------


@pytest.mark.timeout(180)
def test_workers_of_a_sigkilled_host_leave_quietly_without_a_traceback(tmp_path: Path) -> None:
    """Each try kills a host whose three workers are writing to it; their stderr (they
    inherit the host's) must hold no traceback, and every worker must be gone."""
    for attempt in range(4):
        db = tmp_path / f"state{attempt}.db"
        proc = subprocess.Popen(
            [sys.executable, str(TESTS / "round3_host_child.py"), str(db)],
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
            # EOF on stderr once every process that inherited it (workers, launcher)
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


# ---- item 2: no duration can stop the timer thread --------------------------------------

NAN, INF = float("nan"), float("inf")
BAD_SECONDS = [INF, -INF, NAN, 1e10, 10**400, 0, -1, True, "5"]
BAD_GRACE = [v for v in BAD_SECONDS if v != 0]  # a grace of 0 is valid: break at delivery


def _thread_cpu(native_id: int) -> float:
    for t in psutil.Process().threads():
        if t.id == native_id:
            return float(t.user_time + t.system_time)
    raise AssertionError("the timer thread is gone")


@pytest.mark.unit
def test_the_timer_thread_survives_any_delay_and_still_fires_the_next_clock() -> None:
    """Defence in depth: whatever reaches the queue, its one thread neither dies nor
    spins, and a short clock set after the bad ones fires on time."""
    queue = TimerQueue()
    try:
        for bad in (NAN, INF, -INF, 1e10, 1e308, 10**400, -5.0):
            queue.after(bad, lambda: None)
        fired = threading.Event()
        queue.after(0.05, fired.set)
        assert fired.wait(5.0), "a clock set after the bad ones never fired"
        thread = queue._thread
        assert thread.is_alive() and thread.native_id is not None
        before = _thread_cpu(thread.native_id)
        time.sleep(0.5)  # measuring CPU over a span: there is no event for "not spinning"
        spent = _thread_cpu(thread.native_id) - before
        assert spent < 0.2, f"the timer thread spent {spent:.2f} s of CPU in 0.5 s"
        again = threading.Event()
        queue.after(0.01, again.set)
        assert again.wait(5.0)
    finally:
        queue.close()


def test_after_refused_bad_durations_another_sessions_grace_force_break_still_fires() -> None:
    with tether.Runtime(workers=2, grace=1.0) as rt:
        root = rt.open_session("tether:Scripted", slug="root")
        me = User(parent=root)
        a = rt.spawn(root, "tether:Scripted", slug="a")
        b = rt.spawn(root, "tether:Scripted", slug="b")
        assert isinstance(a, str) and isinstance(b, str)
        rt.send(a, "hang", authority=me, data={"steps": [{"op": "hang"}]})
        stubborn = {
            "steps": [{"op": "ignore_cancel"}, {"op": "say", "text": "deaf"}, {"op": "hang"}]
        }
        rt.send(b, "hang on", authority=me, data=stubborn)
        rt.wait(a, until="running")
        wait_until(lambda: [e for e in rt.transcript(b) if e.text == "deaf"], what="b deaf")
        for bad in (1e10, INF, NAN, 10**400):
            for field in ("deadline", "grace"):
                duration: dict[str, Any] = {field: bad}  # a keyword named at run time
                with pytest.raises(tether.InvalidParams):
                    rt.interrupt(a, authority=me, kind="cancel", **duration)
        # Nothing of those was applied: `a` still runs, unstopped, with no marker.
        info = rt.status(a)
        assert (info.state, info.stopping) == ("running", None)
        assert [e for e in rt.transcript(a) if e.kind == "marker"] == []
        # And were a bad delay to slip past every check, the clock thread lives on.
        for bad in (INF, NAN, 1e10):
            rt._timers.after(bad, lambda: None)
        turn = rt.interrupt(b, authority=me, kind="cancel", reason="stop", grace=0.3)
        rt.wait(b, until=("parked", "idle"), timeout=15.0)
        record = next(t for t in rt.turns(b) if t.id == turn)
        assert (record.outcome, record.forced) == ("cancelled", True), record
        rt.interrupt(a, authority=me, kind="abort")
        rt.wait(a, until=("parked", "idle"))


# ---- items 2 and 14: every bad Python-API input is InvalidParams, and nothing applies ----


@pytest.fixture(scope="module")
def bed() -> Iterator[tuple[tether.Runtime, str, str]]:
    """A root and a child running a turn that hangs (never stopped by these tests)."""
    with tether.Runtime(workers=1, grace=1.0) as rt:
        root = rt.open_session("tether:Scripted", slug="root")
        kid = rt.spawn(root, "tether:Scripted", slug="kid")
        rt.send(kid, "hang", authority=User(parent=root), data={"steps": [{"op": "hang"}]})
        rt.wait(kid, until="running")
        # and on its worker: a listing taken while the claim is being committed reads
        # dispatched=False, one taken after reads True (a loaded run saw the change)
        wait_until(lambda: rt.status(kid).dispatched, what="the kid's turn on a worker")
        yield rt, root, kid
        rt.interrupt(kid, authority=User(parent=root), kind="cancel")


_Call = Callable[[tether.Runtime, str, str], object]


def _interrupt(**kw: Any) -> _Call:
    return lambda rt, root, kid: rt.interrupt(kid, authority=User(parent=root), **kw)


def _send(data: Any) -> _Call:
    return lambda rt, root, kid: rt.send(kid, "x", authority=User(parent=root), data=data)


def _spawn(**kw: Any) -> _Call:
    return lambda rt, root, kid: rt.spawn(root, "tether:Scripted", **kw)


def _open(**kw: Any) -> _Call:
    return lambda rt, root, kid: rt.open_session("tether:Scripted", **kw)


class _Odd:
    pass


BAD_CALLS: list[tuple[str, _Call]] = [
    *[(f"deadline={v!r}", _interrupt(kind="cancel", deadline=v)) for v in BAD_SECONDS],
    *[(f"grace={v!r}", _interrupt(kind="cancel", grace=v)) for v in BAD_GRACE],
    ("kind=explode", _interrupt(kind="explode")),
    ("kind=None", _interrupt(kind=None)),
    ("reason=5", _interrupt(kind="steer", reason=5)),
    ("reason=surrogate", _interrupt(kind="steer", reason="go \udc80")),
    ("turn=5", _interrupt(kind="cancel", turn=5)),
    ("data={1: 'x'}", _send({1: "x"})),
    ("data nested int key", _send({"a": {"b": [{2: "x"}]}})),
    ("data tuple key", _send({"a": {(1, 2): "x"}})),
    ("data surrogate key", _send({"\udc80": 1})),
    ("data surrogate text", _send({"a": ["\udc80"]})),
    ("data nan", _send({"a": NAN})),
    ("data inf", _send({"a": [INF]})),
    ("data huge int", _send({"a": 10**400})),
    ("data bytes", _send({"a": b"raw"})),
    ("data set", _send({"a": {1, 2}})),
    ("data object", _send({"a": _Odd()})),
    ("data not a dict", _send(["x"])),
    ("spawn data={1: 'x'}", _spawn(prompt="go", data={1: "x"})),
    ("spawn config int key", _spawn(config={1: "x"})),
    ("spawn config nested", _spawn(config={"model": {"opts": {3: True}}})),
    ("spawn config nan", _spawn(config={"t": NAN})),
    ("spawn permissions surrogate key", _spawn(permissions={"\udc80": "allow"})),
    ("spawn permissions int key", _spawn(permissions={1: "allow"})),
    ("spawn permissions maybe", _spawn(permissions={"spawn": "maybe"})),
    ("open config int key", _open(config={1: "x"})),
    ("open permissions surrogate key", _open(permissions={"send\udc80": "deny"})),
    *[(f"stall after={v!r}", _spawn(stall={"after": v})) for v in BAD_SECONDS],
    *[(f"stall every={v!r}", _spawn(stall={"after": 1, "every": v})) for v in BAD_SECONDS],
    ("stall grace=inf", _spawn(stall={"after": 1, "grace": INF})),
    ("stall repeat=True", _spawn(stall={"after": 1, "repeat": True})),
    ("stall steps=[]", _spawn(stall={"after": 1, "steps": []})),
    ("stall unknown key", _spawn(stall={"after": 1, "later": 2})),
    ("open stall after=1e10", _open(stall={"after": 1e10})),
    ("wait timeout=nan", lambda rt, root, kid: rt.wait(kid, timeout=NAN)),
    ("wait timeout=-1", lambda rt, root, kid: rt.wait(kid, timeout=-1)),
]


@pytest.mark.unit
@pytest.mark.parametrize(("what", "call"), BAD_CALLS, ids=[w for w, _ in BAD_CALLS])
def test_bad_python_api_input_is_invalid_params_and_nothing_is_issued_or_recorded(
    bed: tuple[tether.Runtime, str, str], what: str, call: _Call
) -> None:
    rt, root, kid = bed
    agents = rt.list_agents(root, scope="descendants")
    entries = rt.transcript(kid)
    roots = rt._dir.catalog.nodes.keys() - {root, kid}
    with pytest.raises(tether.InvalidParams):
        call(rt, root, kid)
    info = rt.status(kid)
    assert (info.state, info.stopping, info.pending) == ("running", None, 0), what
    assert rt.transcript(kid) == entries, what  # no marker, no entry
    assert rt.list_agents(root, scope="descendants") == agents, what  # nothing spawned
    assert rt._dir.catalog.nodes.keys() - {root, kid} == roots, what  # nothing opened
    assert rt.inbox(kid) == [], what


@pytest.mark.parametrize(
    "kwargs",
    [{"grace": INF}, {"grace": NAN}, {"grace": -1}, {"grace": 10**400}, {"workers": 0}],
    ids=["grace=inf", "grace=nan", "grace=-1", "grace=10**400", "workers=0"],
)
@pytest.mark.unit
def test_a_runtime_with_a_bad_grace_or_worker_count_is_refused_before_it_starts(
    kwargs: dict[str, Any],
) -> None:
    with pytest.raises(tether.InvalidParams):
        tether.Runtime(**kwargs)


@pytest.mark.unit
def test_the_largest_accepted_durations_are_accepted(bed: tuple[tether.Runtime, str, str]) -> None:
    """The bound is MAX_SECONDS (30 days), inclusive: the refusals above are about the
    values, not about deadlines as such."""
    rt, root, _ = bed
    kid = rt.spawn(root, "tether:Scripted", stall={"after": MAX_SECONDS, "every": 0.5})
    stall = rt._dir.catalog.nodes[kid].header.stall
    assert stall is not None and stall.after == MAX_SECONDS
    rt.dispose(kid, authority=User(parent=root))


# ---- item 8: the watchdog's clock starts when a worker takes the turn -------------------


@pytest.mark.timeout(90)
def test_the_watchdog_never_steps_a_turn_that_waits_for_a_worker_and_steps_it_once_it_runs() -> (
    None
):
    stall = {"after": 0.3, "every": 0.3, "steps": ["steer", "cancel", "abort"], "grace": 0.3}
    with tether.Runtime(workers=1, grace=1.0) as rt:
        steps: list[tuple[str, float, str]] = []
        lock = threading.Lock()

        def seen(ev: tether.Event) -> None:
            if ev.name == "watchdog.step":
                with lock:
                    steps.append((ev.session, time.monotonic(), ev.data["kind"]))

        rt.subscribe(seen)
        root = rt.open_session("tether:Scripted", slug="root")
        me = User(parent=root)
        busy = rt.spawn(root, "tether:Scripted", slug="busy")
        waiting = rt.spawn(root, "tether:Scripted", slug="waiting", stall=stall)
        assert isinstance(busy, str) and isinstance(waiting, str)
        rt.send(busy, "hang", authority=me, data={"steps": [{"op": "hang"}]})
        rt.wait(busy, until="running")
        # claimed, then dispatched once its claim is durable (the claim gate)
        deadline = time.monotonic() + 10.0
        while not rt.status(busy).dispatched:
            assert time.monotonic() < deadline, "the busy turn never reached the worker"
            time.sleep(0.01)
        # A model call that never returns: no progress once it runs.
        rt.send(waiting, "stall", authority=me, data={"steps": [{"op": "sleep", "seconds": 60}]})
        info = rt.wait(waiting, until="running")
        assert not info.dispatched
        # Ten times `after` with no free worker: never stepped (a bounded wait for an
        # event that must not come).
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            with lock:
                assert not [s for s in steps if s[0] == waiting], "stepped before it ran"
            assert rt.status(waiting).state == "running"
            time.sleep(0.05)
        assert [e for e in rt.transcript(waiting) if e.kind == "marker"] == []
        # Once a worker takes it and it makes no progress, the ladder runs from there.
        rt.interrupt(busy, authority=me, kind="abort")
        wait_until(lambda: rt.status(waiting).dispatched, what="the turn to be dispatched")
        ran = time.monotonic()
        rt.wait(waiting, until=("parked", "idle"), timeout=30.0)
        with lock:
            ladder = [(at, kind) for sid, at, kind in steps if sid == waiting]
        first = ladder[0][0]
        assert first - ran >= 0.2  # `after` counted from dispatch (less a polling slack)
        turn = rt.turns(waiting)[-1]
        assert turn.outcome in ("cancelled", "aborted") and turn.cause == "system", turn
        assert [kind for _, kind in ladder] == ["steer", "cancel", "abort"], ladder


# ---- item 9: ctx.history pages by size ------------------------------------------------


@pytest.mark.timeout(180)
def test_a_transcript_past_the_frame_cap_never_bricks_turns_that_read_history() -> None:
    """17 messages of a million characters each (each within the content cap) make a
    transcript over 16 MiB; a later small turn that reads the whole history succeeds."""
    with tether.Runtime(workers=1, grace=1.0) as rt:
        root = rt.open_session("round3_host_child:HistorySize", slug="long")
        for i in range(17):
            rt.prompt(root, f"big {i} " + "x" * (MAX_CONTENT - 10))
        rt.wait(root, until="idle", timeout=120.0)
        rt.prompt(root, "how long?")
        rt.wait(root, until=("idle", "parked"), timeout=60.0)
        last = rt.turns(root)[-1]
        assert (last.outcome, last.error) == ("completed", None), last
        said = [e.text for e in rt.transcript(root) if e.kind == "assistant"]
        # 17 big messages, their 17 answers, and this turn's own message
        assert said[-1].startswith("35 entries, "), said[-1]
        chars = int(said[-1].split(", ")[1].split()[0])
        assert chars > 17 * (MAX_CONTENT - 10)
