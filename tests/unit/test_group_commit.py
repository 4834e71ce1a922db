"""The group-commit engine alone (``tether.runtime.group_commit``), on a real SQLite
(``:memory:``, or a temporary file where a second connection must look), with writes
that fail for real: an op that raises, a unique constraint violated, a write into a
read-only connection (``PRAGMA query_only``), whose fault clears when the test says."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tether.runtime import group_commit
from tether.runtime.group_commit import WAL_LIMIT, GroupCommit, Op, Statement, Ticket, configure
from tether.wire.errors import StoreUnavailable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

DEADLINE = 10.0  # seconds any awaited settle may take


class Engine:
    """An engine on its own connection, with a table ``t`` of labels (unique) and a
    ``settled`` log: every ``then`` callback of every ticket made with ``track``."""

    def __init__(self, path: str | None, give_up: float | None) -> None:
        self.db = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None)
        configure(self.db, path, "normal", WAL_LIMIT)
        self.db.executescript(
            "CREATE TABLE t (label TEXT NOT NULL UNIQUE);"
            "CREATE TABLE meta (k TEXT PRIMARY KEY, v INTEGER);"
            "INSERT INTO meta VALUES ('probe', 0);"
        )
        probe = Statement("UPDATE meta SET v = v", ())
        self.engine = GroupCommit(self.db, path, probe=probe, give_up=give_up)
        self.settled: dict[int, list[BaseException | None]] = {}
        self._tracked: list[Ticket] = []  # kept alive, so that no id is reused
        self.closed = False

    def track(self, ticket: Ticket) -> Ticket:
        self._tracked.append(ticket)
        calls = self.settled.setdefault(id(ticket), [])
        ticket.then(calls.append)
        return ticket

    def submit(self, op: Op, **kw: bool) -> Ticket:
        return self.track(self.engine.submit(op, **kw))

    def rows(self) -> list[str]:
        """What is committed (read on the engine's connection, outside any batch)."""
        with self.engine.lock:
            return [r[0] for r in self.db.execute("SELECT label FROM t ORDER BY rowid")]

    def read_only(self, on: bool) -> None:
        with self.engine.lock:
            self.db.execute(f"PRAGMA query_only={int(on)}")

    def settle_all(self, tickets: list[Ticket]) -> None:
        """Wait (with a deadline) until each ticket's callback ran, without committing."""
        deadline = time.monotonic() + DEADLINE
        while not all(self.settled[id(t)] for t in tickets):
            assert time.monotonic() < deadline, "a ticket was never settled"
            time.sleep(0.005)

    def assert_settled_once(self) -> None:
        for calls in self.settled.values():
            assert len(calls) <= 1, f"a ticket was settled {len(calls)} times"


@pytest.fixture
def make() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def factory(path: Path | None = None, give_up: float | None = None) -> Engine:
        e = Engine(None if path is None else str(path), give_up)
        made.append(e)
        return e

    yield factory
    for e in made:
        e.assert_settled_once()
        if not e.closed:
            e.engine.close()


def insert(label: str) -> Statement:
    return Statement("INSERT INTO t (label) VALUES (?)", (label,))


def raising(db: sqlite3.Connection) -> object:
    raise ValueError("a bug in an op")


# ---- order --------------------------------------------------------------------------


def test_writes_commit_in_the_order_they_were_queued_from_many_threads(
    make: Callable[..., Engine],
) -> None:
    """Eight threads queue 200 writes each, waited for, nobody's, or urgent, mixed: the
    table holds them in queue order, and every ticket is committed."""
    e = make()
    queued: list[str] = []
    tickets: list[Ticket] = []

    def writer(k: int) -> None:
        for i in range(200):
            label, mode = f"{k}-{i}", i % 4
            ticket = None if mode == 3 else e.track(Ticket(e.engine))
            with e.engine.queue_lock:
                queued.append(label)
                if ticket is not None:
                    tickets.append(ticket)
                e.engine.submit_locked(insert(label), ticket, waited=mode == 1, urgent=mode == 2)
            if ticket is not None and mode == 1:
                ticket.wait(DEADLINE)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DEADLINE)
    e.engine.flush()
    assert e.rows() == queued
    e.settle_all(tickets)
    assert all(e.settled[id(t)] == [None] for t in tickets)


