"""The store under real faults (issue 16, items 3, 6 and 7).

- a full disk (``RLIMIT_FSIZE`` on a host in its own process) mid-run, then a restart;
- another process holding SQLite's write lock (``BEGIN IMMEDIATE``);
- a second host on a store a live host holds, and the next host after a SIGKILL.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import tether
from drivers import HANG, TESTS, line_from
from tether import User
from tether.actors._reply import Reply
from tether.actors.host import StatusOp, _Call
from tether.wire.errors import StoreLocked, StoreUnavailable

pytestmark = pytest.mark.timeout(120)

BUSY = 5.0  # the store's SQLite busy timeout: what one commit may wait for a lock

# Holds the store's write lock until told to let go (a line on stdin).
_LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("ROLLBACK")
"""


@contextlib.contextmanager
def write_locked(path: str) -> Iterator[subprocess.Popen[str]]:
    """Another process holds the store's write lock for the length of the block."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LOCKER, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert line_from(proc, 20.0).strip() == "locked"
        yield proc
    finally:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write("\n")
            proc.stdin.close()
        proc.wait(10.0)
        assert proc.stdout is not None
        proc.stdout.close()


@contextlib.contextmanager
def host_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """A host script in its own process; yields it and the JSON line it printed. On
    exit its whole tree is killed (its workers are not our children)."""
    proc = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    tree: list[psutil.Process] = []
    try:
        ready = json.loads(line_from(proc, 60.0))
        tree = psutil.Process(proc.pid).children(recursive=True)
        yield proc, ready
    finally:
        tree += [p for p in _children(proc.pid) if p not in tree]
        if proc.poll() is None:
            proc.kill()
        proc.wait(10.0)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=5.0)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _sigkill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10.0) == -signal.SIGKILL


def _until(check: Any, timeout: float, what: str) -> Any:
    """Poll ``check()`` (a StoreUnavailable counts as not yet) until it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except StoreUnavailable:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.05)


