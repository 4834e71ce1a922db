"""The host side of ``make soak``: one Tether runtime in its own process, driven over a pipe.

Usage: ``python -m benchmarks.soak_host DB_PATH --grace G --workers N``. It reads one JSON
request per line on stdin (``{"id": n, "op": ..., "args": {...}}``), runs each on a thread
of its own pool (so requests overlap, as a busy server's would) and writes one JSON reply
per line on stdout: ``{"id": n, "ok": result, "t0": ..., "t1": ...}`` or ``{"id": n,
"err": code, "msg": ..., "t0": ..., "t1": ...}``, where ``t0``/``t1`` are this process's
wall clock just before and just after the call. The first line it writes is
``{"ready": pid}``. The soak (``benchmarks.soak``) SIGKILLs this process at random and
starts another one on the same store: the ledger lives over there, not here.

Only the public API of ``tether.Runtime`` is used, except for ``audit``'s notice list,
which reads the durable store read-only (the API gives no way to read the data of a
notice a turn has already claimed).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

import tether
from tether.wire.errors import TetherError

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(dict[str, Any])


def _auth(spec: dict[str, Any]) -> tether.User | tether.Ancestor:
    if "user" in spec:
        return tether.User(parent=spec["user"], name=spec.get("name"))
    sid, epoch = spec["ref"]
    return tether.Ancestor(tether.AgentRef(id=sid, epoch=int(epoch)))


class Host:
    def __init__(self, path: str, grace: float, workers: int, backend: str = "local") -> None:
        self.path = path
        self.rt = tether.Runtime(
            path, workers=workers, grace=grace, subreaper=True, backend=backend
        )
        self.out_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="soak-op")

    def write(self, obj: dict[str, Any]) -> None:
        data = _enc.encode(obj) + b"\n"
        with self.out_lock:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    def handle(self, req: dict[str, Any]) -> None:
        t0 = time.time()
        try:
            result = getattr(self, "op_" + req["op"])(**req.get("args", {}))
        except TetherError as exc:
            self.write(
                {"id": req["id"], "err": exc.code, "msg": exc.message, "t0": t0, "t1": time.time()}
            )
            return
        except Exception as exc:  # an unexpected error is itself a finding: report it
            self.write(
                {
                    "id": req["id"],
                    "err": "python:" + type(exc).__name__,
                    "msg": str(exc)[:500],
                    "t0": t0,
                    "t1": time.time(),
                }
            )
            return
        self.write(
            {"id": req["id"], "ok": msgspec.to_builtins(result), "t0": t0, "t1": time.time()}
        )

    # ---- operations (each is one public call) -----------------------------------------

    def op_open(self, slug: str) -> str:
        return self.rt.open_session("tether:Scripted", slug=slug)

    def op_spawn(self, parent: str, slug: str, prompt: str, data: dict[str, Any]) -> str:
        return str(self.rt.spawn(parent, "tether:Scripted", slug=slug, prompt=prompt, data=data))

    def op_prompt(self, target: str, content: str, data: dict[str, Any]) -> str:
        return self.rt.prompt(target, content, data=data)

    def op_send(
        self, target: str, content: str, data: dict[str, Any], auth: dict[str, Any], wake: bool
    ) -> str:
        return self.rt.send(target, content, authority=_auth(auth), data=data, wake=wake)

    def op_interrupt(
        self,
        target: str,
        auth: dict[str, Any],
        kind: str,
        reason: str,
        grace: float | None,
        deadline: float | None,
        turn: str | None,
    ) -> str | None:
        return self.rt.interrupt(
            target,
            authority=_auth(auth),
            kind=kind,
            reason=reason,
            grace=grace,
            deadline=deadline,
            turn=turn,
        )

    def op_pause(
        self, target: str, auth: dict[str, Any], scope: str, reason: str, turn: str | None
    ) -> list[str]:
        return self.rt.pause(target, authority=_auth(auth), scope=scope, reason=reason, turn=turn)

    def op_resume(self, target: str, auth: dict[str, Any], scope: str) -> list[str]:
        return self.rt.resume(target, authority=_auth(auth), scope=scope)

    def op_release(self, target: str) -> None:
        self.rt.release(target)

    def op_dispose(self, target: str, auth: dict[str, Any]) -> None:
        self.rt.dispose(target, authority=_auth(auth))

    def op_status(self, target: str) -> Any:
        return self.rt.status(target)

    def op_ref(self, target: str) -> Any:
        return self.rt.agent_ref(target)

    def op_wait(self, target: str, seconds: float) -> Any:
        return self.rt.wait(target, until=("idle", "parked", "dormant", "settled"), timeout=seconds)

    def op_worker_pids(self) -> list[int]:
        return self.rt.worker_pids

    def op_audit(self, sessions: list[str]) -> dict[str, Any]:
        """Everything the checks need, for each session: status, turns, inbox, and the
        transcript's markers and user entries; plus every notice in the store."""
        out: dict[str, Any] = {}
        for sid in sessions:
            entries: list[dict[str, Any]] = []
            after = 0
            while True:
                page = self.rt.transcript(sid, after=after, limit=1000)
                if not page:
                    break
                after = page[-1].seq
                entries.extend(
                    {
                        "kind": e.kind,
                        "text": e.text[:300],
                        "turn": e.turn,
                        "action": e.action,
                        "reason": (e.reason or "")[:300],
                        "by": e.by,
                    }
                    for e in page
                    if e.kind in ("marker", "user", "tool")
                )
            out[sid] = {
                "status": msgspec.to_builtins(self.rt.status(sid)),
                "turns": msgspec.to_builtins(self.rt.turns(sid)),
                "inbox": msgspec.to_builtins(self.rt.inbox(sid)),
                "entries": entries,
            }
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        try:
            rows = db.execute(
                "SELECT id, session, data, state FROM messages WHERE kind='notice'"
            ).fetchall()
            states = db.execute("SELECT id, session, state FROM messages").fetchall()
        finally:
            db.close()
        notices = []
        for mid, session, blob, state in rows:
            data = _dec.decode(blob) if blob else {}
            notices.append(
                {
                    "id": f"m_{mid}",
                    "session": session,
                    "state": state,
                    "turn": data.get("notice", {}).get("turn"),
                }
            )
        return {
            "sessions": out,
            "notices": notices,
            "messages": {f"m_{mid}": [s, st] for mid, s, st in states},
        }

    def op_close(self) -> None:
        self.rt.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--grace", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", default="local")
    ns = ap.parse_args()
    host = Host(ns.path, ns.grace, ns.workers, ns.backend)
    host.write({"ready": os.getpid()})
    closing = None
    for line in sys.stdin.buffer:
        req = _dec.decode(line)
        if req["op"] == "close":
            closing = req
            break
        host.pool.submit(host.handle, req)
    host.pool.shutdown(wait=True)
    if closing is not None:
        host.handle(closing)
    else:
        host.rt.close()


if __name__ == "__main__":
    main()
