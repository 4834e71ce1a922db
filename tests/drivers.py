"""Test-only drivers, loaded by worker processes as ``"drivers:Name"``, and test helpers.

pytest puts ``tests/`` on ``sys.path`` before any runtime starts, and the pool hands its
``sys.path`` to every worker, so a worker imports this module by name. Keep the module
light: every worker that loads one of these drivers imports it whole.

The helpers at the bottom run in the test process only (event recorder, deadline waits,
process-tree lookups); they never synchronize by sleeping for a fixed time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import psutil

import tether
from tether.actors.host import _Sink
from tether.actors.ports import TurnOver
from tether.contain.cgroup import Cgroups, CgroupUnavailable, v2_mount
from tether.contain.procs import exiting

# re-exported: tests import them from here
from tether.testing.escapee import escapee as escapee
from tether.testing.escapee import escapee_procs as escapee_procs
from tether.wire.text import who

if TYPE_CHECKING:
    import subprocess

    from tether.runtime.backends.pool import Pool

SCRIPTED = "tether:Scripted"
ASYNC_SCRIPTED = "tether:AsyncScripted"
SCRIPTED_BY_KIND = {"sync": SCRIPTED, "async": ASYNC_SCRIPTED}

# This folder, whichever layer's folder (tests/unit, tests/engine, ...) a test sits in: the
# helper scripts that tests start by path live here, and it goes on a child's PYTHONPATH.
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository: src/, docs/, README.md

# ---- drivers (run in worker processes) ------------------------------------------------


class ToolCaller:
    """A driver that plays a model: it makes the tool calls its message lists.

    ``data["calls"]`` is a list of ``[name, arguments]``; each result is said as JSON, so
    the transcript shows exactly what a model would have been handed back.
    """

    def run(self, ctx: tether.TurnContext) -> None:
        for name, arguments in (ctx.message.data or {}).get("calls", []):
            ctx.say(json.dumps(ctx.call_tool(name, arguments)))


class Flaky:
    """Raises when the message starts with ``boom``; otherwise answers ``fine: <content>``."""

    def run(self, ctx: Any) -> str:
        if ctx.message.content.startswith("boom"):
            ctx.say("about to raise")
            raise RuntimeError(f"driver exploded on {ctx.message.content!r}")
        return f"fine: {ctx.message.content}"


class Exiter:
    """``os._exit(3)`` mid-turn when the message is ``die``; otherwise ``alive: <content>``."""

    def run(self, ctx: Any) -> str:
        if ctx.message.content == "die":
            ctx.say("dying now")
            os._exit(3)
        return f"alive: {ctx.message.content}"


class Garbage:
    """Writes an undecodable (but well-framed) payload, then answers normally.

    ``garbage`` sends the corrupt frame; anything else answers ``clean: <content>``.
    """

    def run(self, ctx: Any) -> str:
        if ctx.message.content == "garbage":
            ctx._worker.channel.send_bytes(b"\x00garbage")
            ctx.say("wrote garbage")
            return "survived garbage"
        return f"clean: {ctx.message.content}"


class Oversized:
    """Writes a length header far over the frame cap, then waits to be killed.

    ``oversize`` sends the bad header; anything else answers ``clean: <content>``.
    """

    def run(self, ctx: Any) -> str:
        if ctx.message.content == "oversize":
            channel = ctx._worker.channel
            with channel._send_lock:
                channel.sock.sendall(struct.pack(">I", 0xFFFFFFF0))
            # The host must treat the stream as broken and kill this worker.
            for _ in range(3000):
                time.sleep(0.01)
            return "the host never reacted to an oversized frame"
        return f"clean: {ctx.message.content}"


class Spawner:
    """Spawns a child through ``ctx.spawn_agent`` (which runs this same driver, as every
    child spawned by a tool does) and reports its id; a message without ``slug`` in its
    data is answered ``ok: <content>``."""

    def run(self, ctx: Any) -> str:
        data = ctx.message.data or {}
        if "slug" not in data:
            return f"ok: {ctx.message.content}"
        child = ctx.spawn_agent(slug=data["slug"], prompt=data.get("prompt", "hello kid"))
        return f"spawned {child}"


class ParallelCommands:
    """Two ``run_command`` calls in flight at once, from two threads (a model's parallel
    tool calls): a quick one that leaves a background child and a ``setsid`` escapee
    behind, and a slow one that prints when done (or the commands named in the
    message's ``data``). Answers with the results as JSON."""

    QUICK: ClassVar[list[str]] = [
        "sh",
        "-c",
        "setsid sleep 30 & sleep 30 & sleep 0.2; echo quick-done",
    ]
    SLOW: ClassVar[list[str]] = ["sh", "-c", "sleep 1.2; echo slow-done"]

    def run(self, ctx: Any) -> str:
        results: dict[str, str] = {}

        def call(name: str, argv: list[str]) -> None:
            try:
                r = ctx.run_command(argv)
                results[name] = f"exit {r.returncode}: {r.stdout.strip()}"
            except Exception as exc:
                results[name] = f"error {exc!r}"

        commands = (ctx.message.data or {}).get("commands")
        if commands is None:
            commands = {"slow": self.SLOW, "quick": self.QUICK}
        threads = [threading.Thread(target=call, args=item) for item in commands.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return json.dumps(results, sort_keys=True)


class HistoryRecorder:
    """Answers with ``ctx.history`` (kind and text of each entry) as JSON."""

    def run(self, ctx: Any) -> str:
        return json.dumps([[e.kind, e.text] for e in ctx.history])


class Escalator:
    """Asks ``ctx.spawn_agent`` for a driver, a config and permissions of its own choosing.

    As a parent (any message but ``go``) it spawns ``drivers:Obedient`` with a planted
    config and ``run_command`` allowed, and reports the child's id (or the refusal). If the
    host instead gives the child this class (the caller's own driver), the child gets
    ``go`` and does what ``Obedient`` does, so either way the child tries the command.
    """

    def run(self, ctx: Any) -> str:
        data = ctx.message.data or {}
        if "notice" in data:
            return "noted"
        if ctx.message.content == "go":
            return _try_command(ctx, "Escalator")
        try:
            # What a hostile worker can send whatever the Python API offers: the raw call.
            child = ctx._host_call(
                "spawn_agent",
                {
                    "slug": data.get("slug", "kid"),
                    "driver": "drivers:Obedient",
                    "prompt": "go",
                    "data": {"path": data["path"]},
                    "config": {"planted": True},
                    "permissions": {"run_command": "allow", "spawn": "allow"},
                },
            )
        except tether.TetherError as exc:
            ctx.record_tool(f"spawn_agent failed: {exc.code}")
            return "spawn refused"
        return f"spawned {child}"


class Obedient:
    """Tries ``run_command`` (``touch data["path"]``) and reports its driver and config."""

    def run(self, ctx: Any) -> str:
        return _try_command(ctx, "Obedient")


class Spender:
    """Reports ``data["tokens"]`` prompt tokens (``ctx.add_usage``, or with ``data["said"]``
    in a reply's frame, ``ctx.say(..., usage=...)``) per step, a boundary before each,
    ``data["every"]`` seconds apart, for ``data["steps"]`` steps (for ever without). A
    steer it is given becomes an assistant entry; a cancel ends the turn."""

    def run(self, ctx: Any) -> str:
        if ctx.message.kind == "notice":
            return "noted"  # a child's turn ended: nothing to spend
        data = ctx.message.data or {}
        limit = data.get("steps")
        n = 0
        while limit is None or n < limit:
            for frame in ctx.checkpoint():
                if isinstance(frame, tether.Cancel):
                    return f"cancelled after {n} steps"
                ctx.say(frame.render())
            usage = {"prompt_tokens": int(data.get("tokens", 100))}
            if data.get("said"):
                ctx.say(f"step {n}", usage=usage)
            else:
                ctx.add_usage(usage)
            n += 1
            time.sleep(float(data.get("every", 0.01)))
        return f"spent {n} steps"


class Approver:
    """A parent agent that decides what its children ask (semantics §17.2): a notice of an
    approval is approved, with the reason ``fine by me``; any other message is ``ok``."""

    def run(self, ctx: Any) -> str:
        asked = (ctx.message.data or {}).get("approval")
        if asked is None:
            return "ok"
        decided = ctx.decide_approval(asked["id"], "approve", reason="fine by me")
        return f"{decided.id} {decided.state}"


def _try_command(ctx: Any, name: str) -> str:
    try:
        ctx.run_command(["touch", (ctx.message.data or {})["path"]])
        ran = "ran"
    except tether.TetherError as exc:
        ran = f"refused {exc.code}"
    return json.dumps({"driver": name, "config": ctx.config, "command": ran})


def _wait_for_cancel(ctx: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not ctx.cancel_requested:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


class GraceRacer:
    """Says its pid, waits for a cancel, takes it at a boundary (the grace clock starts),
    then ends on its own after ``data["linger"]`` seconds: a natural end racing the grace
    timer."""

    def run(self, ctx: Any) -> str:
        ctx.say(f"pid {os.getpid()}")
        if not _wait_for_cancel(ctx):
            return "no cancel came"
        ctx.checkpoint()
        time.sleep(float((ctx.message.data or {})["linger"]))
        return "finished on my own"


class LateBoundary:
    """Says ``ready``, waits for a cancel without a boundary, sleeps ``data["delay"]``,
    says ``data["chatter"]`` lines (so the host is busy when the delivery arrives), then
    reaches one boundary and says when (``boundary <t0> <t1> <seen>``: wall-clock
    times just before and just after the checkpoint that delivered the cancel, and when
    the cancel reached the worker)."""

    def run(self, ctx: Any) -> str:
        ctx.say("ready")
        if not _wait_for_cancel(ctx):
            return "no cancel came"
        seen = time.time()
        data = ctx.message.data or {}
        time.sleep(float(data["delay"]))
        for i in range(int(data.get("chatter", 0))):  # frames the host reads before Delivered
            ctx.say(f"chatter {i}")
        t0 = time.time()
        frames = ctx.checkpoint()
        t1 = time.time()
        kinds = ",".join(type(f).__name__ for f in frames)
        ctx.say(f"boundary {t0!r} {t1!r} {seen!r} {kinds}")
        return "wrapped up"


# ---- helpers (test process only) ------------------------------------------------------

T = TypeVar("T")


def steps(*ops: dict[str, Any]) -> dict[str, Any]:
    """``data`` for a Scripted message."""
    return {"steps": list(ops)}


HANG = steps({"op": "hang"})


def spawn_child(rt: tether.Runtime, parent: str, driver: str = SCRIPTED, **spawn: Any) -> str:
    """A continuable child of ``parent`` running ``driver``: its id."""
    sid = rt.spawn(parent, driver, **spawn)
    assert isinstance(sid, str), "spawn_child is for a continuable child"
    return sid


def family(
    rt: tether.Runtime,
    driver: str = SCRIPTED,
    *,
    root_driver: str | None = None,
    root_slug: str | None = None,
    **spawn: Any,
) -> tuple[str, str, tether.User]:
    """A root (running ``root_driver``, by default ``driver``) and one child of it running
    ``driver`` (spawned with ``spawn``): the root's id, the child's, and the root user's
    authority."""
    root = rt.open_session(root_driver or driver, slug=root_slug)
    return root, spawn_child(rt, root, driver, **spawn), tether.User(parent=root)


def ended_turn(rt: tether.Runtime, sid: str, turn: str) -> tether.TurnRecord:
    """The record of ``sid``'s ``turn`` once it has ended (its outcome set)."""

    def done() -> tether.TurnRecord | None:
        rec = next((t for t in rt.turns(sid) if t.id == turn), None)
        return rec if rec is not None and rec.outcome is not None else None

    return eventually(done, timeout=15.0, what=f"turn {turn} to end")


def final_report(rt: tether.Runtime, turn: str) -> tether.StopReport:
    """The stop report of ``turn`` once it is complete (its turn has ended: ``outcome`` set)."""

    def complete() -> tether.StopReport | None:
        r = rt.stop_report(turn)
        return r if r is not None and r.outcome is not None else None

    return eventually(complete, timeout=15.0, what=f"the complete stop report of {turn}")


def eventually(
    predicate: Callable[[], T | Literal[False] | None],
    *,
    timeout: float = 5.0,
    what: str = "condition",
) -> T:
    """Poll ``predicate`` (OS or store state that has no event) until truthy, with a deadline.
    Its value (``a is not None and b and value`` is typed as ``value``'s type)."""
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


class Recorder:
    """Every runtime event, in order, with a condition to wait on."""

    def __init__(self, rt: tether.Runtime) -> None:
        self.events: list[tether.Event] = []
        self._cond = threading.Condition()
        self.unsubscribe = rt.subscribe(self._on)

    def _on(self, ev: tether.Event) -> None:
        with self._cond:
            self.events.append(ev)
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[tether.Event], bool], *, count: int = 1, timeout: float = 5.0
    ) -> list[tether.Event]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [e for e in self.events if predicate(e)]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out after {timeout:g}s: {len(found)}/{count} matching events"
                    )
                self._cond.wait(left)

    def turn_ended(self, session: str, *, count: int = 1, timeout: float = 5.0) -> dict[str, Any]:
        """The data of the ``count``-th ``turn.ended`` event of ``session``."""
        found = self.wait_for(
            lambda e: e.name == "turn.ended" and e.session == session,
            count=count,
            timeout=timeout,
        )
        return found[count - 1].data

    def markers(self, session: str) -> list[dict[str, Any]]:
        with self._cond:
            return [
                e.data["entry"] for e in self.events if e.name == "marker" and e.session == session
            ]


