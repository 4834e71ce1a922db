"""The store on its own: a real SQLite file, written the way the runtime writes it."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

from tether.actors.budget import _PENDING_MOST, Governor
from tether.actors.outcomes import TurnOutcome
from tether.actors.ports import EndRecord
from tether.runtime.store import _USAGE_EVERY, Store
from tether.wire.budget import Budget

pytestmark = [pytest.mark.timeout(120), pytest.mark.unit]  # unit: starts no process


def test_the_wal_stays_bounded_under_sustained_writes_and_reads(tmp_path: object) -> None:
    """Issue 8, finding 11: the WAL grew to 976 MiB in 40 s and stayed that size until
    close(). Here with a 256 KiB limit: about 40 MiB of writes, a reader paging the
    transcript throughout, and the WAL never more than a few times the limit."""
    path = os.path.join(str(tmp_path), "state.db")
    limit = 256 * 1024
    store = Store(path, wal_limit=limit)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            store.entries("s_a", limit=50)

    reading = threading.Thread(target=reader)
    reading.start()
    biggest = 0
    try:
        text = "x" * 2000
        for _batch in range(200):
            for _ in range(100):
                store.append_entry("s_a", "assistant", text)
            store.flush()
            biggest = max(biggest, os.path.getsize(path + "-wal"))
    finally:
        stop.set()
        reading.join()
    # A commit may land a little past the limit before the next look truncates it.
    assert biggest < 8 * limit, f"the WAL reached {biggest} bytes (limit {limit})"
    assert len(store.entries("s_a")) == 20_000
    store.close()
    assert not os.path.exists(path + "-wal") or os.path.getsize(path + "-wal") <= limit


def _stored_usage(path: str, turn: str) -> dict[str, int] | None:
    """What another process would read: the turn's usage column, committed."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        (blob,) = db.execute("SELECT usage FROM turns WHERE id=?", (turn,)).fetchone()
    return None if blob is None else dict(json.loads(blob))


def _governed(store: Store) -> Governor:
    """The governor, the one home of running turns' usage, wired as the runtime wires
    it: the store takes what changed when it writes."""
    gov = Governor(store=store, act=lambda step: None, subtree=lambda sid: [])
    store.take_usage_from(gov.take_usage)
    return gov


def _running_turn(store: Store, gov: Governor, turn: str) -> None:
    message, ticket = store.append_message("s_a", "go")
    ticket.wait(10)
    store.start_turn(turn, message).wait(10)
    assert gov.start("s_a", (), turn)


