"""`make soak`: a chaos run against a real Tether host, checked against a ledger.

    python -m benchmarks.soak --minutes 10 --seed 1 [--json benchmarks/results/soak.json]

The host is a separate process (``benchmarks.soak_host``) driven over a pipe, so that it
can be SIGKILLed and started again on the same store; the ledger lives here. A forest of
sessions (roots, children, grandchildren; the Scripted driver) takes seeded random
operations from several threads: sends (waking or not) from User and Ancestor
authorities, interrupts of every kind from right and wrong authorities, ``turn=``
guards, pause/resume, release and cold resume, dispose, worker SIGKILLs and host
SIGKILLs. Every accepted send, stop, refusal, release, disposal and kill is appended to
the ledger with the host's clock before (``t0``) and after (``t1``) the call.

After each host restart and at the end the checks run over the host's durable records
(``Runtime.turns``, ``inbox``, ``transcript``, ``status``): no accepted message lost or
claimed twice, FIFO per inbox, every stop converged within its bound, refusals touched
nothing, a held (stopped, released, recovered) session starts no turn without a waking
send, the wake latch, recovery records, one ChildTurnEnded notice per child turn end,
and no process left (every tool command carries a unique tag, looked for system-wide).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

__all__ = ["SoakResult", "run_soak"]

ROOT = Path(__file__).resolve().parent.parent
ABORT_BOUND = 5.0  # s: an accepted abort has ended its turn within this
CANCEL_SLACK = 5.0  # s: beyond deadline + grace for a cancel
KILL_SWEEP_BOUND = 10.0  # s: after a host SIGKILL, its workers and tools are gone within this
CALL_TIMEOUT = 30.0  # s: any one call to the host (a wedge otherwise)
TOKEN = re.compile(r"tok-(\d+)-end")
WAKING_HOLD_OUTCOMES = ("cancelled", "aborted", "failed", "crashed")
RECOVERED_ERROR = "the host stopped while the turn ran"


class HostGone(Exception):
    """The host process died (we killed it) before answering."""


class HostTimeout(Exception):
    """The host did not answer within the call's deadline."""


@dataclass
class Reply:
    ok: Any = None
    err: str | None = None
    msg: str = ""
    t0: float = 0.0
    t1: float = 0.0


class HostProc:
    """One ``soak_host`` process: JSON lines over its stdin/stdout."""

    def __init__(
        self, db: str, gen: int, grace: float, workers: int, log: Path, backend: str = "local"
    ) -> None:
        self.gen = gen
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, list[Any]] = {}
        self._dead = False
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.soak_host",
                db,
                "--grace",
                str(grace),
                "--workers",
                str(workers),
                "--backend",
                backend,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        ready: list[Any] = [threading.Event(), None]
        self._waiting[-1] = ready
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"host{gen}-rd")
        self._reader.start()
        if not ready[0].wait(60.0) or ready[1] is None:
            self.kill()
            raise RuntimeError(f"host generation {gen} did not start within 60 s")
        self.pid = int(ready[1]["ready"])
        self.ready_at = time.time()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            key = -1 if "ready" in msg else int(msg["id"])
            with self._lock:
                slot = self._waiting.pop(key, None)
            if slot is not None:
                slot[1] = msg
                slot[0].set()
        with self._lock:
            self._dead = True
            slots = list(self._waiting.values())
            self._waiting.clear()
        for slot in slots:
            slot[0].set()

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **args: Any) -> Reply:
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            if self._dead:
                raise HostGone(op)
            self._next += 1
            rid = self._next
            self._waiting[rid] = slot
            data = (json.dumps({"id": rid, "op": op, "args": args}) + "\n").encode()
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._waiting.pop(rid, None)
                raise HostGone(op) from None
        if not slot[0].wait(timeout):
            with self._lock:
                self._waiting.pop(rid, None)
            raise HostTimeout(f"{op} {args} took more than {timeout} s")
        msg = slot[1]
        if msg is None:
            raise HostGone(op)
        return Reply(msg.get("ok"), msg.get("err"), msg.get("msg", ""), msg["t0"], msg["t1"])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30.0)
        self._gone()
        self._reader.join(10.0)
        self._close_pipes()

    def _gone(self) -> None:
        """The host is dead: fail whatever waits for it. Its stdout may stay open in a
        process that inherited it (a leaked worker), so EOF cannot be relied on."""
        with self._lock:
            self._dead = True
            slots = list(self._waiting.values())
            self._waiting.clear()
        for slot in slots:
            slot[0].set()

    def close(self) -> None:
        """Ask the host to close its runtime (drain) and exit; kill it after a deadline."""
        with contextlib.suppress(HostGone, HostTimeout):
            self.call("close", timeout=60.0)
        try:
            self.proc.wait(30.0)
        except subprocess.TimeoutExpired:
            self.kill()
        self._gone()
        self._reader.join(10.0)
        self._close_pipes()

    def _close_pipes(self) -> None:
        # stdout only once the reader is done with it: closing a buffered file that
        # another thread is blocked reading waits for that read (forever, if a leaked
        # process holds the pipe's write end)
        pipes = [self.proc.stdin] + ([] if self._reader.is_alive() else [self.proc.stdout])
        for f in pipes:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._log.close()


@dataclass
class Node:
    id: str
    parent: str | None
    depth: int
    slug: str
    settled: bool = False


@dataclass
class Violation:
    check: str
    detail: str
    seqs: list[int] = field(default_factory=list)


@dataclass
class SoakResult:
    seed: int
    seconds: float
    figures: dict[str, Any]
    violations: list[Violation]
    ledger: list[dict[str, Any]]

    def explain(self) -> str:
        """The violations, each with the ledger entries it involves."""
        by_seq = {e["seq"]: e for e in self.ledger}
        lines = []
        for v in self.violations:
            lines.append(f"[{v.check}] {v.detail}")
            for s in v.seqs[:12]:
                lines.append(f"    ledger #{s}: {json.dumps(by_seq.get(s), default=str)}")
        return "\n".join(lines)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