def entries(rt: tether.Runtime, sid: str, kind: str) -> list[tether.Entry]:
    return [e for e in rt.transcript(sid) if e.kind == kind]


def texts(rt: tether.Runtime, sid: str, kind: str) -> list[str]:
    return [e.text for e in entries(rt, sid, kind)]


def marker_actions(rt: tether.Runtime, sid: str) -> list[str | None]:
    return [e.action for e in entries(rt, sid, "marker")]


def wait_entry(
    rt: tether.Runtime, sid: str, kind: str, text: str, *, timeout: float = 5.0
) -> tether.Entry:
    """Wait until ``sid``'s transcript has an entry of ``kind`` whose text contains ``text``."""

    def find() -> tether.Entry | None:
        return next((e for e in entries(rt, sid, kind) if text in e.text), None)

    return eventually(find, timeout=timeout, what=f"a {kind} entry with {text!r} in {sid}")


def alive(proc: psutil.Process) -> bool:
    """Running and not on its way out: a zombie, a process being reaped (``X``) and one
    already in its exit (a cgroup reads ``populated 0`` at that point) count as dead."""
    try:
        gone = proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    return not gone and not exiting(proc.pid)


def frozen(proc: psutil.Process) -> bool:
    """Stopped in place: SIGSTOPped (the walk's pause), or in a cgroup whose
    ``cgroup.events`` says ``frozen 1`` (a cgroup pause, where tasks still show as
    sleeping)."""
    try:
        if proc.status() == psutil.STATUS_STOPPED:
            return True
        with open(f"/proc/{proc.pid}/cgroup") as f:
            rel = next((ln[3:].strip() for ln in f if ln.startswith("0::")), None)
    except (psutil.NoSuchProcess, OSError):
        return False
    mount = v2_mount()
    if rel is None or mount is None or rel == "/":
        return False
    try:
        with open(os.path.join(mount, rel.lstrip("/"), "cgroup.events")) as f:
            return "frozen 1" in f.read()
    except OSError:
        return False


