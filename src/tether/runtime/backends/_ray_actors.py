"""The Ray side of the Ray backend: a slot actor per worker, a reaper actor per node.

Imported by ``backends.ray`` (in the host) and by Ray's workers (to run the actors). Host ->
worker frames carry sequence numbers because Ray runs an actor's concurrency groups in no
set order. The whole picture: docs/design.md, section 11.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import psutil
import ray

from tether.contain.cgroup import Cgroups, CgroupUnavailable, Leaf, kill_leaf
from tether.contain.procs import TREE_ENV, alive, freeze_tree, reap_tree, thaw_tree
from tether.wire.codec import Channel, FrameTooLarge
from tether.wire.errors import FrameError
from tether.wire.frames import Probe, ProbeReply, Ready, Shutdown, TurnEnd, WorkerFrame

__all__ = ["NODE_ENV", "TREE_ENV", "Reaper", "Slot"]

NODE_ENV = "TETHER_NODE"  # the Ray node id, for drivers and tests that want to know
_START_TIMEOUT = 30.0
_KILL_TIMEOUT = 5.0

_decoder = msgspec.msgpack.Decoder(WorkerFrame)
_encoder = msgspec.msgpack.Encoder()


# ---- process trees (used by both actors) ------------------------------------------------


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if alive(p)]


def _keeper_of(token: str) -> int | None:
    """The keeper of the tree ``token`` (see _ray_child): it runs ``--keep TOKEN FD
    [LEAF]``."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "tether.runtime.backends._ray_child" in cmd and "--keep" in cmd:
            at = cmd.index("--keep")
            if cmd[at + 1 : at + 2] == [token]:
                return p.pid
    return None


# ---- the turn child ----------------------------------------------------------------------