# ---- a failed batch, and what follows ----------------------------------------------------


def test_a_failed_batch_refuses_its_sends_at_once_and_commits_the_rest_in_order_after_it(
    make: Callable[..., Engine],
) -> None:
    """A write into a read-only connection fails the batch: its send is refused and never
    committed, its other writes wait; a send while down is refused, a flush raises,
    writes queued meanwhile wait behind the batch; once the fault clears the writer's
    retry commits them all, in queue order, and the engine takes work again."""
    e = make()
    e.read_only(True)
    a = e.submit(insert("a"), waited=True)
    send = e.submit(insert("send"), refusable=True, waited=True)
    b = e.submit(insert("b"), waited=True)
    with pytest.raises(StoreUnavailable, match="cannot commit now"):
        e.engine.flush()
    assert e.engine.down
    assert send.done and send.withdrawn and isinstance(send.error, StoreUnavailable)
    assert not a.done and not b.done
    with pytest.raises(StoreUnavailable):
        e.engine.check_writable()
    late_send = e.submit(insert("late send"), refusable=True, waited=True)
    with pytest.raises(StoreUnavailable):
        late_send.wait(DEADLINE)
    c = e.submit(insert("c"))
    with pytest.raises(StoreUnavailable):
        e.engine.flush()
    assert e.rows() == []
    e.read_only(False)
    for t in (a, b, c):
        t.wait(DEADLINE)  # the writer's retry commits them: this thread only waits
    assert e.rows() == ["a", "b", "c"]
    assert not e.engine.down and not e.engine.failed
    e.engine.check_writable()
    e.settle_all([a, b, c, send, late_send])
    assert [e.settled[id(t)] for t in (a, b, c)] == [[None]] * 3
    assert all(isinstance(e.settled[id(t)][0], StoreUnavailable) for t in (send, late_send))


def test_a_fault_that_hit_only_sends_ends_once_the_store_can_commit_again(
    make: Callable[..., Engine],
) -> None:
    """A batch of sends alone fails and leaves nothing to retry: the writer probes, and
    the engine takes work again once a write can commit."""
    e = make()
    e.read_only(True)
    send = e.submit(insert("send"), refusable=True, waited=True)
    with pytest.raises(StoreUnavailable):
        send.wait(DEADLINE)
    assert e.engine.down
    e.read_only(False)
    deadline = time.monotonic() + DEADLINE
    while e.engine.down:
        assert time.monotonic() < deadline, "the engine stayed down"
        time.sleep(0.005)
    e.engine.check_writable()
    e.submit(insert("after"), waited=True).wait(DEADLINE)
    assert e.rows() == ["after"]


# "alone": the bad write is a lone statement, committed without BEGIN/COMMIT (a raising
# op is no statement: alone or not, it runs in a transaction)
_FAULTS = [
    ("an op that raises", False),
    ("a unique constraint violated", False),
    ("a unique constraint violated", True),
    ("a read-only connection", False),
    ("a read-only connection", True),
]


@pytest.mark.parametrize(
    ("fault", "alone"), _FAULTS, ids=[f"{f}{' alone' if a else ''}" for f, a in _FAULTS]
)
def test_a_batch_that_keeps_failing_fails_the_engine_and_refuses_every_ticket_waiting(
    make: Callable[..., Engine], fault: str, alone: bool
) -> None:
    """The batch is rolled back whole and retried; after ``give_up`` every ticket of it,
    and of what was queued behind it, is refused, later waits are refused, and nothing
    behind the failed batch was committed before it."""
    # give_up leaves the test most of a second to queue ``behind`` before the engine fails
    e = make(give_up=0.6)
    e.submit(insert("x"), waited=True).wait(DEADLINE)
    bad: Op
    if fault == "an op that raises":
        bad = raising
    elif fault == "a unique constraint violated":
        bad = insert("x")
    else:
        e.read_only(True)
        bad = insert("y")
    ops: list[Op] = [bad] if alone else [insert("a"), bad, insert("b")]
    batch = [e.submit(op, waited=True) for op in ops]
    with pytest.raises(StoreUnavailable):
        e.engine.flush()
    assert e.engine.down and not e.engine.failed
    assert not any(t.done for t in batch)
    behind = e.submit(insert("behind"))
    e.settle_all([*batch, behind])
    assert e.engine.failed
    for t in (*batch, behind):
        assert isinstance(t.error, StoreUnavailable) and "has failed" in str(t.error)
    with pytest.raises(StoreUnavailable, match="has failed"):
        e.engine.check_writable()
    with pytest.raises(StoreUnavailable, match="has failed"):
        e.submit(insert("late"), waited=True).wait(DEADLINE)
    assert e.rows() == ["x"]


