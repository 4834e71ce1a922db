"""A real ``tether serve`` for tests: a subprocess on a free loopback port.

It is started with ``--port 0`` and is ready when it prints the address it bound (polled
with a deadline); it is stopped with SIGTERM and must exit on its own, leaving no process
of its tree behind. ``EventReader`` follows ``GET /events`` on a thread.

A server takes seconds to start and stop, so a module whose tests need no fresh one
shares one (``shared_server``): each test uses its own sessions, and after each test
``settle`` aborts what the test left running and checks the server's process tree is back
to the shape it had when it started (no tool left under a worker, the pool's workers and
spare all there). The per-test leak check (``tests/conftest.py``) leaves a shared
server's tree to ``settle``; the whole tree must still be gone when the module stops it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import psutil

__all__ = [
    "SHARED",
    "TETHER",
    "EventReader",
    "LiveServer",
    "await_until",
    "rpc_address",
    "rpc_error",
    "running_server",
    "settle",
    "shared_server",
    "shared_trees",
    "tether_cli",
    "wait_until",
]

TETHER = str(Path(sys.executable).with_name("tether"))
T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None], *, timeout: float = 15.0, what: str = "condition"
) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


async def await_until(
    check: Callable[[], Awaitable[T | None]], what: str, timeout: float = 20.0
) -> T:
    """``wait_until`` for an async ``check`` (an MCP or A2A client's call), in a task."""
    import anyio  # the MCP and A2A clients' own event loop library

    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await anyio.sleep(0.02)


def rpc_address(session: str, parent: str, mode: str = "continuable") -> dict[str, str]:
    """The ``address`` param of the ``subagent.*`` calls."""
    return {"session": session, "parent": parent, "mode": mode}


def rpc_error(answer: dict[str, Any]) -> tuple[int, str]:
    """A refused call's JSON-RPC code and Tether's own code."""
    assert "result" not in answer, answer
    return answer["error"]["code"], answer["error"]["data"]["code"]


def tether_cli(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    """The real ``tether`` command against ``server``, run to its end."""
    return subprocess.run(
        [TETHER, *args, "--url", server.url], capture_output=True, text=True, timeout=30
    )


class LiveServer:
    def __init__(
        self,
        workdir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.workdir = workdir
        self.cwd = cwd  # the directory it is started in (None: the test's)
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.preexec_fn = preexec_fn  # runs in the child before exec (e.g. lower a rlimit)
        self.out_path = workdir / "serve.out"
        self.log_path = workdir / "serve.log"
        self.token: str | None = None
        if "--token" in args:
            self.token = args[args.index("--token") + 1].strip() or None  # blank: none
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return int(urlsplit(self.url).port or 0)

    def start(self) -> LiveServer:
        cmd = [TETHER, "serve", "--port", "0", "--path", str(self.workdir / "state.db")]
        with self.out_path.open("wb") as out, self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--grace", "1", *self.args],
                stdout=out,
                stderr=log,
                env=self.env,
                preexec_fn=self.preexec_fn,
                cwd=self.cwd,
            )

        def bound() -> str | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"tether serve exited early:\n{self.log_text()}")
            found = re.search(r"serving (http://\S+)", self.out_path.read_text())
            return found.group(1) if found else None

        try:
            self.url = wait_until(bound, timeout=30.0, what="tether serve to listen")
        except BaseException:
            self._kill()  # a server that did not come up must not outlive the test
            raise
        if self.token is None:  # none given: the one it made, beside its store
            given = self.env.get("TETHER_TOKEN", "").strip()
            self.token = given or (self.workdir / "token").read_text()
        return self

    def _kill(self) -> None:
        assert self.proc is not None
        with suppress(psutil.NoSuchProcess):
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
            for p in tree:
                with suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(tree, timeout=10.0)
        self.proc.wait(timeout=10.0)

    def stop(self) -> int:
        """SIGTERM, then wait (with a deadline) for a clean exit of the whole tree."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            return self.proc.returncode
        tree = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10.0)
            raise AssertionError(f"no exit on SIGTERM:\n{self.log_text()}") from None
        _, alive = psutil.wait_procs(tree, timeout=5.0)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in alive:
            p.kill()
        assert not alive, f"processes left after tether serve exited: {alive}"
        return code

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    # ---- HTTP ---------------------------------------------------------------------------

    @property
    def auth(self) -> dict[str, str]:
        """The ``Authorization`` header of the server's token."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        *,
        auth: bool = True,
        timeout: float = 30.0,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            if auth and self.token:
                hdrs.setdefault("Authorization", f"Bearer {self.token}")
            conn.request(method, path, body=body, headers=hdrs)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, doc: Any) -> Any:
        """POST a JSON-RPC document; the decoded answer (None for 204)."""
        status, body = self.request("POST", "/rpc", json.dumps(doc).encode())
        assert status in (200, 204), (status, body)
        return json.loads(body) if body else None

    def rpc(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One call; the whole response object."""
        doc = {"jsonrpc": "2.0", "id": 1, "method": method}
        if params is not None:
            doc["params"] = params
        answer: dict[str, Any] = self.post(doc)
        return answer

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """One call that must succeed; its result."""
        answer = self.rpc(method, params)
        assert "error" not in answer, answer
        return answer["result"]

    def wait_state(self, session: str, *states: str, timeout: float = 15.0) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            info: dict[str, Any] = self.call("subagent.status", {"session": session})
            return info if info["state"] in states else None

        return wait_until(reached, timeout=timeout, what=f"{session} to be {states}")


@contextmanager
def running_server(
    workdir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    cwd: Path | None = None,
) -> Iterator[LiveServer]:
    server = LiveServer(workdir, *args, env=env, preexec_fn=preexec_fn, cwd=cwd).start()
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log_text()


# The pids of the shared servers now running: the leak check leaves their trees to settle().
SHARED: set[int] = set()


def _shape(server: LiveServer) -> tuple[frozenset[int], dict[int, int], list[str]]:
    """The server's own children, how many children each has, and anything deeper."""
    assert server.proc is not None
    top = psutil.Process(server.proc.pid)
    own: set[int] = set()
    below: dict[int, int] = {}
    deeper: list[str] = []
    for child in top.children():
        with suppress(psutil.NoSuchProcess):
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            own.add(child.pid)
            below[child.pid] = 0
            for grandchild in child.children():
                if grandchild.status() == psutil.STATUS_ZOMBIE:
                    continue
                below[child.pid] += 1
                deeper += [
                    f"{p.pid}:{' '.join(p.cmdline())[:80]}"
                    for p in grandchild.children(recursive=True)
                    if p.status() != psutil.STATUS_ZOMBIE
                ]
    return frozenset(own), below, deeper


class _Shared:
    """What a shared server looked like idle, and the sessions already settled."""

    def __init__(self, server: LiveServer) -> None:
        self.own, self.below, deeper = _shape(server)
        assert not deeper, deeper
        self.seen = 0  # sessions.seq up to which settle() has looked


_shared: dict[int, _Shared] = {}


@contextmanager
def shared_server(
    workdir: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[LiveServer]:
    """A server for a whole module (see the module docstring); stopped, and its whole tree
    checked gone, when the module ends."""
    before = _children()
    with running_server(workdir, *args, env=env) as server:
        assert server.proc is not None
        pid = server.proc.pid
        _shared[pid] = _Shared(server)
        SHARED.add(pid)
        try:
            yield server
        finally:
            SHARED.discard(pid)
            del _shared[pid]
    # As the per-test leak check would have for a server of its own: nothing the server
    # started outlives it.
    others = shared_trees()  # another module-wide server may still be up
    leaked = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.pid not in others
    ]
    _, alive = psutil.wait_procs(leaked, timeout=5.0)
    left = []
    for p in alive:
        with suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid}:{' '.join(p.cmdline())[:80]}")
                p.kill()
    assert not left, f"processes left after the shared server stopped: {left}"


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def shared_trees() -> set[int]:
    """The processes of the shared servers now running, themselves included."""
    out = set(SHARED)
    for pid in SHARED:
        with suppress(psutil.NoSuchProcess):
            out.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    return out