def _db(path: str) -> sqlite3.Connection:
    """A read-only look at the store, from outside any host."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


# ---- item 7: one host per store --------------------------------------------------------


def test_a_second_host_on_a_live_store_is_refused_and_changes_nothing(db_path: str) -> None:
    """Before: the second host marked the live host's running turn crashed and posted a
    notice for it (and both hosts numbered messages from their own counters)."""
    with host_process(str(TESTS / "host_child.py"), db_path) as (proc, ready):
        db = _db(db_path)
        before = db.execute("SELECT id, outcome FROM turns").fetchall()
        boots = db.execute("SELECT value FROM meta WHERE key='boots'").fetchall()
        messages = db.execute("SELECT COUNT(*) FROM messages").fetchone()
        with pytest.raises(StoreLocked) as refused:
            tether.Runtime(db_path, workers=1)
        assert refused.value.code == "store-locked"
        assert db_path in refused.value.message
        assert f"pid {ready['host']}" in refused.value.message
        # Nothing changed: the live host's turn is still open, no boot was counted, no
        # notice or message was written.
        assert db.execute("SELECT id, outcome FROM turns").fetchall() == before
        assert before == [(ready["turn"], None)]
        assert db.execute("SELECT value FROM meta WHERE key='boots'").fetchall() == boots
        assert db.execute("SELECT COUNT(*) FROM messages").fetchone() == messages
        db.close()
        assert proc.poll() is None  # the live host is untouched

        # The holder dies (SIGKILL: no clean-up of any kind); the next host starts at
        # once, on its first try: a dead host's lock never blocks.
        _sigkill(proc)
        with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
            [turn] = rt.turns(ready["root"])
            assert (turn.id, turn.outcome) == (ready["turn"], "crashed")


def test_a_second_runtime_in_the_same_process_is_refused_until_the_first_closes(
    db_path: str,
) -> None:
    with tether.Runtime(db_path, workers=1) as first:
        root = first.open_session("tether:Scripted")
        with pytest.raises(StoreLocked, match=f"pid {os.getpid()}"):
            tether.Runtime(db_path, workers=1)
        first.prompt(root, "still mine")
        first.wait(root, until="idle")
    with tether.Runtime(db_path, workers=1) as second:
        assert [t.outcome for t in second.turns(root)] == ["completed"]


# ---- item 3: a full disk in a host process, then a restart ----------------------------------


@pytest.mark.timeout(180)
def test_a_full_disk_mid_run_loses_no_accepted_message_and_runs_none_twice(
    db_path: str, tmp_path: Path
) -> None:
    """Before: the failed batches (turn claims and ends, entries) were dropped, so
    messages that had run stayed `pending` and ran again after the restart; a send
    during the fault raised a raw sqlite3.OperationalError."""
    runs_log = str(tmp_path / "runs.log")
    child = str(TESTS / "store_fault_child.py")
    with host_process(child, db_path, runs_log) as (proc, report):
        # Every call during the fault: a clear refusal, never a raw sqlite3 error.
        assert report["down"], "the store never went down: the cap was not reached"
        assert report["failed"], "the store never failed for good"
        for phase in ("down", "failed"):
            calls = report[phase]
            assert not [c for c in calls.values() if c.startswith("raw")], calls
            assert calls["send"] == "store-unavailable", calls
            assert calls["spawn"] == "store-unavailable", calls
            assert calls["status"] == "ok", calls  # a live session: no store read
        _sigkill(proc)
        assert proc.stderr is not None
        assert "store.failed" in proc.stderr.read()
    ran_before = _runs(runs_log)
    assert ran_before, "no turn ran before the disk filled up"
    assert max(ran_before.values()) == 1, f"ran twice before the restart: {ran_before}"

    root = report["root"]
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        rt.send(root, "after", authority=User(parent=root))
        rt.wait(root, until=("idle", "parked"), timeout=60.0)
        turns = rt.turns(root)
        inbox = rt.inbox(root)
    runs = _runs(runs_log)
    twice = {m: n for m, n in runs.items() if n > 1}
    assert not twice, f"ran twice: {twice}"
    by_message = collections.Counter(t.message for t in turns)
    assert max(by_message.values()) == 1, "a message was claimed by two turns"
    outcome = {t.message: t.outcome for t in turns}
    for i, mid in enumerate(report["accepted"][:-1]):  # M0..M23 (then "go" and others)
        if mid not in outcome:
            continue
        if i < 24:
            # Ran once, or its claim was durable and the host died before its end.
            assert runs.get(f"M{i}", 0) == 1 or outcome[mid] == "crashed", (i, outcome[mid])
    # Nothing accepted is lost: every accepted message ran (one turn), or still waits.
    waiting = {m.id for m in inbox}
    lost = [m for m in report["accepted"] if m not in outcome and m not in waiting]
    assert not lost, f"accepted and lost: {lost}"
    assert not waiting, f"left pending after the restart's queue ran: {waiting}"


def _runs(path: str) -> collections.Counter[str]:
    if not os.path.exists(path):
        return collections.Counter()
    with open(path) as f:
        return collections.Counter(line.strip() for line in f if line.strip())


# ---- item 3: another process holds the write lock ----------------------------------------


def test_a_held_write_lock_refuses_calls_clearly_and_loses_nothing_queued(
    db_path: str,
) -> None:
    """Before: the batch with the abort's marker and the turn's end was rolled back and
    dropped (the turn stayed open in the store), and the send raised a raw
    sqlite3.OperationalError."""
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        root = rt.open_session("tether:Scripted")
        owner = User(parent=root)
        rt.prompt(root, "A", data=HANG)
        _until(lambda: rt.status(root).dispatched, 10.0, "the turn reached a worker")
        with write_locked(db_path):
            started = time.monotonic()
            turn = rt.interrupt(root, authority=owner, kind="abort", reason="stop")
            assert turn is not None
            assert rt.wait(root, until="parked", timeout=5.0).turn is None
            assert time.monotonic() - started < 2.0  # the stop never waits for SQLite
            # The turn's records are queued, not committed: the store is locked.
            with pytest.raises(StoreUnavailable) as refused:
                rt.prompt(root, "B")
            assert refused.value.code == "store-unavailable"
            for call in (
                lambda: rt.send(root, "B2", authority=owner),
                lambda: rt.spawn(root, "tether:Scripted", prompt="child"),
                lambda: rt.open_session("tether:Scripted"),
                lambda: rt.turns(root),
                lambda: rt.transcript(root),
                lambda: rt.inbox(root),
            ):
                with pytest.raises(StoreUnavailable):
                    call()
            assert rt.status(root).state == "parked"  # a live session needs no read
        # The lock is gone: the retry commits everything queued meanwhile, in order.
        turns = _until(lambda: rt.turns(root), 20.0, "the store recovered")
        assert [(t.id, t.outcome) for t in turns] == [(turn, "aborted")]
        markers = [e.action for e in rt.transcript(root) if e.kind == "marker"]
        assert markers == ["aborted"]
        assert [m.preview for m in rt.inbox(root)] == []  # the refused sends left nothing
        rt.prompt(root, "C")
        rt.wait(root, until="idle", timeout=10.0)
        assert [t.outcome for t in rt.turns(root)] == ["aborted", "completed"]
        user = [e.text for e in rt.transcript(root) if e.kind == "user"]
        assert user == ["A", "C"]
        assert len(rt.list_agents(root)) == 0  # the refused spawn made no child


# ---- item 6: an abort never waits behind the store -----------------------------------------


def test_an_abort_lands_at_once_while_a_dormant_sessions_status_waits_for_the_store(
    db_path: str,
) -> None:
    """Before: the dormant session's status() read the store on its host's thread and
    held it for two busy timeouts; the abort queued behind it waited ~10 s."""
    with tether.Runtime(db_path, workers=2, grace=1.0) as rt:
        running = rt.open_session("tether:Scripted")
        # A turn that writes all the time (a tool call and its entry, over and over), so
        # the store always has writes waiting when the lock is taken.
        rt.prompt(running, "busy", data={"steps": [{"op": "loop", "argv": ["true"]}]})
        host = rt._dispatcher.route(running)
        dormant = running
        while dormant == running or rt._dispatcher.route(dormant) is not host:
            dormant = rt.open_session("tether:Scripted")  # one hosted by the same actor
        rt.prompt(dormant, "one", data={"steps": []})
        rt.wait(dormant, until="idle")
        rt.release(dormant)
        _until(lambda: rt.status(running).dispatched, 10.0, "the turn reached a worker")
        ended = threading.Event()
        outcomes: list[str] = []

        def on_event(event: tether.Event) -> None:
            if event.name == "turn.ended" and event.session == running:
                outcomes.append(event.data["outcome"])
                ended.set()

        unsubscribe = rt.subscribe(on_event)
        with write_locked(db_path):
            _until(lambda: rt._store._commits._queue, 5.0, "a write waits for the lock")
            # status() of the dormant session, put in the host's mailbox first (as
            # rt.status does), answered on a thread of its own.
            reply = Reply()
            host.tell(_Call(StatusOp(dormant), reply))
            answer: list[Any] = []

            def look() -> None:
                try:
                    answer.append(reply.get())
                except tether.TetherError as exc:
                    answer.append(exc)

            looker = threading.Thread(target=look)
            looker.start()
            started = time.monotonic()
            turn = rt.interrupt(running, authority=User(parent=running), kind="abort")
            called = time.monotonic() - started
            assert turn is not None
            assert ended.wait(BUSY * 3), "the abort never took effect"
            took = time.monotonic() - started
            assert outcomes == ["aborted"]
            assert called < 0.5 and took < 1.0, (
                f"the abort waited behind the store: the call took {called:.2f}s, "
                f"the turn ended after {took:.2f}s"
            )
            looker.join(BUSY * 3)
        unsubscribe()
        # The look answered (dormant, or the store's clear refusal), never a raw error.
        [info] = answer
        assert isinstance(info, StoreUnavailable) or info.state == "dormant", info
        turns = _until(lambda: rt.turns(running), 20.0, "the store recovered")
        assert [(t.id, t.outcome) for t in turns] == [(turn, "aborted")]
        assert rt.status(dormant).state == "dormant"


def test_steers_for_a_turn_held_for_its_claim_are_bounded_like_any_waiting_turns(
    db_path: str,
) -> None:
    """A turn whose claim cannot commit (another process holds the write lock) waits
    in the turn table as one waiting for a worker; the steers held for it are bounded
    by the same HELD_BYTES as in the pool (the gate once kept them without a bound: a
    store that stays down would have held them all in memory, and a turn that then
    started carried more than the pool would have accepted)."""
    from tether.runtime.backends._held import HELD_BYTES

    big = "\U0001f600" * 2000  # 8,000 bytes of UTF-8 in a 2,000-character reason
    with tether.Runtime(db_path, workers=1, grace=1.0) as rt:
        root = rt.open_session("tether:Scripted")
        me = User(parent=root)
        steps = {"steps": [{"op": "sleep", "seconds": 2}]}
        first = rt.send(root, "first", authority=me, data=steps)
        # claimed when the first ends; its first boundary delivers the held steers
        rt.send(
            root, "second", authority=me, wake=False, data={"steps": [{"op": "say", "text": "2"}]}
        )
        t1 = _until(lambda: rt.status(root).turn, 30.0, "the first turn")
        with write_locked(db_path):

            def second_held() -> bool:
                info = rt.status(root)  # a live session: no store read
                return info.state == "running" and info.turn != t1 and not info.dispatched

            _until(second_held, 30.0, "the second turn held for its claim")
            accepted = 0
            refused: tether.TetherError | None = None
            for i in range(400):
                try:
                    rt.interrupt(root, authority=me, kind="steer", reason=f"{i:05d}{big}"[:2000])
                except tether.TetherError as exc:
                    refused = exc
                    break
                accepted += 1
            assert refused is not None and refused.code == "invalid-params", refused
            assert 0 < accepted * len(big.encode()) <= HELD_BYTES
        rt.wait(root, until="idle", timeout=60.0)
        turns = rt.turns(root)
        assert [t.outcome for t in turns] == ["completed", "completed"]
        assert turns[0].message == first
        said = [e for e in rt.transcript(root) if e.kind == "assistant" and big[:10] in e.text]
        assert len(said) == accepted  # every accepted steer reached the driver


def test_a_runtime_whose_workers_fail_to_start_gives_back_its_store_and_cgroups(
    db_path: str,
) -> None:
    """A start that fails after the store is open (its workers cannot start) releases
    the store's lock, the cgroup guard and the threads: the next Runtime on the same
    store starts at once. Before, the lock stayed held by the failed object (every later
    Runtime on that path in this process was `store-locked`) and a guard process leaked."""

    def broken(workers: int, host: object) -> Any:
        raise tether.TetherError("worker processes fail to start (see their stderr)")

    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(tether.TetherError, match="fail to start"):
        tether.Runtime(db_path, workers=1, backend=broken)
    leaked = [p for p in psutil.Process().children() if p.pid not in before]
    for p in leaked:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.wait(5.0)  # a guard let go exits after its last pass
    with tether.Runtime(db_path, workers=1) as rt:
        root = rt.open_session("tether:Scripted")
        rt.prompt(root, "works")
        assert rt.wait(root, until="idle", timeout=30.0).state == "idle"
