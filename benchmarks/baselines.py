"""Floors: the same work done with nothing but the OS, SQLite, msgspec or pykka.

Each Tether figure is divided by its floor from the same run, so a slow machine moves
both and the ratio says how much the runtime itself costs.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import psutil
import pykka

from benchmarks import _procs
from benchmarks._case import Cfg, Samples, ms_since, us_since

# ---------------------------------------------------------------- killpg + reap


def killpg_floor(cfg: Cfg) -> Iterator[Samples]:
    """`killpg(SIGKILL)` on the wedged tree's group, reap the shell, every process dead.

    Same tree as Tether's abort, started by us in its own group; no worker in between,
    which is what makes it the floor.
    """
    while True:
        samples = []
        for _ in range(cfg.n(20, 50)):
            tag = _procs.wedge_tag()
            proc = subprocess.Popen(_procs.wedge_argv(tag), start_new_session=True)
            try:
                tree = _procs.find_tree(tag, timeout=10)
                with _procs.DeathWatch(tree.pids(with_starter=False)) as watch:
                    t0 = time.perf_counter_ns()
                    os.killpg(proc.pid, signal.SIGKILL)
                    watch.wait(timeout=5)
                    # Already dead: this waitpid returns at once (Popen.wait with a timeout
                    # would sleep-poll instead, adding up to 50 ms to a floor).
                    proc.wait()
                    samples.append(ms_since(t0, time.perf_counter_ns()))
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        yield {"kill_ms": samples}


# ---------------------------------------------------------------- msgspec frame round trip


class Ping(msgspec.Struct, tag=True, frozen=True):
    seq: int
    sent_ns: int


class Pong(msgspec.Struct, tag=True, frozen=True):
    seq: int
    sent_ns: int


_HEADER = struct.Struct(">I")


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv(sock: socket.socket) -> bytes | None:
    """One length-prefixed frame, or None at EOF."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        return None
    (size,) = _HEADER.unpack(head)
    return sock.recv(size, socket.MSG_WAITALL)


def echo_main(fd: int) -> None:
    """The far end: decode each Ping with its typed decoder, answer with a Pong."""
    sock = socket.socket(fileno=fd)
    dec, enc = msgspec.msgpack.Decoder(Ping), msgspec.msgpack.Encoder()
    while (frame := _recv(sock)) is not None:
        ping = dec.decode(frame)
        _send(sock, enc.encode(Pong(ping.seq, ping.sent_ns)))


def msgspec_rtt(cfg: Cfg) -> Iterator[Samples]:
    """A typed msgspec frame to another process over a socketpair and back."""
    ours, theirs = socket.socketpair()
    code = f"from benchmarks.baselines import echo_main; echo_main({theirs.fileno()})"
    child = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()])
    theirs.close()
    dec, enc = msgspec.msgpack.Decoder(Pong), msgspec.msgpack.Encoder()
    ours.settimeout(10)  # a deadline on every receive: a dead echo fails the case, not hangs it

    def once(seq: int) -> float:
        t0 = time.perf_counter_ns()
        _send(ours, enc.encode(Ping(seq, t0)))
        frame = _recv(ours)
        t1 = time.perf_counter_ns()
        if frame is None or dec.decode(frame).seq != seq:
            raise RuntimeError("echo process went away")
        return us_since(t0, t1)

    try:
        for i in range(500):  # warm up both interpreters
            once(i)
        while True:
            yield {"rtt_us": [once(i) for i in range(cfg.n(2000, 10000))]}
    finally:
        ours.close()  # EOF ends the echo loop
        child.wait(timeout=10)


# ---------------------------------------------------------------- multiprocessing.Pool


def noop(x: int) -> int:
    return x


def mp_pool(cfg: Cfg) -> Iterator[Samples]:
    """Trivial tasks through a 2-process Pool, one task per message (chunksize=1), as
    Tether dispatches one turn per message; forkserver, as Tether starts its workers.

    Also the parent's own CPU time per task (`time.process_time`: every thread of this
    process, user + sys, no child process), from the `map` call to its return: the floor
    for `host_cpu_us_per_turn`, dispatch and result handling with nothing recorded.
    """
    n = cfg.n(2000, 10000)
    with multiprocessing.get_context("forkserver").Pool(2) as pool:
        pool.map(noop, range(200), chunksize=1)
        while True:
            t0, c0 = time.perf_counter(), time.process_time()
            pool.map(noop, range(n), chunksize=1)
            t1, c1 = time.perf_counter(), time.process_time()
            yield {"tasks_per_s": [n / (t1 - t0)], "parent_cpu_us": [(c1 - c0) / n * 1e6]}


# ---------------------------------------------------------------- SQLite insert + commit


# The journal settings a durable store uses: WAL, and synchronous=NORMAL, which survives a
# process crash (semantics §4 rule 6 asks for no loss on a host crash) without an fsync per
# commit. If Tether's store settles on other pragmas, this floor should follow them.
SQLITE_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL")


def sqlite_commit(cfg: Cfg) -> Iterator[Samples]:
    """One INSERT + COMMIT per message, into 100 inboxes, on a file in a temp dir."""
    n = cfg.n(5000, 20000)
    with tempfile.TemporaryDirectory(prefix="bench-sqlite-") as d:
        db = sqlite3.connect(Path(d) / "floor.db", isolation_level=None)
        try:
            for p in SQLITE_PRAGMAS:
                db.execute(p)
            db.execute(
                "CREATE TABLE inbox (id INTEGER PRIMARY KEY, session TEXT NOT NULL,"
                " content TEXT NOT NULL, data BLOB, created_at REAL NOT NULL)"
            )
            db.execute("CREATE INDEX inbox_session ON inbox (session, id)")
            cfg.note("pragmas: " + ", ".join(p.removeprefix("PRAGMA ") for p in SQLITE_PRAGMAS))
            while True:
                t0 = time.perf_counter()
                for i in range(n):
                    db.execute("BEGIN")
                    db.execute(
                        "INSERT INTO inbox (session, content, data, created_at)"
                        " VALUES (?, ?, ?, ?)",
                        (f"s{i % 100}", "x", None, time.time()),
                    )
                    db.execute("COMMIT")
                yield {"commits_per_s": [n / (time.perf_counter() - t0)]}
        finally:
            db.close()


# ---------------------------------------------------------------- bare pykka actor memory


class Bare(pykka.ThreadingActor):
    # Daemon threads: the case process exits right after its one repetition, and stopping
    # 10,000 actors one by one would add seconds to a --quick run for nothing measured.
    use_daemon_thread = True

    def on_receive(self, message: object) -> object:
        return message


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def pykka_actor_mem(cfg: Cfg) -> Iterator[Samples]:
    """RSS per started bare pykka ThreadingActor, 10,000 of them, and their start rate
    (one fresh process each repetition, like idle_session_kib and spawn_per_s)."""
    n = 10_000
    refs = [Bare.start() for _ in range(10)]  # warm: first-start allocations are not per actor
    before = rss()
    t0 = time.perf_counter()
    refs += [Bare.start() for _ in range(n)]
    starts = n / (time.perf_counter() - t0)
    time.sleep(0.2)  # let each new thread reach its inbox wait
    yield {"actor_kib": [(rss() - before) / n / 1024], "starts_per_s": [starts]}