def settle(server: LiveServer, *, timeout: float = 20.0) -> None:
    """After a test on a shared server: abort every turn it left running or paused, wait
    until none is left, and check the process tree is back to its idle shape (the same
    processes under the server, as many workers, nothing under a worker)."""
    assert server.proc is not None
    idle = _shared[server.proc.pid]
    # The store lists every session the test made (the RPC lists a root's tree only).
    db = sqlite3.connect(f"file:{server.workdir / 'state.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute(
            "SELECT seq, id, parent FROM sessions WHERE seq > ? ORDER BY seq", (idle.seen,)
        ).fetchall()
    finally:
        db.close()
    live = ("running", "paused")
    for _, session, parent in rows:
        info = server.rpc("subagent.status", {"session": session}).get("result")
        if info and info["state"] in live:
            address = {"session": session, "parent": parent or session}
            server.rpc("subagent.interrupt", {"address": address, "kind": "abort"})

    def still_live() -> list[str]:
        found = []
        for _, session, _ in rows:
            info = server.rpc("subagent.status", {"session": session}).get("result")
            if info and (info["state"] in live or info.get("stopping")):
                found.append(f"{session}:{info['state']}")
        return found

    def idle_again() -> bool:
        if still_live():
            return False
        own, below, deeper = _shape(server)
        return own == idle.own and below == idle.below and not deeper

    deadline = time.monotonic() + timeout
    while not idle_again():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the shared server did not settle after the test: live sessions "
                f"{still_live()}, processes {_shape(server)}, idle {idle.own}, {idle.below}"
            )
        time.sleep(0.02)
    if rows:
        idle.seen = rows[-1][0]