def all_frozen(procs: list[psutil.Process]) -> bool:
    """Every one frozen: SIGSTOPped (walk) or in a frozen cgroup (cgroup containment)."""
    return all(frozen(p) for p in procs)


def none_frozen(procs: list[psutil.Process]) -> bool:
    return not any(frozen(p) for p in procs)


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` that are running and not zombies."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def line_from(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line ``proc`` prints on its stdout, waited for ``timeout`` seconds at most."""
    box: list[str] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box or not box[0]:
        raise AssertionError(f"the subprocess printed nothing in {timeout:g}s")
    return box[0]


@contextlib.contextmanager
def switching_fast(interval: float = 1e-5) -> Iterator[None]:
    """Threads switch every ``interval`` seconds meanwhile (CPython's default: 5 ms), so
    that racing calls interleave finely."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@contextlib.contextmanager
def sigkilled_host(
    argv: list[str], *, cwd: Path | None = None, timeout: float = 20.0
) -> Iterator[tuple[dict[str, Any], list[psutil.Process]]]:
    """Run a host (``argv``) until it prints its first line (JSON), then SIGKILL it.

    Yields that line, decoded, and a snapshot of the host's process tree taken just
    before the kill. On exit, whatever of that tree still runs is killed: the old host's
    workers are no longer our children, so the leak check would not see them.
    """
    import signal
    import subprocess

    tree: list[psutil.Process] = []
    try:
        with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=cwd) as proc:
            try:
                ready: dict[str, Any] = json.loads(line_from(proc, timeout))
                tree = psutil.Process(proc.pid).children(recursive=True)
                os.kill(proc.pid, signal.SIGKILL)
                assert proc.wait(timeout=5.0) == -signal.SIGKILL
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        yield ready, tree
    finally:
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=5.0)


def worker_with_tool(rt: tether.Runtime, name: str, *, count: int = 1) -> psutil.Process:
    """The worker process that has at least ``count`` live descendants named ``name``."""

    def find() -> psutil.Process | None:
        for pid in rt.worker_pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                w = psutil.Process(pid)
                kids = [p for p in w.children(recursive=True) if alive(p) and _named(p, name)]
                if len(kids) >= count:
                    return w
        return None

    # generous: a loaded machine starts a tool slowly; it passes at once when it is there
    return eventually(find, timeout=30.0, what=f"{count} {name!r} process(es) under a worker")


def tree_of(proc: psutil.Process) -> list[psutil.Process]:
    """``proc`` and all its descendants (a snapshot)."""
    return [proc, *proc.children(recursive=True)]


def _named(p: psutil.Process, name: str) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
        return p.name() == name
    return False


def local_pool(rt: tether.Runtime) -> Pool:
    """The local backend's worker pool, for the tests that look inside it."""
    from tether.runtime.backends.pool import Pool  # the test process only: workers never need it

    pool = rt._pool
    assert isinstance(pool, Pool), pool
    return pool


def host_cgroups(rt: tether.Runtime) -> Cgroups:
    """The host's cgroup group, for the tests of a runtime with cgroup containment."""
    cgroups = rt._cgroups
    assert cgroups is not None, "the runtime has no cgroup containment"
    return cgroups


@contextlib.contextmanager
def runtime(*args: Any, **kwargs: Any) -> Iterator[tether.Runtime]:
    """A runtime outside the fixture (own path or options); always closed."""
    rt = tether.Runtime(*args, **kwargs)
    try:
        yield rt
    finally:
        rt.close()


@contextlib.contextmanager
def turn_reports() -> Iterator[dict[str, TurnOver]]:
    """Each turn's one report from the executor (how its tree was killed, what died), as
    its session's host receives it: the host's sink is wrapped, the reports pass on."""
    seen: dict[str, TurnOver] = {}
    real = _Sink.ended

    def ended(self: _Sink, over: TurnOver) -> None:
        seen[over.turn] = over
        real(self, over)

    _Sink.ended = ended  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        _Sink.ended = real  # type: ignore[method-assign]


def refilled(rt: tether.Runtime, size: int = 3) -> None:
    """Wait until the pool is back to ``size`` processes after a worker was killed.

    Tests that kill a worker call this last, so that the replacement is not still being
    started while the fixture closes the runtime: ``Pool.close()`` does not wait for a
    respawn in flight, which then fails against the stopped launcher (a core race that
    would otherwise surface at random in whichever test closes next).
    """
    eventually(lambda: len(rt.worker_pids) >= size, timeout=10.0, what="the pool to refill")


# ---- fault-handling drivers and helpers (tests/engine/test_faults.py) --------------------


class DeepFrame:
    """``deep``: writes a well-framed Say whose data nests far deeper than any decoder allows.

    The host must treat the worker as faulty (turn ``crashed``, worker replaced); anything
    else answers ``clean: <content>``.
    """

    def run(self, ctx: Any) -> str:
        if ctx.message.content == "deep":
            import msgspec

            from tether.wire.frames import Say

            hole = msgspec.msgpack.encode("HOLE")
            frame = msgspec.msgpack.encode(
                Say(turn=ctx.turn, kind="assistant", text="deep", data={"x": "HOLE"})
            )
            # 200,000 one-element arrays around a nil: small on the wire, deep when decoded
            ctx._worker.channel.send_bytes(frame.replace(hole, b"\x91" * 200_000 + b"\xc0"))
            for _ in range(3000):  # the host must kill us; never answer normally
                time.sleep(0.01)
            return "the host never reacted to a deep frame"
        return f"clean: {ctx.message.content}"


# An escapee: leaves the worker's session and process group, then forks, so that a tree
# walk must go two levels below it. ``argv[1]`` (a token) marks both processes' cmdline.
ESCAPEE = "import os, time\nos.setsid()\nos.fork()\ntime.sleep(300)\n"

# The same, but once both escapee processes exist it SIGKILLs the worker (its parent):
# a worker that dies on its own, leaving an escapee behind.
ESCAPEE_KILLS_WORKER = (
    "import os, signal, time\nworker = os.getppid()\nos.setsid()\n"
    "if os.fork():\n    os.kill(worker, signal.SIGKILL)\ntime.sleep(300)\n"
)


def token_procs(token: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line contains ``token``."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if token in (p.info["cmdline"] or ()) and alive(p):
                out.append(p)
    return out


def ray_idle_worker(p: psutil.Process) -> bool:
    """A worker process a raylet keeps (or starts) for any job: Ray's, not a test's."""
    with contextlib.suppress(psutil.Error):
        cmd = p.cmdline()
        head = cmd[0] if cmd else ""
        return head.startswith("ray::IDLE") or (
            "default_worker.py" in " ".join(cmd) and not head.startswith("ray::")
        )
    return False


def kill_token(token: str) -> None:
    """Clean-up after a failed escapee test: nothing marked ``token`` may outlive it."""
    for p in token_procs(token):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


class Hostile:
    """Writes hostile bytes on its own channel to the host (issue 10: fuzzing the
    worker -> host frame decoder), then ends as ``data["then"]`` says.

    ``data``: ``hex`` (the bytes, hex-encoded: data is stored as JSON), ``how``:

    * ``framed`` — the bytes as one well-framed payload (``send_bytes``);
    * ``raw`` — the bytes straight onto the socket, no length prefix;
    * ``header`` — only a length prefix of ``data["length"]`` (e.g. over the cap);
    * ``truncated`` — a length prefix of ``data["length"]`` and then only the bytes.

    ``then``: ``return`` (answer ``survived``), ``exit`` (``os._exit(0)``: the peer
    dies mid-stream) or ``hang`` (boundaries until stopped). It first says its pid, so
    that a test can tell whether its worker was replaced.
    """

    def run(self, ctx: Any) -> str | None:
        data = ctx.message.data or {}
        ctx.say(f"pid {os.getpid()}")
        channel = ctx._worker.channel
        payload = bytes.fromhex(data.get("hex", ""))
        how = data.get("how", "framed")
        with channel._send_lock:  # whole, between the worker's own frames
            if how == "framed":
                channel.sock.sendall(struct.pack(">I", len(payload)) + payload)
            elif how == "raw":
                channel.sock.sendall(payload)
            elif how == "header":
                channel.sock.sendall(struct.pack(">I", int(data["length"])))
            elif how == "truncated":
                channel.sock.sendall(struct.pack(">I", int(data["length"])) + payload)
        then = data.get("then", "return")
        if then == "exit":
            os._exit(0)
        if then == "hang":
            while True:
                ctx.checkpoint()
                if ctx.cancel_requested:
                    return "stopped"
                time.sleep(0.01)
        return "survived"


# ---- async drivers (tests/agent/test_async_drivers.py, semantics §15.1) -----------------


class AsyncWrapUp:
    """Says ``ready``, awaits a 60 s sleep; a cancel landing there is caught and the turn
    returns ``wrapped up: <reason>`` (its final text)."""

    async def run(self, ctx: Any) -> str:
        import asyncio

        ctx.say("ready")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # wrapping up may await: the cancel was taken
            return f"wrapped up: {ctx.cancel.reason}"
        return "slept a minute"


class AsyncCancelHook:
    """Sets a cancel-arrival hook that records the thread it ran in and releases the
    loop, says ``ready``, then blocks its loop (10 s at most) until the hook has run;
    the cancel is then raised at the next await."""

    async def run(self, ctx: Any) -> str:
        import asyncio

        ran: list[str] = []
        ctx.on_cancel_arrival(lambda: ran.append(threading.current_thread().name))
        ctx.say("ready")
        deadline = time.monotonic() + 10.0
        while not ran and time.monotonic() < deadline:
            time.sleep(0.005)  # the loop is blocked: nothing of the loop's runs
        ctx.say(
            f"hook ran in {ran[0] if ran else 'no thread'}; main is {threading.main_thread().name}"
        )
        await asyncio.sleep(60)
        return "slept a minute"


class AsyncShielded:
    """Says ``shielded`` and holds a shield for ``data["hold"]`` seconds, then says
    ``shield done`` and awaits a long sleep; on the cancel it returns ``after shield``."""

    async def run(self, ctx: Any) -> str:
        import asyncio

        hold = float((ctx.message.data or {})["hold"])
        try:
            with ctx.shield():
                ctx.say("shielded")
                await asyncio.sleep(hold)
                ctx.say("shield done")
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return "after shield"
        return "never cancelled"


class AsyncPreemptable:
    """Awaits a 'tool' of its own (a sleep of ``data["seconds"]``) through
    ``ctx.preemptable`` with policy ``data["preempt"]``; says how it ended and goes on."""

    async def run(self, ctx: Any) -> str:
        import asyncio

        data = ctx.message.data or {}
        seconds = float(data.get("seconds", 60))

        async def tool() -> str:
            await asyncio.sleep(seconds)
            return "tool finished"

        ctx.say("calling")
        try:
            said = await ctx.preemptable("slow", tool(), preempt=data.get("preempt", "cooperative"))
        except tether.Preempted as exc:
            by = who(exc.origin or "user", exc.by)
            said = f"preempted by {by}: {exc.reason} after {exc.elapsed:.1f}s"
        ctx.say(said)
        return "went on"


class AsyncLeftovers:
    """Starts a long-lived child of its own (as a tool server would be), then runs a
    command that leaves a background child behind; answers JSON with both pids and
    whether the long-lived one survived the command, then ends it."""

    async def run(self, ctx: Any) -> str:
        import subprocess

        server = subprocess.Popen(["sleep", "60"])
        try:
            result = await ctx.run_command(["sh", "-c", "sleep 30 & echo $!"])
            survived = server.poll() is None
        finally:
            server.kill()
            server.wait()
        return json.dumps(
            {"left": int(result.stdout.strip()), "server": server.pid, "survived": survived}
        )


class AsyncLoopId:
    """Answers ``<pid> <id of the running event loop>``."""

    async def run(self, ctx: Any) -> str:
        import asyncio

        return f"{os.getpid()} {id(asyncio.get_running_loop())}"


class AsyncCallTool:
    """Calls the host tool ``data["tool"]`` with ``data["args"]`` through
    ``await ctx.call_tool`` while a ticker task runs, and answers JSON with the result and
    whether the ticker ran during the call (the host call did not block the loop)."""

    async def run(self, ctx: Any) -> str:
        import asyncio

        data = ctx.message.data or {}
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        try:
            result = await ctx.call_tool(data["tool"], data.get("args", {}))
        finally:
            task.cancel()
        return json.dumps({"result": result, "ticked": ticks > 1})


class AsyncHistory:
    """Answers JSON: ``ctx.history`` (the blocking property) and ``await
    ctx.load_history()``, each as [kind, text] pairs, and whether they agree."""

    async def run(self, ctx: Any) -> str:
        fetched = [[e.kind, e.text] for e in await ctx.load_history()]
        ctx._history = None  # fetch again, the other way
        blocking = [[e.kind, e.text] for e in ctx.history]
        return json.dumps({"history": fetched, "same": fetched == blocking})


class AsyncSteerPeeker:
    """Says ``watching``, then looks at ``ctx.pending_steers()`` every 20 ms (for up to
    30 s), as an adapter polls for a steer to hand its framework. With ``data["deliver"]``,
    once a steer shows it says ``before``, reports it delivered twice (the second is a
    no-op), says ``after`` and answers JSON with what each report returned and what was
    left pending; without, it keeps looking, and a cancel answers ``peeked: [texts]``."""

    async def run(self, ctx: Any) -> str:
        import asyncio

        deliver = bool((ctx.message.data or {}).get("deliver"))
        ctx.say("watching")
        seen: list[str] = []
        deadline = time.monotonic() + 30.0
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                pending = ctx.pending_steers()
                seen = [s.text for s in pending]
                if pending and deliver:
                    ctx.say("before")
                    first, again = ctx.delivered(pending), ctx.delivered(pending)
                    ctx.say("after")
                    report = {"first": [s.text for s in first], "again": [s.text for s in again]}
                    return json.dumps({**report, "left": [s.text for s in ctx.pending_steers()]})
        except asyncio.CancelledError:
            return "peeked: " + json.dumps(seen)
        return "no steer came"


# ---- issue 19's escapee and cgroup leaves (test_containment, test_ray_containment) ----


def leaf_of(pid: int) -> str:
    """The cgroup v2 directory ``pid`` is in."""
    with open(f"/proc/{pid}/cgroup") as f:
        rel = next(ln[3:].strip() for ln in f if ln.startswith("0::"))
    mount = v2_mount()
    assert mount is not None
    return os.path.join(mount, rel.lstrip("/"))


@functools.cache
def cgroup_probe() -> tuple[str | None, frozenset[str]]:
    """Why cgroup containment is unavailable here (None: it is), and the controllers a
    group gets; found once, by making (and removing) a group."""
    try:
        groups = Cgroups.open(None)
    except CgroupUnavailable as exc:
        return str(exc), frozenset()
    controllers = groups.controllers
    groups.close()
    return None, controllers


class HostCalls:
    """Calls its host's tools with exactly ``data["calls"]`` (``[name, args]`` pairs),
    past the context's typed methods, as a buggy driver would; says each answer as
    ``ok <json>`` or ``<code>: <message>``, and goes on."""

    def run(self, ctx: Any) -> str | None:
        for name, args in (ctx.message.data or {}).get("calls", []):
            try:
                ctx.say(f"ok {json.dumps(ctx._host_call(name, args))}")
            except tether.TetherError as exc:
                ctx.say(f"{exc.code}: {exc.message}")
        return "done"


# Holds the store's write lock until told to let go (a line on stdin).
LOCKER = """
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
        [sys.executable, "-c", LOCKER, path],
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