def test_a_ticket_refused_when_the_engine_failed_stays_refused_when_its_write_commits_later(
    make: Callable[..., Engine],
) -> None:
    """Settled once: the writer keeps retrying after the engine failed, and a freed
    store commits what was queued, but a ticket it refused stays refused (its callback
    ran once, with the refusal); what came later commits after it; the engine refuses
    work for good."""
    e = make(give_up=0.3)
    e.read_only(True)
    a = e.submit(insert("a"))
    e.settle_all([a])
    assert e.engine.failed and isinstance(a.error, StoreUnavailable)
    b = e.submit(insert("b"))  # after the failure: nobody refuses it
    e.read_only(False)
    e.settle_all([b])
    assert b.error is None
    assert e.rows() == ["a", "b"]
    assert isinstance(a.error, StoreUnavailable)
    assert len(e.settled[id(a)]) == 1 and isinstance(e.settled[id(a)][0], StoreUnavailable)
    with pytest.raises(StoreUnavailable, match="has failed"):
        e.engine.check_writable()


# ---- then, waited, urgent, close -------------------------------------------------------------


def test_then_runs_once_after_the_commit_on_the_committing_thread(
    make: Callable[..., Engine], tmp_path: Path
) -> None:
    """The callback sees its write committed (another connection reads it), runs on the
    thread that committed it, once; a callback that raises stops neither the committer
    nor the batch's other callbacks; ``then`` on a done ticket runs at once, here."""
    path = tmp_path / "state.db"
    e = make(path)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    seen: list[tuple[BaseException | None, list[str], str]] = []

    def look(error: BaseException | None) -> None:
        rows = [r[0] for r in other.execute("SELECT label FROM t ORDER BY rowid")]
        seen.append((error, rows, threading.current_thread().name))

    def broken(error: BaseException | None) -> None:
        raise RuntimeError("a callback's bug")

    first, second = Ticket(e.engine), Ticket(e.engine)
    first.then(broken)
    first.then(look)
    second.then(look)
    with e.engine.queue_lock:  # both callbacks are in place before anything commits
        e.engine.submit_locked(insert("a"), first)
        e.engine.submit_locked(insert("b"), second)
    e.track(first)
    e.track(second)
    e.settle_all([first, second])
    assert seen == [(None, ["a", "b"], "tether-store")] * 2
    waiter = e.submit(insert("c"), waited=True)
    committer = threading.Thread(target=waiter.wait, args=(DEADLINE,), name="committer")
    waiter.then(look)
    committer.start()
    committer.join(DEADLINE)
    assert seen[-1] == (None, ["a", "b", "c"], "committer")
    waiter.then(look)
    assert seen[-1] == (None, ["a", "b", "c"], threading.current_thread().name)
    assert len(seen) == 4
    other.close()


def test_a_waited_write_wakes_no_writer_and_commits_on_the_thread_that_waits(
    make: Callable[..., Engine],
) -> None:
    e = make()
    where: list[str] = []

    def op(db: sqlite3.Connection) -> object:
        where.append(threading.current_thread().name)
        return db.execute("INSERT INTO t (label) VALUES (?)", (str(len(where)),))

    waited = e.submit(op, waited=True)
    committed = threading.Event()
    waited.then(lambda error: committed.set())
    # Nothing else is queued: a writer thread woken for it would commit it at once.
    assert not committed.wait(0.2), "the writer committed a write its caller waits for"
    waited.wait(DEADLINE)
    assert where == [threading.current_thread().name]
    nobodys = e.submit(op)  # nobody waits: the writer thread commits it
    e.settle_all([nobodys])
    assert where[-1] == "tether-store"