class ProcessesSeen:
    """Processes the soak saw (the host's workers), each kept with its identity (pid and
    start time), so that a pid the kernel has since given to another process (a machine
    that runs anything else beside the soak) is never taken for one of ours."""

    def __init__(self) -> None:
        self._procs: dict[tuple[int, float], psutil.Process] = {}

    def add(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                p = psutil.Process(pid)  # the start time is read now: the identity
                self._procs.setdefault((pid, p.create_time()), p)

    def alive(self) -> list[psutil.Process]:
        """Those still running (``is_running`` compares the start time too)."""
        out = []
        for p in self._procs.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out


class Soak:
    sweeps: list[float]  # each host kill's sweep, in seconds (set by run)
    last_audit: dict[str, Any]  # the last audit the checker passed (set by run)

    def __init__(
        self,
        seconds: float,
        seed: int,
        *,
        workers: int = 3,
        grace: float = 1.0,
        threads: int = 3,
        host_kills: int | None = None,
        workdir: str | None = None,
        backend: str = "local",
    ) -> None:
        self.seconds = seconds
        self.seed = seed
        self.workers = workers
        self.backend = backend
        self.grace = grace
        self.threads = threads
        self.rng = random.Random(seed)
        self.run_id = os.urandom(4).hex()
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="tether-soak-")
        self.dir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db = str(self.dir / "soak.db")
        self.log = self.dir / "host.log"
        # about one host kill a minute (at least one)
        self.host_kills = host_kills if host_kills is not None else max(1, int(seconds // 60))
        self.ledger: list[dict[str, Any]] = []
        self._llock = threading.Lock()
        self.nodes: dict[str, Node] = {}
        self._nlock = threading.Lock()
        self.host: HostProc | None = None
        self.gen = 0
        self.gate = threading.Event()
        self.stop = threading.Event()
        self.restarts: list[dict[str, float]] = []  # {"kill": t, "ready": t}
        self.old_refs: list[list[Any]] = []  # refs from earlier host generations: stale
        self.violations: dict[tuple[str, str], Violation] = {}
        self.tag_n = 0
        self.tok_n = 0
        self.workers_seen = ProcessesSeen()
        self.convergence: dict[str, list[float]] = {}  # set by each audit's checks
        self.cut_by_kill = 0

    # ---- ledger ------------------------------------------------------------------------

    def record(self, **entry: Any) -> dict[str, Any]:
        with self._llock:
            entry["seq"] = len(self.ledger)
            entry["gen"] = self.gen
            self.ledger.append(entry)
        return entry

    def token(self) -> tuple[int, str]:
        """A unique token for one operation's content or reason (found later by regex)."""
        with self._llock:
            self.tok_n += 1
            n = self.tok_n
        return n, f"tok-{n}-end"

    def violate(self, check: str, detail: str, seqs: list[int] | None = None) -> None:
        key = (check, detail)
        if key not in self.violations:
            self.violations[key] = Violation(check, detail, seqs or [])

    # ---- calls -------------------------------------------------------------------------

    def call(self, op: str, *, timeout: float = CALL_TIMEOUT, **args: Any) -> Reply | None:
        """One call to the current host; None if the host died meanwhile (indeterminate)."""
        host = self.host
        assert host is not None
        try:
            return host.call(op, timeout=timeout, **args)
        except HostGone:
            return None
        except HostTimeout as exc:
            self.violate("wedge", str(exc))
            return None

    def act(
        self,
        op: str,
        kind: str,
        args: dict[str, Any],
        meta: dict[str, Any],
        timeout: float = CALL_TIMEOUT,
    ) -> dict[str, Any]:
        """A ledgered operation: its outcome is accepted, refused (code) or indeterminate."""
        r = self.call(op, timeout=timeout, **args)
        if r is None:
            return self.record(
                op=kind, args=args, **meta, result="indeterminate", t0=time.time(), t1=time.time()
            )
        if r.err is not None:
            if r.err.startswith("python:"):
                self.violate("host-error", f"{op}: {r.err}: {r.msg}")
            return self.record(
                op=kind,
                args=args,
                **meta,
                result="refused",
                code=r.err,
                msg=r.msg[:200],
                t0=r.t0,
                t1=r.t1,
            )
        return self.record(
            op=kind, args=args, **meta, result="accepted", value=r.ok, t0=r.t0, t1=r.t1
        )

    # ---- the forest --------------------------------------------------------------------

    def live_nodes(self) -> list[Node]:
        with self._nlock:
            return [n for n in self.nodes.values() if not n.settled]

    def ancestors(self, sid: str) -> list[str]:
        out = []
        with self._nlock:
            p = self.nodes[sid].parent
            while p is not None:
                out.append(p)
                p = self.nodes[p].parent
        return out

    def owner(self, sid: str) -> str:
        return self.nodes[sid].parent or sid

    def open_root(self, rng: random.Random) -> None:
        slug = f"root{rng.randrange(10**6)}"
        r = self.call("open", slug=slug)
        if r is None or r.err:
            return
        with self._nlock:
            self.nodes[r.ok] = Node(r.ok, None, 0, slug)
        self.record(op="open", target=r.ok, result="accepted", t0=r.t0, t1=r.t1)

    def spawn(self, rng: random.Random) -> None:
        parents = [n for n in self.live_nodes() if n.depth < 2]
        if not parents:
            return
        p = rng.choice(parents)
        slug = f"k{rng.randrange(10**6)}"
        r = self.call("spawn", parent=p.id, slug=slug, prompt="hello", data=self.script(rng))
        if r is None:
            return
        if r.err:
            self.record(op="spawn", target=p.id, result="refused", code=r.err, t0=r.t0, t1=r.t1)
            return
        with self._nlock:
            self.nodes[r.ok] = Node(r.ok, p.id, p.depth + 1, slug)
        # the spawn's prompt is the child's first, waking message
        self.record(
            op="spawn", target=r.ok, parent=p.id, result="accepted", waking=True, t0=r.t0, t1=r.t1
        )

    # ---- scripts -----------------------------------------------------------------------

    def tag(self) -> str:
        with self._llock:
            self.tag_n += 1
            return f"soaktag-{self.run_id}-g{self.gen}-{self.tag_n}"

    def script(self, rng: random.Random) -> dict[str, Any] | None:
        steps: list[dict[str, Any]] = []
        for _ in range(rng.randint(1, 3)):
            c = rng.random()
            if c < 0.15:
                steps.append({"op": "say", "text": "hi"})
            elif c < 0.40:
                steps.append(
                    {
                        "op": "work",
                        "steps": rng.randint(1, 30),
                        "every": round(rng.uniform(0.01, 0.08), 3),
                    }
                )
            elif c < 0.55:
                steps.append({"op": "hang"})
            elif c < 0.72:
                n = rng.randint(1, 20)
                t = self.tag()
                steps.append(
                    {
                        "op": "tool",
                        "argv": [
                            "env",
                            f"SOAK_TAG={t}",
                            "sh",
                            "-c",
                            f"sleep {n} & sleep {n}; wait",
                            t,
                        ],
                    }
                )
            elif c < 0.85:
                n = rng.randint(1, 20)
                t = self.tag()
                steps.append(
                    {
                        "op": "tool",
                        "argv": [
                            "env",
                            f"SOAK_TAG={t}",
                            "sh",
                            "-c",
                            f"setsid sleep {n + 5} & sleep {n}; wait",
                            t,
                        ],
                    }
                )
            else:
                steps.append({"op": "ignore_cancel"})
        if rng.random() < 0.15:
            return None  # no steps: "ok: <content>", the turn ends at once
        return {"steps": steps}

    # ---- authorities -------------------------------------------------------------------

    def ref(self, sid: str) -> tuple[list[Any] | None, dict[str, Any] | None]:
        r = self.call("ref", target=sid)
        if r is None or r.err:
            return None, None
        ref = [r.ok["id"], r.ok["epoch"]]
        return ref, {"t0": r.t0, "gen": self.gen}

    def right_auth(self, rng: random.Random, sid: str, *, send: bool) -> dict[str, Any]:
        ancs = self.ancestors(sid)
        if ancs and rng.random() < 0.5:
            who = ancs[0] if send else rng.choice(ancs)
            ref, _ = self.ref(who)
            if ref is not None:
                return {"ref": ref}
        return {"user": self.owner(sid)}

    def wrong_auth(self, rng: random.Random, sid: str, *, send: bool) -> dict[str, Any]:
        node = self.nodes[sid]
        ancs = self.ancestors(sid)
        others = [n.id for n in self.live_nodes() if n.id not in ancs and n.id != sid]
        choices = ["bogus-user", "self-ref"]
        if others:
            choices += ["other-user", "other-ref"]
        if len(ancs) >= 2:
            choices.append("grandparent-user")
            if send:
                choices.append("grandparent-ref")
        if self.old_refs:
            stale = [r for r in self.old_refs if r[0] in ancs]
            if stale:
                choices.append("stale-ref")
        c = rng.choice(choices)
        if c == "bogus-user":
            return {"user": f"s_bogus{rng.randrange(10**6)}", "why": c}
        if c == "other-user":
            o = rng.choice(others)
            if node.parent is None and o == sid:
                o = "s_nobody"
            return {"user": o, "why": c}
        if c == "grandparent-user":
            return {"user": ancs[1], "why": c}
        if c == "grandparent-ref":
            ref, _ = self.ref(ancs[1])
            return {"ref": ref or [ancs[1], 1], "why": c}
        if c == "stale-ref":
            stale = [r for r in self.old_refs if r[0] in ancs]
            return {"ref": rng.choice(stale), "why": c}
        target = sid if c == "self-ref" else rng.choice(others)
        ref, _ = self.ref(target)
        return {"ref": ref or [target, 1], "why": c}

    # ---- operations --------------------------------------------------------------------

    def op_send(self, rng: random.Random) -> None:
        nodes = self.live_nodes() if rng.random() < 0.9 else list(self.nodes.values())
        if not nodes:
            return
        n = rng.choice(nodes)
        wrong = rng.random() < 0.15
        auth = (
            self.wrong_auth(rng, n.id, send=True)
            if wrong
            else self.right_auth(rng, n.id, send=True)
        )
        why = auth.pop("why", None)
        _, tok = self.token()
        wake = rng.random() < 0.75
        if n.parent is None and not wrong and rng.random() < 0.3:
            e = self.act(
                "prompt",
                "send",
                {"target": n.id, "content": tok, "data": self.script(rng)},
                {"target": n.id, "wake": True, "token": tok, "auth": "prompt"},
            )
        else:
            e = self.act(
                "send",
                "send",
                {
                    "target": n.id,
                    "content": tok,
                    "data": self.script(rng),
                    "auth": auth,
                    "wake": wake,
                },
                {"target": n.id, "wake": wake, "token": tok, "auth": auth, "wrong": why},
            )
        if wrong and e["result"] == "accepted":
            self.violate("wrong-authority-accepted", f"send to {n.id} by {why}", [e["seq"]])

    def op_interrupt(self, rng: random.Random) -> None:
        nodes = self.live_nodes() if rng.random() < 0.9 else list(self.nodes.values())
        if not nodes:
            return
        n = rng.choice(nodes)
        kind = rng.choice(["steer", "cancel", "cancel", "abort", "abort", "preempt"])
        wrong = rng.random() < 0.2
        auth = (
            self.wrong_auth(rng, n.id, send=False)
            if wrong
            else self.right_auth(rng, n.id, send=False)
        )
        why = auth.pop("why", None)
        _, tok = self.token()
        guard = None
        if rng.random() < 0.3:
            r = self.call("status", target=n.id)
            if r is not None and not r.err:
                guard = r.ok.get("turn")
            if guard is None or rng.random() < 0.3:
                guard = f"t_stale{rng.randrange(10**6)}"
        args: dict[str, Any] = {
            "target": n.id,
            "auth": auth,
            "kind": kind,
            "reason": tok,
            "grace": None,
            "deadline": None,
            "turn": guard,
        }
        if kind == "cancel":
            args["deadline"] = round(rng.uniform(0.3, 3.0), 2)
            if rng.random() < 0.5:
                args["grace"] = round(rng.uniform(0.2, 2.0), 2)
        e = self.act(
            "interrupt",
            "interrupt",
            args,
            {"target": n.id, "kind": kind, "token": tok, "wrong": why, "guard": guard},
        )
        if wrong and e["result"] == "accepted" and e["value"] is not None:
            self.violate(
                "wrong-authority-accepted",
                f"{kind} of {n.id} by {why} bound to {e['value']}",
                [e["seq"]],
            )
        if (
            not wrong
            and e["result"] == "refused"
            and e["code"] == "subagent-unauthorized"
            and "ref" not in auth
        ):
            self.violate("right-authority-refused", f"{kind} of {n.id}", [e["seq"]])
        if guard is not None and e["result"] == "accepted" and e["value"] not in (None, guard):
            self.violate(
                "turn-guard", f"{kind} guarded by {guard} bound to {e['value']}", [e["seq"]]
            )

    def op_pause(self, rng: random.Random) -> None:
        with self._llock:
            if not self.gate.is_set():
                return
        self._pause(rng)

    def _pause(self, rng: random.Random) -> None:
        nodes = self.live_nodes()
        if not nodes:
            return
        n = rng.choice(nodes)
        wrong = rng.random() < 0.15
        auth = (
            self.wrong_auth(rng, n.id, send=False)
            if wrong
            else self.right_auth(rng, n.id, send=False)
        )
        why = auth.pop("why", None)
        scope = "subtree" if rng.random() < 0.3 else "session"
        _, tok = self.token()
        e = self.act(
            "pause",
            "pause",
            {"target": n.id, "auth": auth, "scope": scope, "reason": tok, "turn": None},
            {"target": n.id, "token": tok, "wrong": why, "scope": scope},
        )
        if wrong:
            if e["result"] == "accepted" and e["value"]:
                self.violate("wrong-authority-accepted", f"pause of {n.id} by {why}", [e["seq"]])
            if e["result"] == "accepted" and e["value"]:
                self.call("resume", target=n.id, auth={"user": self.owner(n.id)}, scope=scope)
            return
        if e["result"] != "accepted" or not e["value"]:
            return
        time.sleep(rng.uniform(0.05, 1.0))  # pacing: how long the person looks
        self.act(
            "resume",
            "resume",
            {"target": n.id, "auth": auth, "scope": scope},
            {"target": n.id, "scope": scope, "pause": e["seq"]},
        )

    def op_release(self, rng: random.Random) -> None:
        nodes = self.live_nodes()
        if not nodes:
            return
        n = rng.choice(nodes)
        self.act("release", "release", {"target": n.id}, {"target": n.id})

    def op_dispose(self, rng: random.Random) -> None:
        nodes = [n for n in self.live_nodes() if n.parent is not None]
        if not nodes:
            return
        n = rng.choice(nodes)
        wrong = rng.random() < 0.3
        auth = (
            self.wrong_auth(rng, n.id, send=True)
            if wrong
            else self.right_auth(rng, n.id, send=True)
        )
        why = auth.pop("why", None)
        with self._nlock:
            subtree = [n.id] + [
                m.id for m in self.nodes.values() if n.id in self._ancestors_locked(m.id)
            ]
        e = self.act(
            "dispose",
            "dispose",
            {"target": n.id, "auth": auth},
            {"target": n.id, "subtree": subtree, "wrong": why},
            timeout=90.0,
        )
        if wrong and e["result"] == "accepted":
            self.violate("wrong-authority-accepted", f"dispose of {n.id} by {why}", [e["seq"]])
        if e["result"] != "refused":  # accepted, or perhaps (host died): settled from now on
            with self._nlock:
                for sid in subtree:
                    self.nodes[sid].settled = True

    def _ancestors_locked(self, sid: str) -> list[str]:
        out = []
        p = self.nodes[sid].parent
        while p is not None:
            out.append(p)
            p = self.nodes[p].parent
        return out

    def op_kill_worker(self, rng: random.Random) -> None:
        r = self.call("worker_pids")
        if r is None or r.err or not r.ok:
            return
        self.workers_seen.add(r.ok)
        pid = rng.choice(r.ok)
        t0 = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
            self.record(op="kill_worker", pid=pid, result="accepted", t0=t0, t1=time.time())
        except ProcessLookupError:
            self.record(op="kill_worker", pid=pid, result="gone", t0=t0, t1=time.time())

    # ---- threads -----------------------------------------------------------------------

    def ops_thread(self, i: int) -> None:
        rng = random.Random(self.seed * 7919 + i)
        ops = [
            (self.op_send, 40),
            (self.op_interrupt, 40),
            (self.op_pause, 6),
            (self.op_release, 5),
            (self.op_dispose, 1.5),
        ]
        funcs = [f for f, _ in ops]
        weights = [w for _, w in ops]
        while not self.stop.is_set():
            if not self.gate.wait(1.0):
                continue
            if len(self.live_nodes()) < 10 and rng.random() < 0.3:
                self.spawn(rng)
            roots = [n for n in self.live_nodes() if n.parent is None]
            if len(roots) < 3:
                self.open_root(rng)
            rng.choices(funcs, weights)[0](rng)
            time.sleep(rng.uniform(0.005, 0.06))  # pacing of the chaos, seeded

    def chaos_thread(self, t_end: float) -> None:
        rng = random.Random(self.seed * 104729)
        span = t_end - time.time()
        kills = sorted(rng.uniform(0.25, 0.85) * span + time.time() for _ in range(self.host_kills))
        next_worker = time.time() + rng.uniform(1.0, 5.0)
        while not self.stop.is_set() and time.time() < t_end:
            now = time.time()
            if kills and now >= kills[0]:
                kills.pop(0)
                self.kill_host(rng)
                continue
            if now >= next_worker:
                self.op_kill_worker(rng)
                next_worker = now + rng.uniform(1.0, 6.0)
            wake = min([next_worker, t_end, *kills[:1]])
            self.stop.wait(max(0.0, wake - time.time()))

    # ---- host kill and restart ---------------------------------------------------------

    def tagged(self, prefix: str) -> list[psutil.Process]:
        """Processes alive anywhere on the machine that carry our tag (argv or env)."""
        out = []
        for p in psutil.process_iter(["pid", "cmdline", "environ", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                cmd = " ".join(p.info["cmdline"] or [])
                env = (p.info["environ"] or {}).get("SOAK_TAG", "")
                if prefix in cmd or env.startswith(prefix):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def wait_gone(self, what: str, procs_fn: Any, bound: float) -> float:
        deadline = time.monotonic() + bound
        t0 = time.monotonic()
        while True:
            alive = procs_fn()
            if not alive:
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                names = []
                for p in alive[:8]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        names.append(f"{p.pid}:{' '.join(p.cmdline())[:100]}")
                if names:
                    self.violate("leak", f"{what}: still alive after {bound:g} s: {names}")
                for p in alive:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()
                return bound
            time.sleep(0.05)

    def kill_host(self, rng: random.Random) -> None:
        with self._llock:
            self.gate.clear()
        # A host may die with a turn paused: its frozen worker is continued by the
        # kernel when the launcher goes, and sweeps (tests/soak/test_soak_findings.py).
        host = self.host
        assert host is not None
        r = self.call("worker_pids")
        if r is not None and not r.err:
            self.workers_seen.add(r.ok)
        try:
            tree = psutil.Process(host.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        t_kill = time.time()
        host.kill()
        self.record(op="kill_host", pid=host.pid, result="accepted", t0=t_kill, t1=time.time())
        prefix = f"soaktag-{self.run_id}-g{self.gen}-"

        def left() -> list[psutil.Process]:
            alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            return alive + self.tagged(prefix)

        swept = self.wait_gone(f"host generation {self.gen} killed", left, KILL_SWEEP_BOUND)
        self.sweeps.append(swept)
        self.old_refs.extend(self.current_refs())
        self.start_host()
        self.restarts.append({"kill": t_kill, "ready": self.host.ready_at})  # type: ignore[union-attr]
        self.check_after_restart()
        self.audit_and_check()
        self.gate.set()

    def current_refs(self) -> list[list[Any]]:
        refs = []
        for e in self.ledger[-2000:]:
            a = e.get("auth")
            if isinstance(a, dict) and "ref" in a and e.get("gen") == self.gen:
                refs.append(a["ref"])
        return refs

    def start_host(self) -> None:
        self.gen += 1
        self.host = HostProc(
            self.db, self.gen, self.grace, self.workers, self.log, backend=self.backend
        )

    def check_after_restart(self) -> None:
        """Recovery parks everything: no session runs, subagents are dormant."""
        for n in list(self.nodes.values()):
            r = self.call("status", target=n.id)
            if r is None or r.err:
                continue
            st = r.ok["state"]
            ok = (
                st == "settled"
                if n.settled
                else (st in ("parked", "idle") if n.parent is None else st == "dormant")
            )
            if not ok and not (n.settled and st in ("dormant", "settled")):
                self.violate(
                    "recovery-state", f"{n.id} (depth {n.depth}) is {st} after restart {self.gen}"
                )

    # ---- the end -----------------------------------------------------------------------

    def drain(self) -> None:
        """Thaw what is paused, abort what runs (ledgered stops), until nothing runs."""
        for _ in range(10):
            running = []
            for n in list(self.nodes.values()):
                r = self.call("status", target=n.id)
                if r is None or r.err:
                    continue
                if r.ok["state"] == "paused":
                    self.act(
                        "resume",
                        "resume",
                        {"target": n.id, "auth": {"user": self.owner(n.id)}, "scope": "session"},
                        {"target": n.id, "scope": "session"},
                    )
                if r.ok["state"] in ("running", "paused", "disposing"):
                    running.append(n.id)
            if not running:
                return
            for sid in running:
                _, tok = self.token()
                self.act(
                    "interrupt",
                    "interrupt",
                    {
                        "target": sid,
                        "auth": {"user": self.owner(sid)},
                        "kind": "abort",
                        "reason": tok,
                        "grace": None,
                        "deadline": None,
                        "turn": None,
                    },
                    {
                        "target": sid,
                        "kind": "abort",
                        "token": tok,
                        "wrong": None,
                        "guard": None,
                        "drain": True,
                    },
                )
            for sid in running:
                # ``seconds``, not ``timeout``: that name is the call's own deadline
                self.call("wait", target=sid, seconds=20.0)
        self.violate("drain", "sessions still running after 10 abort rounds")

    # ---- the checks --------------------------------------------------------------------

    def audit(self) -> dict[str, Any] | None:
        r = self.call("audit", timeout=300.0, sessions=list(self.nodes))
        if r is None or r.err:
            self.violate("audit", f"audit failed: {None if r is None else r.msg}")
            return None
        return dict(r.ok)

    def audit_and_check(self, final: bool = False) -> None:
        """Audit; a check that fails is looked at again (up to 3 times, a second apart)
        before it counts, in case a notice or a record is still on its way."""
        for attempt in range(4):
            a = self.audit()
            if a is None:
                return
            found = Checker(self, a, final).run()
            if not found or attempt == 3:
                for v in found:
                    self.violate(v.check, v.detail, v.seqs)
                self.last_audit = a
                return
            time.sleep(1.0)  # let in-flight notices land (bounded: 3 retries)

    def run(self) -> SoakResult:
        self.sweeps = []
        self.last_audit = {}
        t_start = time.time()
        self.start_host()
        rng = random.Random(self.seed)
        for _ in range(3):
            self.open_root(rng)
        for _ in range(7):
            self.spawn(rng)
        self.gate.set()
        t_end = t_start + self.seconds
        threads = [
            threading.Thread(target=self.ops_thread, args=(i,), daemon=True)
            for i in range(self.threads)
        ]
        chaos = threading.Thread(target=self.chaos_thread, args=(t_end,), daemon=True)
        for t in [*threads, chaos]:
            t.start()
        chaos.join(self.seconds + 600)
        self.stop.set()
        self.gate.set()
        for t in threads:
            t.join(120.0)
            if t.is_alive():
                self.violate("wedge", "an operation thread did not finish within 120 s")
        self.drain()
        self.audit_and_check(final=True)
        assert self.host is not None
        self.workers_seen.add((self.call("worker_pids") or Reply(ok=[])).ok or [])
        tree = []
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = psutil.Process(self.host.pid).children(recursive=True)
        self.host.close()
        prefix = f"soaktag-{self.run_id}-"

        def left() -> list[psutil.Process]:
            alive = []
            for p in tree:
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(p)
                except psutil.NoSuchProcess:
                    pass
            return alive + self.workers_seen.alive() + self.tagged(prefix)

        self.wait_gone("after close", left, KILL_SWEEP_BOUND)
        elapsed = time.time() - t_start
        figures = self.figures(elapsed)
        if self._tmp is not None:
            self._tmp.cleanup()
        return SoakResult(self.seed, elapsed, figures, list(self.violations.values()), self.ledger)

    def figures(self, elapsed: float) -> dict[str, Any]:
        counts: Counter[str] = Counter()
        refusals: Counter[str] = Counter()
        for e in self.ledger:
            key = e["op"] + ("." + e["kind"] if e.get("kind") else "")
            counts[f"{key}.{e['result']}"] += 1
            if e["result"] == "refused":
                refusals[f"{key}:{e['code']}"] += 1
            if e.get("wrong"):
                counts[f"{key}.wrong_authority.{e['result']}"] += 1
        stops = {}
        for kind, vals in self.convergence.items():
            ms = [v * 1000 for v in vals]
            stops[kind] = {
                "n": len(ms),
                "p50_ms": round(_pct(ms, 0.5), 1),
                "p99_ms": round(_pct(ms, 0.99), 1),
                "max_ms": round(max(ms or [0]), 1),
            }
        turns = self.last_audit.get("sessions", {}) if self.last_audit else {}
        outcomes: Counter[str] = Counter()
        for s in turns.values():
            for t in s["turns"]:
                outcomes[str(t["outcome"])] += 1
        return {
            "date": time.strftime("%Y-%m-%d %H:%M", time.localtime()),
            "machine": _machine(),
            "seed": self.seed,
            "backend": self.backend,
            "duration_s": round(elapsed, 1),
            "chaos_s": self.seconds,
            "sessions": len(self.nodes),
            "operations": dict(sorted(counts.items())),
            "refusals": dict(sorted(refusals.items())),
            "stops": stops,
            "stops_cut_by_host_kill": self.cut_by_kill,
            "turn_outcomes": dict(sorted(outcomes.items())),
            "host_kills": sum(1 for e in self.ledger if e["op"] == "kill_host"),
            "worker_kills": sum(
                1 for e in self.ledger if e["op"] == "kill_worker" and e["result"] == "accepted"
            ),
            "host_kill_sweep_s_max": round(max(self.sweeps or [0.0]), 2),
            "violations": len(self.violations),
        }

    convergence: dict[str, list[float]] = {}  # noqa: RUF012 (set per audit)
    cut_by_kill: int = 0


class Checker:
    """The promise, checked over one audit of the host's durable records."""

    def __init__(self, soak: Soak, audit: dict[str, Any], final: bool) -> None:
        self.s = soak
        self.a = audit
        self.final = final
        self.out: list[Violation] = []
        self.sess: dict[str, Any] = audit["sessions"]
        with soak._llock:
            self.ledger = list(soak.ledger)
        self.restarts = list(soak.restarts)

        # indexes over the ledger (the checks run in O(ledger + turns))
        self.stops_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.pauses_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.resumes_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.wakers_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.releases_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.stop_on: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.disposed_at: dict[str, float] = {}
        for e in self.ledger:
            op, res = e["op"], e["result"]
            if op == "interrupt" and res == "accepted" and e["kind"] in ("cancel", "abort"):
                self.stop_on[e["target"]].append(e)
                if e["value"] is not None:
                    self.stops_of[e["value"]].append(e)
            elif op in ("pause", "resume") and res == "accepted":
                for t in e["value"] or []:
                    (self.pauses_of if op == "pause" else self.resumes_of)[t].append(e)
            elif (op == "send" and e.get("wake") and res in ("accepted", "indeterminate")) or (
                op == "spawn" and res == "accepted"
            ):
                self.wakers_of[e["target"]].append(e)
            elif op == "release" and res == "accepted":
                self.releases_of[e["target"]].append(e)
            elif op == "dispose" and res != "refused":
                for sid in e["subtree"]:
                    self.disposed_at.setdefault(sid, e["t0"])

    def v(self, check: str, detail: str, seqs: list[int] | None = None) -> None:
        self.out.append(Violation(check, detail, seqs or []))

    def run(self) -> list[Violation]:
        self.turn_index()
        self.messages()
        self.stops()
        self.refusals()
        self.holds()
        self.wakes()
        self.recovery()
        self.notices()
        self.disposals()
        return self.out

    def turn_index(self) -> None:
        self.turns: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, list[str]] = defaultdict(list)
        for sid, s in self.sess.items():
            for t in s["turns"]:
                t["session"] = sid
                self.turns[t["id"]] = t
                self.claims[t["message"]].append(t["id"])

    def messages(self) -> None:
        for m, ts in self.claims.items():
            if len(ts) > 1:
                self.v("claimed-twice", f"message {m} claimed by turns {ts}")
        for e in self.ledger:
            if e["op"] != "send" or e["result"] != "accepted":
                continue
            m, sid = e["value"], e["target"]
            if sid not in self.sess:
                continue
            pending = {p["id"] for p in self.sess[sid]["inbox"]}
            claims = self.claims.get(m, [])
            if claims and self.turns[claims[0]]["session"] != sid:
                self.v("claimed-elsewhere", f"{m} sent to {sid} claimed by {claims}", [e["seq"]])
            if claims and m in pending:
                self.v("claimed-and-pending", f"{m} in {sid}", [e["seq"]])
            if not claims and m not in pending:
                st = self.a["messages"].get(m)
                settled = self.sess[sid]["status"]["state"] == "settled"
                if not (settled and st is not None and st[1] == "closed"):
                    self.v(
                        "lost",
                        f"accepted message {m} to {sid} is neither claimed nor "
                        f"pending (store: {st}, state {self.sess[sid]['status']['state']})",
                        [e["seq"]],
                    )
        for sid, s in self.sess.items():
            keys = [int(t["message"][2:]) for t in s["turns"]]
            if any(b <= a for a, b in itertools.pairwise(keys)):
                self.v("fifo", f"{sid}: turns claimed messages out of order: {keys[-20:]}")
            if s["status"]["state"] != "settled" and keys and s["inbox"]:
                first = int(s["inbox"][0]["id"][2:])
                if first < max(keys):
                    self.v("fifo", f"{sid}: pending m_{first} is older than claimed m_{max(keys)}")

    def paused_overlap(self, sid: str, turn: str, t0: float, t1: float) -> float:
        total = 0.0
        resumes = self.resumes_of.get(turn, [])
        for p in self.pauses_of.get(turn, []):
            end = next((r["t1"] for r in resumes if r["seq"] > p["seq"]), t1)
            lo, hi = max(p["t0"], t0), min(end, t1)
            total += max(0.0, hi - lo)
        return total

    def stops(self) -> None:
        conv: dict[str, list[float]] = defaultdict(list)
        cut = 0
        for e in self.ledger:
            if e["op"] != "interrupt" or e["result"] != "accepted" or e["value"] is None:
                continue
            if e["kind"] not in ("cancel", "abort"):
                continue
            t = self.turns.get(e["value"])
            if t is None:
                self.v(
                    "stop-unknown-turn",
                    f"{e['kind']} bound to unknown turn {e['value']}",
                    [e["seq"]],
                )
                continue
            if t["session"] != e["target"]:
                self.v(
                    "stop-wrong-session", f"{e['value']} is not a turn of {e['target']}", [e["seq"]]
                )
            if e["kind"] == "abort":
                bound = ABORT_BOUND
            else:
                a = e["args"]
                g = self.s.grace if a["grace"] is None else a["grace"]
                bound = a["deadline"] + g + CANCEL_SLACK
            end = t["ended_at"]
            if t["outcome"] == "crashed" and t.get("error") == RECOVERED_ERROR:
                cut += 1
                kill = min((r["kill"] for r in self.restarts if r["kill"] >= e["t0"]), default=None)
                if kill is not None and kill - e["t0"] > bound + self.paused_overlap(
                    t["session"], t["id"], e["t0"], kill
                ):
                    self.v(
                        "stop-bound",
                        f"{e['kind']} of {t['id']} not converged in "
                        f"{bound:g} s before the host was killed",
                        [e["seq"]],
                    )
                continue
            if end is None:
                now = time.time()
                if (
                    now - e["t0"]
                    > bound + self.paused_overlap(t["session"], t["id"], e["t0"], now) + 30
                ):
                    self.v(
                        "stop-bound",
                        f"{e['kind']} of {t['id']} still open after {now - e['t0']:.1f} s",
                        [e["seq"]],
                    )
                continue
            took = end - e["t0"] - self.paused_overlap(t["session"], t["id"], e["t0"], end)
            conv[e["kind"]].append(max(0.0, took))
            if took > bound:
                self.v(
                    "stop-bound",
                    f"{e['kind']} of {t['id']} took {took:.2f} s "
                    f"(bound {bound:g} s, outcome {t['outcome']})",
                    [e["seq"]],
                )
            if t["outcome"] not in ("cancelled", "aborted", "crashed"):
                self.v(
                    "stop-outcome",
                    f"{e['kind']} accepted for {t['id']} but it ended {t['outcome']}",
                    [e["seq"]],
                )
            elif t["outcome"] != "crashed":
                acts = [
                    x
                    for x in self.sess[t["session"]]["entries"]
                    if x["kind"] == "marker"
                    and x["turn"] == t["id"]
                    and x["action"] in ("cancelled", "aborted")
                ]
                if not acts:
                    self.v(
                        "stop-marker", f"{t['id']} ended {t['outcome']} with no marker", [e["seq"]]
                    )
        self.s.convergence = dict(conv)
        self.s.cut_by_kill = cut

    def refusals(self) -> None:
        refused: dict[str, int] = {}
        noop: dict[str, int] = {}
        for e in self.ledger:
            tok = e.get("token")
            if not tok:
                continue
            if e["result"] == "refused":
                refused[tok] = e["seq"]
            elif e["op"] == "interrupt" and e["result"] == "accepted" and e["value"] is None:
                noop[tok] = e["seq"]
        for sid, s in self.sess.items():
            texts = [(x["text"] + " " + x["reason"], x["kind"]) for x in s["entries"]]
            texts += [(p["preview"], "inbox") for p in s["inbox"]]
            texts += [(t.get("reason") or "", "turn") for t in s["turns"]]
            for text, kind in texts:
                for m in TOKEN.finditer(text):
                    tok = m.group(0)
                    if tok in refused:
                        self.v(
                            "refusal-touched",
                            f"refused {tok} left a {kind} in {sid}",
                            [refused[tok]],
                        )
                    if tok in noop and kind == "marker":
                        self.v(
                            "noop-touched",
                            f"no-op interrupt {tok} left a marker in {sid}",
                            [noop[tok]],
                        )

    def holds(self) -> None:
        """Parked stays parked: after a stopped turn, a release or a host restart, the
        next turn of that session needs a waking send accepted after the hold began."""
        for sid, s in self.sess.items():
            turns = s["turns"]
            wakers = self.wakers_of.get(sid, [])
            releases = self.releases_of.get(sid, [])
            for i, n in enumerate(turns):
                start = n["started_at"]
                prev = turns[i - 1] if i else None
                hold = None
                why = ""
                if prev is not None and prev["outcome"] in WAKING_HOLD_OUTCOMES:
                    if prev.get("error") == RECOVERED_ERROR:
                        hold, why = prev["ended_at"], "recovered"
                    else:
                        st = [e["t0"] for e in self.stops_of.get(prev["id"], [])]
                        hold = min(st) if st else prev["ended_at"]
                        why = f"previous turn {prev['outcome']}"
                lo = prev["started_at"] if prev is not None else 0.0
                for r in releases:
                    if lo <= r["t0"] <= start and (hold is None or r["t0"] > hold):
                        hold, why = r["t0"], "released"
                for rs in self.restarts:
                    if lo <= rs["kill"] <= start and (hold is None or rs["ready"] > hold):
                        hold, why = rs["ready"], "host restarted"
                if hold is None:
                    continue
                # The host's own order decides (TurnRecord.woken_by: the waking send that
                # started the turn, named by the host that handled it). The callers'
                # clocks cannot: a send that returned before the host handled a crash
                # report is, in the host's order, after it (one soak in eleven saw that).
                woke = n.get("woken_by")
                if woke is not None and any(
                    w.get("value") == woke and w["t0"] <= start for w in wakers
                ):
                    continue
                # A send whose call died with its host has no id in the ledger, and a
                # spawn's prompt is a message the ledger never names: for those only
                # the clocks are left.
                if woke is not None and any(
                    (w["result"] == "indeterminate" or w["op"] == "spawn")
                    and w["t1"] >= hold
                    and w["t0"] <= start
                    for w in wakers
                ):
                    continue
                self.v(
                    "parked-woke",
                    f"turn {n['id']} of {sid} started at {start:.3f} "
                    f"after a hold ({why}) at {hold:.3f}, woken by {woke or 'nothing'}, "
                    "which is no waking send of the ledger",
                    [r["seq"] for r in releases][-3:],
                )

    def wakes(self) -> None:
        """Every accepted waking send is followed by a turn of its session, unless
        something later legitimately parks it (a stop, a crash, a host kill, a disposal);
        this holds the wake latch and cold resume of a released session."""
        for e in self.ledger:
            if e["op"] != "send" or e["result"] != "accepted" or not e.get("wake"):
                continue
            sid = e["target"]
            s = self.sess.get(sid)
            if s is None or any(t["started_at"] >= e["t0"] for t in s["turns"]):
                continue
            if s["status"]["state"] in ("running", "paused"):
                continue
            if any(r["kill"] >= e["t0"] for r in self.restarts):
                continue
            if any(
                t["ended_at"] and t["ended_at"] >= e["t0"] and t["outcome"] in ("crashed", "failed")
                for t in s["turns"]
            ):
                continue
            # a stop accepted before the send: its turn's end resumes the queue (latch)
            converging = {x["value"] for x in self.stop_on.get(sid, []) if x["t1"] < e["t0"]}
            if any(
                x["t1"] >= e["t0"] and x["value"] not in converging
                for x in self.stop_on.get(sid, [])
            ):
                continue
            if sid in self.disposed_at:
                continue
            self.v(
                "wake-lost",
                f"waking send {e['value']} to {sid} was followed by no turn "
                f"(state {s['status']['state']}, pending {s['status']['pending']})",
                [e["seq"]],
            )

    def recovery(self) -> None:
        for k, rs in enumerate(self.restarts):
            for t in self.turns.values():
                if t["started_at"] < rs["kill"]:
                    if t["outcome"] is None:
                        self.v("recovery", f"turn {t['id']} open at host kill {k} is still open")
                    elif (
                        t["ended_at"] >= rs["ready"] - 0.001
                        and t["ended_at"]
                        <= (self.restarts[k + 1]["kill"] if k + 1 < len(self.restarts) else 1e18)
                        and t["started_at"] < rs["kill"]
                        and (t["outcome"] != "crashed" or t["cause"] != "system")
                    ):
                        self.v(
                            "recovery",
                            f"turn {t['id']} open at host kill {k} ended "
                            f"{t['outcome']}/{t['cause']}, not crashed/system",
                        )

    def notices(self) -> None:
        by_turn: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for n in self.a["notices"]:
            by_turn[str(n["turn"])].append(n)
        for turn, ns in by_turn.items():
            if len(ns) > 1:
                self.v(
                    "notice-twice", f"turn {turn} has {len(ns)} notices: {[n['id'] for n in ns]}"
                )
        for sid, s in self.sess.items():
            node = self.s.nodes.get(sid)
            if node is None or node.parent is None:
                continue
            parent = self.sess.get(node.parent)
            if parent is None or parent["status"]["state"] == "settled":
                continue
            disposing = self.disposed_at.get(node.parent)
            for t in s["turns"]:
                if t["outcome"] is None:
                    continue
                if disposing is not None and t["ended_at"] >= disposing:
                    continue
                ns = by_turn.get(t["id"], [])
                if not ns:
                    self.v(
                        "notice-missing",
                        f"turn {t['id']} of {sid} ended {t['outcome']} "
                        f"at {t['ended_at']:.3f}; parent {node.parent} has no notice",
                    )
                elif ns[0]["session"] != node.parent:
                    self.v("notice-misdirected", f"notice of {t['id']} went to {ns[0]['session']}")

    def disposals(self) -> None:
        for e in self.ledger:
            if e["op"] != "dispose" or e["result"] != "accepted":
                continue
            for sid in e["subtree"]:
                s = self.sess.get(sid)
                if s is None:
                    continue
                if s["status"]["state"] != "settled":
                    self.v(
                        "dispose", f"{sid} is {s['status']['state']} after its disposal", [e["seq"]]
                    )
                for t in s["turns"]:
                    if t["started_at"] > e["t1"]:
                        self.v(
                            "dispose",
                            f"turn {t['id']} of {sid} started after the disposal returned",
                            [e["seq"]],
                        )


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} vCPU {model}, {mem:.0f} GiB, Python "
        f"{platform.python_version()}, load {os.getloadavg()[0]:.1f}"
    )


def table(runs: list[dict[str, Any]]) -> str:
    """The results table (benchmarks/RESULTS.md): one column per run."""

    def stop(f: dict[str, Any], kind: str) -> str:
        x = f["stops"].get(kind, {})
        return (
            f"{x.get('n', 0)}: {x.get('p50_ms', 0):g} / {x.get('p99_ms', 0):g} / "
            f"{x.get('max_ms', 0):g} ms"
        )

    def ops(f: dict[str, Any], prefix: str) -> int:
        return sum(
            v
            for k, v in f["operations"].items()
            if k.startswith(prefix) and ".wrong_authority." not in k
        )

    def cnt(f: dict[str, Any], prefix: str, suffix: str, wrong: bool = False) -> int:
        return sum(
            v
            for k, v in f["operations"].items()
            if k.startswith(prefix)
            and k.endswith(suffix)
            and (wrong or ".wrong_authority." not in k)
        )

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("seed", lambda f: str(f["seed"])),
        ("date", lambda f: f["date"]),
        ("chaos / total", lambda f: f"{f['chaos_s'] / 60:g} min / {f['duration_s']:.0f} s"),
        ("sessions", lambda f: str(f["sessions"])),
        (
            "sends accepted / refused",
            lambda f: f"{ops(f, 'send.accepted')} / {ops(f, 'send.refused')}",
        ),
        (
            "interrupts accepted / refused",
            lambda f: f"{cnt(f, 'interrupt', '.accepted')} / {cnt(f, 'interrupt', '.refused')}",
        ),
        (
            "wrong-authority calls refused / accepted no-op",
            lambda f: (
                f"{cnt(f, '', '.wrong_authority.refused', wrong=True)} / "
                f"{cnt(f, '', '.wrong_authority.accepted', wrong=True)}"
            ),
        ),
        (
            "pauses / releases / disposals",
            lambda f: (
                f"{ops(f, 'pause.accepted')} / "
                f"{ops(f, 'release.accepted')} / {ops(f, 'dispose.accepted')}"
            ),
        ),
        ("abort: n: p50 / p99 / max", lambda f: stop(f, "abort")),
        ("cancel: n: p50 / p99 / max", lambda f: stop(f, "cancel")),
        (
            "turns (completed / cancelled / aborted / crashed)",
            lambda f: " / ".join(
                str(f["turn_outcomes"].get(k, 0))
                for k in ("completed", "cancelled", "aborted", "crashed")
            ),
        ),
        ("host kills / worker kills", lambda f: f"{f['host_kills']} / {f['worker_kills']}"),
        ("violations", lambda f: str(f["violations"])),
    ]
    out = [
        "| | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for name, fn in rows:
        out.append(f"| {name} | " + " | ".join(fn(f) for f in runs) + " |")
    return "\n".join(out)


def run_soak(seconds: float, seed: int, **kw: Any) -> SoakResult:
    return Soak(seconds, seed, **kw).run()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    ap.add_argument("--ledger", default=None, help="write the whole ledger here (JSON lines)")
    ap.add_argument("--table", action="store_true", help="print the results table of --json")
    ap.add_argument(
        "--workdir",
        default=None,
        help="keep the store and the hosts' logs here (default: a temporary folder)",
    )
    ap.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="where turns run (ray: the host starts its own local Ray each time)",
    )
    ns = ap.parse_args(argv)
    if ns.table:
        print(table(json.loads(Path(ns.json).read_text())["runs"]))
        return 0
    res = run_soak(ns.minutes * 60, ns.seed, backend=ns.backend, workdir=ns.workdir)
    print(json.dumps(res.figures, indent=2))
    if ns.ledger:
        with open(ns.ledger, "w") as f:
            for e in res.ledger:
                f.write(json.dumps(e, default=str) + "\n")
    if ns.json:
        path = Path(ns.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        runs: dict[str, Any] = {}
        if path.exists():
            try:
                runs = json.loads(path.read_text())
            except ValueError:
                runs = {}
        runs.setdefault("runs", [])
        runs["runs"] = [
            r
            for r in runs["runs"]
            if r.get("seed") != ns.seed
            or r.get("chaos_s") != res.figures["chaos_s"]
            or r.get("backend", "local") != ns.backend
        ] + [res.figures]
        path.write_text(json.dumps(runs, indent=2) + "\n")
    if res.violations:
        print(res.explain(), file=sys.stderr)
        return 1
    print(f"soak clean: seed {ns.seed}, {res.seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