class EventReader:
    """Reads ``GET /events`` on a thread; events are dicts with ``id``, ``event``, ``data``."""

    def __init__(
        self,
        server: LiveServer,
        *,
        session: str | None = None,
        last_id: int | None = None,
    ) -> None:
        self.events: list[dict[str, Any]] = []
        self.status = 0
        self._cond = threading.Condition()
        self._done = False
        self._conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        self._conn.connect()
        self._sock: socket.socket = self._conn.sock
        headers = {"Accept": "text/event-stream"}
        if server.token:
            headers["Authorization"] = f"Bearer {server.token}"
        if last_id is not None:
            headers["Last-Event-ID"] = str(last_id)
        path = "/events" + (f"?session={session}" if session else "")
        self._conn.request("GET", path, headers=headers)
        self._response = self._conn.getresponse()
        self.status = self._response.status
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        event: dict[str, Any] = {}
        try:
            for raw in self._response:
                line = raw.decode().rstrip("\r\n")
                if not line:
                    if "data" in event:
                        with self._cond:
                            self.events.append(event)
                            self._cond.notify_all()
                    event = {}
                elif not line.startswith(":"):
                    field, _, value = line.partition(": ")
                    event[field] = int(value) if field == "id" else value
                    if field == "data":
                        event["data"] = json.loads(value)
        except (OSError, http.client.HTTPException):
            pass  # closed by close(), mid-chunk too (IncompleteRead)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def watch(
        self, check: Callable[[list[dict[str, Any]]], T | None], *, timeout: float, what: str
    ) -> T:
        """Re-run ``check`` over all events received so far until it returns a value."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = check(self.events)
                if found is not None:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._done:
                    seen = [(e.get("event"), e["data"].get("session")) for e in self.events]
                    raise AssertionError(f"no {what} on /events; saw {seen}")
                self._cond.wait(remaining)

    def wait_for(
        self, match: Callable[[dict[str, Any]], bool], *, timeout: float = 15.0, what: str = "event"
    ) -> dict[str, Any]:
        """The first event that ``match`` accepts."""
        return self.watch(
            lambda evs: next((e for e in evs if match(e)), None), timeout=timeout, what=what
        )

    def nth(self, name: str, k: int, *, timeout: float = 15.0) -> dict[str, Any]:
        """The ``k``-th (1-based) event named ``name``."""

        def kth(evs: list[dict[str, Any]]) -> dict[str, Any] | None:
            named = [e for e in evs if e.get("event") == name]
            return named[k - 1] if len(named) >= k else None

        return self.watch(kth, timeout=timeout, what=f"{name} #{k}")

    def close(self) -> None:
        with suppress(OSError):  # already closed by the server
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)
        self._response.close()
        self._conn.close()

    def __enter__(self) -> EventReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