class _Child:
    """One worker process (worker.py's turn loop) and this end of its socket."""

    def __init__(self, node: str, groups: Cgroups | None = None) -> None:
        self.token = secrets.token_hex(8)
        self.leaf: Leaf | None = None
        argv = [sys.executable, "-m", "tether.runtime.backends._ray_child"]
        if groups is not None:
            self.leaf = groups.leaf(f"w-{self.token}")
            self.leaf.create()
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        env[TREE_ENV] = self.token
        env[NODE_ENV] = node
        argv += [str(theirs.fileno()), self.token]
        if self.leaf is not None:
            argv.append(self.leaf.path)
        try:
            self.proc = subprocess.Popen(
                argv, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL
            )
        except BaseException:
            if self.leaf is not None:
                self.leaf.remove()
            raise
        theirs.close()
        self.pid = self.proc.pid
        self.chan: Channel[WorkerFrame] = Channel(mine, WorkerFrame)
        mine.settimeout(_START_TIMEOUT)
        first = self.read()
        mine.settimeout(None)
        if first is None or not isinstance(_decoder.decode(first), Ready):
            self.kill()
            raise RuntimeError("the turn worker did not start")
        self.keeper = _keeper_of(self.token)

    def read(self) -> bytes | None:
        """The next frame's bytes; None at the end of the stream (a frame cut short
        included); FrameTooLarge for a frame over the cap."""
        try:
            return self.chan.recv_bytes()
        except FrameTooLarge:
            raise
        except (EOFError, FrameError):
            return None

    def write(self, *payloads: bytes) -> None:
        """Frames in one ``sendall``: a RunTurn and the frames held for it arrive
        together, so the worker's reader takes them all before its turn reaches a
        boundary (it reads from its buffer without letting go of the GIL)."""
        self.chan.send_bytes(*payloads)

    def kill(self) -> int | None:
        """Kill its whole tree and reap it (and remove its leaf); its exit code."""
        if self.leaf is not None:
            kill_leaf(self.leaf.path)
        else:
            reap_tree(self.pid, self.token, _KILL_TIMEOUT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(_KILL_TIMEOUT)
        with contextlib.suppress(OSError):
            self.chan.close()
        if self.leaf is not None and not self.leaf.remove():
            _log_stuck(self.leaf.path)
        return self.proc.returncode


class _Inbound:
    """Host→worker frames of one turn, released in sequence order."""

    def __init__(self) -> None:
        self.next = 0
        self.held: dict[int, bytes] = {}
        self.live = False


class Slot:
    """One worker slot: runs turns, one at a time, in its own child process."""

    def __init__(self, containment: str = "walk") -> None:
        self.node = str(ray.get_runtime_context().get_node_id())
        self.lock = threading.Lock()
        self.inbound: dict[str, _Inbound] = {}
        self.ended: deque[str] = deque(maxlen=4096)
        self.ended_set: set[str] = set()
        # cgroup containment on this node, where asked for and available (else the walk,
        # and the reason, which the host reports when it asked for cgroup)
        self.groups: Cgroups | None = None
        self.cgroup_error: str | None = None
        if containment != "walk":
            try:
                self.groups = Cgroups.open(None, guard=False)
            except CgroupUnavailable as exc:
                self.cgroup_error = str(exc)
        self.child: _Child | None = None
        if self.groups is not None or containment != "cgroup":
            self.child = _Child(self.node, self.groups)

    def info(self) -> dict[str, Any]:
        child = self.child
        return {
            "pid": os.getpid(),
            "node": self.node,
            "child": None if child is None else child.pid,
            "token": None if child is None else child.token,
            "keeper": None if child is None else child.keeper,
            "leaf": None if child is None or child.leaf is None else child.leaf.path,
            "containment": "walk" if self.groups is None else "cgroup",
            "cgroup_error": self.cgroup_error,
        }

    @ray.method(concurrency_group="turn")
    def restart(self) -> dict[str, Any]:
        """A new child after the last one died (or was killed)."""
        old, self.child = self.child, None
        if old is not None:
            old.kill()
        self.child = _Child(self.node, self.groups)
        return self.info()

    @ray.method(concurrency_group="turn")
    def shutdown(self) -> None:
        """Stop the child (and anything it left), so that the actor can be killed."""
        child, self.child = self.child, None
        if child is not None:
            with contextlib.suppress(OSError):
                child.write(_encoder.encode(Shutdown()))
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(2.0)
            child.kill()
        groups, self.groups = self.groups, None
        if groups is not None:
            groups.close()

    @ray.method(concurrency_group="turn")
    def probe(self, driver: str, config: dict[str, Any] | None = None) -> bytes:
        """Ask the idle child to import ``driver`` and check ``config``: its ProbeReply,
        as JSON."""
        child = self.child
        if child is None:
            raise RuntimeError("no worker in this slot")
        child.write(_encoder.encode(Probe(driver=driver, config=config)))
        while True:
            payload = child.read()
            if payload is None:
                raise RuntimeError("the worker died while checking the driver")
            frame = _decoder.decode(payload)
            if isinstance(frame, ProbeReply) and frame.driver == driver:
                return msgspec.json.encode(frame)

    @ray.method(concurrency_group="check")
    def check(self, driver: str, config: dict[str, Any] | None = None) -> bytes:
        """``probe`` for a busy slot: a new process on this node imports ``driver``."""
        argv = ["--check", driver, msgspec.json.encode(config).decode()]
        done = subprocess.run(
            [sys.executable, "-m", "tether.runtime.backends._ray_child", *argv],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT,
        )
        if done.returncode == 0:
            return done.stdout.strip().encode()
        error = f"checking the driver failed: {done.stderr.strip()[-500:]}"
        return msgspec.json.encode(ProbeReply(driver=driver, error=error))

    @ray.method(num_returns="streaming", concurrency_group="turn")
    def run(self, turn: str, start: bytes, pending: list[bytes]) -> Iterator[Any]:
        """Run one turn; yield each worker frame's bytes up to its TurnEnd, or, when the
        child died, ``{"exit": code, "error": ...}`` once its whole tree is dead."""
        child = self.child
        payload: bytes | None
        if child is None:
            yield {"exit": None, "error": "no worker in this slot"}
            return
        with self.lock:
            st = self.inbound.setdefault(turn, _Inbound())
            st.next = len(pending)
            held = []
            while st.next in st.held:  # sent before the turn started here: in order
                held.append(st.held.pop(st.next))
                st.next += 1
            st.live = True
            with contextlib.suppress(OSError):  # it died: the read below says so
                child.write(start, *pending, *held)
        error = None
        try:
            while True:
                try:
                    payload = child.read()
                except FrameTooLarge as exc:
                    error = f"protocol error: {exc}"
                    break
                except OSError:
                    payload = None
                if payload is None:
                    break
                yield payload
                with contextlib.suppress(Exception):
                    frame = _decoder.decode(payload)
                    if isinstance(frame, TurnEnd) and frame.turn == turn:
                        return
            # The child is gone (killed, crashed) or must go (a bad stream): its tree is
            # dead before the end is reported.
            self.child = None
            code = child.kill()
            yield {"exit": code, "error": error}
        finally:
            with self.lock:
                self.inbound.pop(turn, None)
                self.ended.append(turn)
                self.ended_set.add(turn)
                if len(self.ended_set) > len(self.ended):
                    self.ended_set = set(self.ended)

    @ray.method(concurrency_group="ctl")
    def send(self, turn: str, seq: int, payload: bytes) -> None:
        """A host→worker frame of ``turn``, the ``seq``-th (from 0) of that turn."""
        with self.lock:
            if turn in self.ended_set:
                return  # the turn is over: a late frame is dropped
            st = self.inbound.setdefault(turn, _Inbound())
            st.held[seq] = payload
            if st.live:
                self._flush(turn, st)

    def _flush(self, turn: str, st: _Inbound) -> None:
        child = self.child
        while st.next in st.held:
            payload = st.held.pop(st.next)
            st.next += 1
            if child is not None:
                with contextlib.suppress(OSError):
                    child.write(payload)


class Reaper:
    """Per node, pinned to it: freezes and kills turn trees for the host, so that an
    abort never depends on the slot (which may be frozen or gone)."""

    def node(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def kill_tree(self, root: int, token: str, leaf: str | None = None) -> bool:
        """Kill the tree of ``root``: its leaf's ``cgroup.kill``, or the walk (its
        group, its descendants, the escapees tagged ``token``); True once it is dead."""
        if leaf is not None:
            return kill_leaf(leaf)
        return reap_tree(root, token, _KILL_TIMEOUT)

    def kill_pids(self, pids: list[int], grace: float = 0.0) -> bool:
        """SIGKILL these processes (slot actors) unless they exit within ``grace``."""
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        deadline = time.monotonic() + grace
        while _live(procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        for p in _live(procs):
            with contextlib.suppress(psutil.Error):
                p.kill()
        deadline = time.monotonic() + _KILL_TIMEOUT
        while _live(procs) and time.monotonic() < deadline:
            time.sleep(0.002)
        return not _live(procs)

    def freeze(self, root: int, leaf: str | None = None) -> list[int]:
        """Stop the tree; the escapees the walk stopped one by one (none in a leaf)."""
        if leaf is not None:
            frozen = Leaf(leaf, frozenset()).freeze(wait=_KILL_TIMEOUT)
            if not frozen and os.path.isdir(leaf):  # gone: the turn ended meanwhile
                raise RuntimeError(f"the leaf {leaf} did not say frozen 1")
            return []
        return freeze_tree(root)

    def thaw(self, root: int, escapees: list[int], leaf: str | None = None) -> None:
        if leaf is not None:
            Leaf(leaf, frozenset()).thaw()
            return
        thaw_tree(root, escapees)


def _log_stuck(path: str) -> None:
    # no structlog set up in a Ray worker: its stderr goes to the driver's log
    print(f"tether: cannot remove the cgroup leaf {path}", file=sys.stderr)