def test_a_running_turns_usage_is_held_then_written_within_a_second_with_no_other_write(
    tmp_path: Path,
) -> None:
    """Issue 29: a report costs no write of its own; a host killed mid-turn has the
    turn's usage on disk at most ``_USAGE_EVERY`` after the first report held, even
    when nothing else is written meanwhile (a model call that takes minutes)."""
    path = str(tmp_path / "state.db")
    store = Store(path)
    gov = _governed(store)
    try:
        _running_turn(store, gov, "t_1")
        gov.usage("s_a", "t_1", {"prompt_tokens": 5})
        gov.usage("s_a", "t_1", {"prompt_tokens": 7})
        store.submit(lambda db: db.execute("SELECT 1"), waited=True).wait(10)
        assert _stored_usage(path, "t_1") is None  # held, not in the batch that went by
        deadline = time.monotonic() + 10 * _USAGE_EVERY
        while (got := _stored_usage(path, "t_1")) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == {"prompt_tokens": 12}  # both reports: one write for both
        gov.usage("s_a", "t_1", {"completion_tokens": 3})  # held again after that write
        deadline = time.monotonic() + 10 * _USAGE_EVERY
        while (got := _stored_usage(path, "t_1")) == {"prompt_tokens": 12} and (
            time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert got == {"prompt_tokens": 12, "completion_tokens": 3}
    finally:
        store.close()


def test_near_a_limit_a_report_rides_the_next_batch_and_a_turns_end_writes_its_usage(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "state.db")
    store = Store(path)
    gov = _governed(store)
    try:
        gov.admit("s_a", (), Budget(tokens=10, soft=0.5, on_soft="none"))
        _running_turn(store, gov, "t_1")
        gov.usage("s_a", "t_1", {"prompt_tokens": 7})  # past the soft threshold
        store.submit(lambda db: db.execute("SELECT 1"), waited=True).wait(10)
        assert _stored_usage(path, "t_1") == {"prompt_tokens": 7}
        _running_turn(store, gov, "t_2")
        gov.usage("s_a", "t_2", {"prompt_tokens": 1})
        done = TurnOutcome("completed", None, None, None, False, False, None)
        usage = gov.ended("t_2")
        assert usage == {"prompt_tokens": 1}
        store.end_turn("t_2", EndRecord(done, usage=usage))
        store.flush()
        assert _stored_usage(path, "t_2") == {"prompt_tokens": 1}
        gov.usage("s_a", "t_2", {"prompt_tokens": 99})  # after its end: not its record
        store.flush()
        assert _stored_usage(path, "t_2") == {"prompt_tokens": 1}
    finally:
        store.close()


def test_a_read_or_a_close_writes_the_usage_held_for_running_turns(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store = Store(path)
    gov = _governed(store)
    _running_turn(store, gov, "t_1")
    gov.usage("s_a", "t_1", {"prompt_tokens": 4})
    (record,) = store.turns("s_a")  # a reader sees every report made before it
    assert record.usage == {"prompt_tokens": 4}
    gov.usage("s_a", "t_1", {"prompt_tokens": 5, "completion_tokens": 1})
    store.close()
    assert _stored_usage(path, "t_1") == {"prompt_tokens": 9, "completion_tokens": 1}


def test_a_turn_that_reports_many_times_between_writes_has_every_report_written(
    tmp_path: Path,
) -> None:
    """The governor keeps a turn's reports unadded until they are read, and adds them up
    in place once too many wait: the reports added that way are still the store's to
    take (a flag of their own, not the list of those waiting)."""
    path = str(tmp_path / "state.db")
    store = Store(path)
    gov = _governed(store)
    try:
        _running_turn(store, gov, "t_1")
        for _ in range(_PENDING_MOST):  # the last one adds them all up: none waits
            gov.usage("s_a", "t_1", {"prompt_tokens": 1, "completion_tokens": 2})
        (record,) = store.turns("s_a")
        assert record.usage == {
            "prompt_tokens": _PENDING_MOST,
            "completion_tokens": 2 * _PENDING_MOST,
        }
    finally:
        store.close()


def test_a_turns_record_has_its_ends_usage_and_a_turn_with_no_end_what_it_reported() -> None:
    gov = Governor(store=Store(), act=lambda step: None, subtree=lambda sid: [])
    for turn in ("t_1", "t_2"):
        assert gov.start("s_a", (), turn)
        gov.usage("s_a", turn, {"prompt_tokens": 5})
        gov.usage("s_a", turn, {"prompt_tokens": 6, "cost_microusd": 7})
    assert gov.ended("t_1", {"prompt_tokens": 11, "completion_tokens": 3}) == {
        "prompt_tokens": 11,
        "completion_tokens": 3,
    }
    assert gov.ended("t_2") == {"prompt_tokens": 11, "cost_microusd": 7}  # killed: no end
    assert gov.ended("t_2") is None  # once
    assert gov.status("s_a", ()).spent["tokens"] == 22
    # this store never takes the usage: a long turn's reports are added up as they pile
    assert gov.start("s_a", (), "t_3")
    for _ in range(3 * _PENDING_MOST):
        gov.usage("s_a", "t_3", {"prompt_tokens": 1})
    assert len(gov._runs["t_3"].pending) < _PENDING_MOST  # white-box: the memory bound
    assert gov.ended("t_3") == {"prompt_tokens": 3 * _PENDING_MOST}


def test_a_killed_turns_record_says_estimated_once_whatever_many_reports_estimated() -> None:
    # what two cut replies reported, then a kill: no end, so the record is the reports'
    gov = Governor(store=Store(), act=lambda step: None, subtree=lambda sid: [])
    assert gov.start("s_a", (), "t_1")
    gov.usage("s_a", "t_1", {"prompt_tokens": 5, "estimated": True})
    gov.usage("s_a", "t_1", {"prompt_tokens": 6, "completion_tokens": 2})
    gov.usage("s_a", "t_1", {"prompt_tokens": 7, "estimated": True})
    usage = gov.ended("t_1")
    assert usage == {"prompt_tokens": 18, "completion_tokens": 2, "estimated": True}
    assert usage["estimated"] is True  # a flag, not a count of the reports
    assert gov.status("s_a", ()).spent["tokens"] == 20


def test_reports_racing_the_stores_writes_are_never_lost_nor_seen_out_of_order(
    tmp_path: Path,
) -> None:
    """The store takes running turns' usage from the governor while reports keep coming
    from many threads (``setswitchinterval`` small): a read sees at least every report
    made before it began and never more than was reported; a turn's usage on disk only
    grows; and after the last report the stored usage is each turn's sum."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    path = str(tmp_path / "state.db")
    store = Store(path)
    gov = _governed(store)
    n, reports = 8, 1000
    turns = [f"t_{i}" for i in range(n)]
    done = [0] * n  # reports finished, per turn (written by that turn's thread only)
    try:
        for turn in turns:
            _running_turn(store, gov, turn)
        go = threading.Barrier(n + 1)

        def spend(i: int) -> None:
            go.wait()
            for _ in range(reports):
                gov.usage("s_a", turns[i], {"prompt_tokens": 1})
                done[i] += 1

        threads = [threading.Thread(target=spend, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        go.wait()
        last = dict.fromkeys(turns, 0)
        while any(t.is_alive() for t in threads):
            before = list(done)
            seen = {r.id: (r.usage or {}).get("prompt_tokens", 0) for r in store.turns("s_a")}
            for i, turn in enumerate(turns):
                assert before[i] <= seen[turn] <= reports, (turn, before[i], seen[turn])
                assert seen[turn] >= last[turn]  # never goes back
                last[turn] = seen[turn]
        for t in threads:
            t.join(10)
        store.flush()
        assert all(_stored_usage(path, turn) == {"prompt_tokens": reports} for turn in turns)
    finally:
        sys.setswitchinterval(old)
        store.close()


def test_a_report_made_while_the_store_takes_the_usage_is_written_by_the_next_write(
    tmp_path: Path,
) -> None:
    """The interleaving the racing test rarely meets, made to happen: a report lands
    just after the store took the running turns' usage, while its write is still being
    made. That write does not carry it, so it must be held for the next one (the next
    read's, or ``_USAGE_EVERY`` later), not counted as already queued."""
    path = str(tmp_path / "state.db")
    store = Store(path)
    gov = Governor(store=store, act=lambda step: None, subtree=lambda sid: [])
    late: list[dict[str, int]] = [{"completion_tokens": 2}]

    def take() -> dict[str, dict[str, int]]:
        taken = gov.take_usage()
        if late:
            gov.usage("s_a", "t_1", late.pop())  # between the take and the write's end
        return taken

    store.take_usage_from(take)
    try:
        _running_turn(store, gov, "t_1")
        gov.usage("s_a", "t_1", {"prompt_tokens": 4})
        (record,) = store.turns("s_a")
        assert record.usage == {"prompt_tokens": 4}  # taken before the late report
        assert not late
        (record,) = store.turns("s_a")
        assert record.usage == {"prompt_tokens": 4, "completion_tokens": 2}
    finally:
        store.close()
