"""The store on its own: a real SQLite file, written the way the runtime writes it."""

from __future__ import annotations

import os
import threading

import pytest

from tether.runtime.store import Store

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
