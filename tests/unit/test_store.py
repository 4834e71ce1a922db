"""The store on its own: a real SQLite file, written the way the runtime writes it."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from tether.actors.outcomes import TurnOutcome
from tether.actors.ports import EndRecord
from tether.runtime.store import _USAGE_EVERY, Store

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


def _running_turn(store: Store, turn: str) -> None:
    message, ticket = store.append_message("s_a", "go")
    ticket.wait(10)
    store.start_turn(turn, message).wait(10)


def test_a_running_turns_usage_is_held_then_written_within_a_second_with_no_other_write(
    tmp_path: Path,
) -> None:
    """Issue 29: a report costs no write of its own; a host killed mid-turn has the
    turn's usage on disk at most ``_USAGE_EVERY`` after the first report held, even
    when nothing else is written meanwhile (a model call that takes minutes)."""
    path = str(tmp_path / "state.db")
    store = Store(path)
    try:
        _running_turn(store, "t_1")
        store.turn_usage("t_1", {"prompt_tokens": 5})
        store.turn_usage("t_1", {"prompt_tokens": 12})
        store.submit(lambda db: db.execute("SELECT 1"), waited=True).wait(10)
        assert _stored_usage(path, "t_1") is None  # held, not in the batch that went by
        deadline = time.monotonic() + 10 * _USAGE_EVERY
        while (got := _stored_usage(path, "t_1")) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got == {"prompt_tokens": 12}  # the last report: one write for both
    finally:
        store.close()


def test_near_a_limit_a_report_rides_the_next_batch_and_a_turns_end_writes_its_usage(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "state.db")
    store = Store(path)
    try:
        _running_turn(store, "t_1")
        store.turn_usage("t_1", {"prompt_tokens": 7}, soon=True)
        store.submit(lambda db: db.execute("SELECT 1"), waited=True).wait(10)
        assert _stored_usage(path, "t_1") == {"prompt_tokens": 7}
        _running_turn(store, "t_2")
        store.turn_usage("t_2", {"prompt_tokens": 3})
        done = TurnOutcome("completed", None, None, None, False, False, None)
        store.end_turn("t_2", EndRecord(done, usage={"prompt_tokens": 3}))
        store.flush()
        assert _stored_usage(path, "t_2") == {"prompt_tokens": 3}
        store.turn_usage("t_2", {"prompt_tokens": 99})  # after its end: not its record
        store.flush()
        assert _stored_usage(path, "t_2") == {"prompt_tokens": 3}
    finally:
        store.close()


def test_a_read_or_a_close_writes_the_usage_held_for_running_turns(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store = Store(path)
    _running_turn(store, "t_1")
    store.turn_usage("t_1", {"prompt_tokens": 4})
    (record,) = store.turns("s_a")  # a reader sees every report made before it
    assert record.usage == {"prompt_tokens": 4}
    store.turn_usage("t_1", {"prompt_tokens": 9, "completion_tokens": 1})
    store.close()
    assert _stored_usage(path, "t_1") == {"prompt_tokens": 9, "completion_tokens": 1}