def test_an_urgent_write_is_committed_without_the_writers_linger(
    make: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the linger stretched to two seconds: an urgent write commits well within it,
    a plain one only after it, sharing its commit with a write queued meanwhile."""
    monkeypatch.setattr(group_commit, "_LINGER", 2.0)
    e = make()
    commits: list[str] = []
    e.db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    urgent = e.submit(insert("urgent"), urgent=True)
    done = threading.Event()
    urgent.then(lambda error: done.set())
    assert done.wait(1.0), "an urgent write waited for the linger"
    plain = e.submit(insert("plain"))
    committed = threading.Event()
    plain.then(lambda error: committed.set())
    assert not committed.wait(0.3), "a plain write did not linger"
    rides = e.submit(insert("rides along"))
    e.settle_all([plain, rides])
    assert e.rows() == ["urgent", "plain", "rides along"]
    assert len(commits) == 1  # the lone urgent statement autocommits; the two share one


def _recorder(where: list[str], prefix: str = "") -> Op:
    """An insert (label: ``prefix`` and a count) that records the name of the thread
    that committed it."""

    def op(db: sqlite3.Connection) -> object:
        where.append(threading.current_thread().name)
        return db.execute("INSERT INTO t (label) VALUES (?)", (f"{prefix}{len(where)}",))

    return op


def _on_thread(name: str, fn: Callable[[], None]) -> None:
    t = threading.Thread(target=fn, name=name)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive()


def test_a_thread_that_owns_its_writes_commits_them_itself_and_wakes_no_writer(
    make: Callable[..., Engine],
) -> None:
    """A host's writes: queued with no wake of the writer thread (nothing commits them
    meanwhile), committed by ``commit_own`` on the thread that queued them, in one
    commit, callbacks included; another thread's writes still wake the writer."""
    e = make()
    where: list[str] = []
    commits: list[str] = []
    e.db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    tickets: list[Ticket] = []
    committed = threading.Event()
    ran: list[str] = []

    def queue() -> None:
        e.engine.own_writes()
        tickets.extend(e.submit(_recorder(where)) for _ in range(3))
        tickets[-1].then(lambda error: committed.set())
        tickets[-1].then(lambda error: ran.append(threading.current_thread().name))

    _on_thread("host", queue)
    assert not committed.wait(0.3), "the writer thread committed an owned write"
    assert where == []

    def commit() -> None:
        e.engine.own_writes()  # the same thread, as a host's is: this is its mark
        e.engine.commit_own()

    _on_thread("host", commit)  # a thread of the same name: own_writes is per thread
    assert where == []  # a thread that queued nothing commits nothing
    e.engine.own_writes()
    tickets.append(e.submit(_recorder(where)))
    e.engine.commit_own()
    assert where == [threading.current_thread().name] * 4
    assert ran == [threading.current_thread().name]
    assert len(commits) == 1
    e.settle_all(tickets)
    plain: list[str] = []
    theirs = threading.Thread(target=lambda: tickets.append(e.submit(_recorder(plain, "plain "))))
    theirs.start()
    theirs.join(DEADLINE)
    e.settle_all(tickets)
    assert plain == ["tether-store"]


def test_owned_writes_queued_during_another_commit_are_committed_by_that_committer(
    make: Callable[..., Engine],
) -> None:
    """``commit_own`` while a commit is under way returns at once, and the committer
    takes the handed-over writes before it lets go of the commit lock: no thread is
    woken for them, and none is left uncommitted."""
    e = make()
    inside, release = threading.Event(), threading.Event()
    where: list[str] = []

    def blocking(db: sqlite3.Connection) -> object:
        inside.set()
        assert release.wait(DEADLINE)
        return db.execute("INSERT INTO t (label) VALUES ('first')")

    first = e.submit(blocking, waited=True)
    committer = threading.Thread(target=first.wait, args=(DEADLINE,), name="committer")
    committer.start()
    assert inside.wait(DEADLINE)
    e.engine.own_writes()
    owned = e.submit(_recorder(where))
    e.engine.commit_own()  # the lock is held: it must not block here
    assert where == []
    release.set()
    committer.join(DEADLINE)
    e.settle_all([first, owned])
    assert where == ["committer"]
    assert e.rows() == ["first", "1"]


def test_owned_writes_queued_while_the_store_is_down_are_committed_by_the_writers_retry(
    make: Callable[..., Engine],
) -> None:
    e = make(give_up=60.0)
    e.read_only(True)
    failing = e.submit(insert("kept"))
    deadline = time.monotonic() + DEADLINE
    while not e.engine.down:
        assert time.monotonic() < deadline, "the store never went down"
        time.sleep(0.005)
    e.engine.own_writes()
    where: list[str] = []
    owned = e.submit(_recorder(where))
    e.engine.commit_own()  # down: left to the writer's retry, in order
    assert where == []
    e.read_only(False)
    e.settle_all([failing, owned])
    assert where == ["tether-store"]
    assert e.rows() == ["kept", "1"]


def test_an_owned_commit_never_waits_for_another_connections_lock(
    make: Callable[..., Engine], tmp_path: Path
) -> None:
    """A host must not wait for SQLite: with the database's write lock held by another
    connection, ``commit_own`` returns at once (SQLite's busy wait is 5 s), its writes go
    to the writer thread, which commits them once the lock is let go, and the store
    never counts as down for it."""
    path = tmp_path / "state.db"
    e = make(path)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    e.engine.own_writes()
    owned = e.submit(insert("owned"), urgent=True)
    settled_on: list[str] = []
    owned.then(lambda error: settled_on.append(threading.current_thread().name))
    started = time.monotonic()
    e.engine.commit_own()
    assert time.monotonic() - started < 1.0, "a host's commit waited for the lock"
    assert settled_on == [] and not e.engine.down
    other.execute("COMMIT")
    other.close()
    e.settle_all([owned])
    assert settled_on == ["tether-store"]
    assert e.rows() == ["owned"]
    assert e.settled[id(owned)] == [None]


def test_close_commits_every_accepted_write(make: Callable[..., Engine], tmp_path: Path) -> None:
    """Writes nobody committed yet (waited for, so the writer was never woken, and some
    nobody waits for) are committed by ``close``, in order; nothing is taken after."""
    path = tmp_path / "state.db"
    e = make(path)
    waited = [e.submit(insert(f"w{i}"), waited=True) for i in range(50)]
    with e.engine.queue_lock:
        for i in range(50):
            e.engine.submit_locked(insert(f"n{i}"), None)
    e.engine.close()
    e.closed = True
    assert all(t.done and t.error is None for t in waited)
    other = sqlite3.connect(path)
    rows = [r[0] for r in other.execute("SELECT label FROM t ORDER BY rowid")]
    other.close()
    assert rows == [f"w{i}" for i in range(50)] + [f"n{i}" for i in range(50)]
    with pytest.raises(RuntimeError, match="closed"):
        e.engine.submit(insert("late"))


def test_a_deadline_calls_its_owner_on_the_writer_thread_and_what_it_queues_commits() -> None:
    """``due_locked``/``on_due``: the store holds running turns' usage back and has the
    writer call for it at a time; the call comes once, at that time or after, on the
    writer thread, and the write it queues commits with nobody waiting for it."""
    db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
    configure(db, None, "normal", WAL_LIMIT)
    db.executescript("CREATE TABLE t (label TEXT); CREATE TABLE meta (v INTEGER);")
    calls: list[tuple[float, str]] = []
    engine: GroupCommit

    def due() -> None:
        calls.append((time.monotonic(), threading.current_thread().name))
        engine.submit_locked(Statement("INSERT INTO t VALUES ('held')", ()), None)

    engine = GroupCommit(db, None, probe=Statement("UPDATE meta SET v = v", ()), on_due=due)
    try:
        at = time.monotonic() + 0.2
        with engine.queue_lock:
            engine.due_locked(at)
            engine.due_locked(at + 5.0)  # a later time does not put the call off
        deadline = time.monotonic() + DEADLINE
        while True:
            with engine.lock:
                if db.execute("SELECT label FROM t").fetchall() == [("held",)]:
                    break
            assert time.monotonic() < deadline, "the held write never committed"
            time.sleep(0.005)
        assert len(calls) == 1 and calls[0][0] >= at and calls[0][1] == "tether-store"
    finally:
        engine.close()
