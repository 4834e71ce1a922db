"""cgroup v2 containment: a leaf per worker, killed and frozen by the kernel, and the
recovery of a dead host's groups. The layout of the groups, why a leaf per worker, and
how a kill and a pause wait for the kernel: docs/design.md, section 7.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import structlog

__all__ = [
    "LIMIT_CONTROLLERS",
    "CgroupUnavailable",
    "Cgroups",
    "Leaf",
    "kill_leaf",
    "v2_mount",
]

# The controller each limit needs.
LIMIT_CONTROLLERS: Mapping[str, str] = {"memory_mb": "memory", "pids": "pids", "cpu": "cpu"}
_WANTED = ("cpu", "memory", "pids")  # enabled for the leaves where the kernel offers them
_GROUP = "tether"
_KILL_WAIT = 2.0  # seconds one kill pass waits for populated 0 before the caller retries
_FREEZE_WAIT = 0.2  # seconds an abort waits for frozen 1 before it lists and kills anyway
_CPU_PERIOD = 100_000  # µs: cpu.max's period for a limit in cores
_GUARD_WAIT = 10.0  # seconds close() waits for the guard's last pass
_names = itertools.count()
log = structlog.get_logger("tether.cgroup")


class CgroupUnavailable(Exception):
    """No writable cgroup v2 hierarchy here; the message says why."""


def v2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup``, or a hybrid's
    ``/sys/fs/cgroup/unified``), or None."""
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            fields = left.split(" ")
            if len(fields) >= 5:
                return fields[4].replace("\\040", " ")
    return None


def _own_cgroup(pid: str = "self") -> str:
    """This process's v2 cgroup path (``0::/path``), relative to the mount."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return "/"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _gone(exc: OSError) -> bool:
    """``exc`` says the cgroup is gone: ENOENT, or ENODEV, which a control file of a
    cgroup being removed gives (its directory still lists for a moment). The kernel
    removes only an empty cgroup, so gone is empty; another process (the Ray keeper,
    a guard) may be removing it while we kill it."""
    return exc.errno in (errno.ENOENT, errno.ENODEV)


def _keyed(text: str) -> dict[str, int]:
    """``key value`` lines (cgroup.events, cpu.stat, memory.events) as a dict."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _start_ticks(pid: int | str) -> str | None:
    """A process's start time in clock ticks since boot (tells it from a reused pid)."""
    try:
        stat = _read(f"/proc/{pid}/stat")
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


@dataclass(eq=False)
class Leaf:
    """One worker's leaf cgroup. Every method tolerates the leaf being gone."""

    path: str
    controllers: frozenset[str]
    limits: dict[str, float] = field(default_factory=dict)  # what is written now
    # per-turn baselines, taken at dispatch
    _cpu0: int = 0
    _oom0: int = 0
    _refused0: int = 0  # pids.events "max": forks the pids limit refused
    _peak_fd: int | None = None
    # control files read at every turn's end, kept open: an open and close per read
    # cost the host ~20 µs each; a read at offset 0 makes the kernel render it afresh
    _kept: dict[str, int] = field(default_factory=dict)
    _cpu_last: int = 0  # usage_usec at the last reading (the worker's start, a turn's end)

    def create(self) -> None:
        os.mkdir(self.path)
        if "memory" in self.controllers:
            # an OOM kill takes the whole leaf (the worker too): the turn ends as one
            with contextlib.suppress(OSError):
                _write(f"{self.path}/memory.oom.group", "1")

    def file(self, name: str) -> str:
        return f"{self.path}/{name}"

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(self.file("cgroup.procs")).split()]
        except OSError as exc:
            if _gone(exc):
                return []
            raise

    def events(self) -> dict[str, int]:
        try:
            return _keyed(_read(self.file("cgroup.events")))
        except OSError as exc:
            if _gone(exc):
                return {"populated": 0, "frozen": 0}
            raise

    def populated(self) -> bool:
        return self.events().get("populated", 0) == 1

    def _wait(self, key: str, want: int, timeout: float) -> bool:
        """Wait until ``cgroup.events`` says ``key want``; False at the deadline. The
        kernel signals a change of this file as POLLPRI."""
        try:
            fd = os.open(self.file("cgroup.events"), os.O_RDONLY)
        except OSError as exc:
            if _gone(exc):
                return want == 0
            raise
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI | select.POLLERR)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    text = os.pread(fd, 4096, 0).decode()
                except OSError as exc:
                    if _gone(exc):  # removed (so emptied) meanwhile
                        return want == 0
                    raise
                if _keyed(text).get(key) == want:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # a short cap as well: a notification is coalesced, never lost, but a
                # re-read costs nothing
                poller.poll(min(left, 0.05) * 1000)
        finally:
            os.close(fd)

    def _control(self, name: str, value: str) -> None:
        """Write a control file; a leaf removed meanwhile (its owner killed and removed
        it) is not an error."""
        try:
            _write(self.file(name), value)
        except OSError as exc:
            if not _gone(exc):
                raise

    def freeze(self, wait: float | None = None) -> bool:
        """``cgroup.freeze`` 1; with ``wait``, True once ``frozen 1`` (False at the deadline)."""
        self._control("cgroup.freeze", "1")
        return True if wait is None else self._wait("frozen", 1, wait)

    def thaw(self) -> None:
        self._control("cgroup.freeze", "0")

    def kill(self, wait: float = _KILL_WAIT, pids: Iterable[int] = ()) -> bool:
        """``cgroup.kill``; True once ``populated 0`` (False: not yet, try again).

        ``pids``: what the caller listed in the leaf. The kernel sends a control file's
        change notices at most once per ~10 ms, so the ``populated 0`` that follows a
        ``frozen 1`` comes that much late (15 ms of a 35 ms abort here): their exits
        are waited for on pidfds, then ``populated`` is read; the notice is the fallback
        for whatever the list missed."""
        deadline = time.monotonic() + wait
        fds = _pidfds(pids)  # before the kill: a pidfd pins the process, not a number
        try:
            self._control("cgroup.kill", "1")
            _wait_exits(fds, wait)
        finally:
            for fd in fds:
                os.close(fd)
        return self._wait("populated", 0, max(deadline - time.monotonic(), 0.0))

    def remove(self) -> bool:
        """Remove the leaf if it is empty; True once it is gone."""
        self.end_turn_peak()
        for fd in self._kept.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._kept.clear()
        try:
            os.rmdir(self.path)
        except OSError as exc:
            return _gone(exc)
        return True

    # ---- limits and accounting -------------------------------------------------------

    def set_limits(self, limits: Mapping[str, float] | None) -> None:
        """Write the turn's limits (or "max" where it has none) to the controllers."""
        want = dict(limits or {})
        if want == self.limits:
            return
        if "memory" in self.controllers:
            mb = want.get("memory_mb")
            _write(self.file("memory.max"), "max" if mb is None else str(int(mb * 2**20)))
            with contextlib.suppress(OSError):
                _write(self.file("memory.swap.max"), "max" if mb is None else "0")
        if "pids" in self.controllers:
            n = want.get("pids")
            _write(self.file("pids.max"), "max" if n is None else str(int(n)))
        if "cpu" in self.controllers:
            cores = want.get("cpu")
            quota = "max" if cores is None else str(max(int(cores * _CPU_PERIOD), 1000))
            _write(self.file("cpu.max"), f"{quota} {_CPU_PERIOD}")
        self.limits = want

    def mark(self) -> None:
        """The worker is ready: what it used to start is no turn's."""
        self._cpu_last = self._cpu_usec()

    def begin_turn(self) -> None:
        """Baselines for this turn's figures (the leaf outlives the turn). The CPU one is
        the previous reading (an idle worker uses next to none), so the dispatch path
        reads no file unless the memory controller is on."""
        self._cpu0 = self._cpu_last
        self._oom0 = self._oom_kills()
        if self.limits.get("pids") is not None:
            self._refused0 = self._refused_forks()
        self.end_turn_peak()
        if "memory" in self.controllers:
            with contextlib.suppress(OSError):
                fd = os.open(self.file("memory.peak"), os.O_RDWR)
                try:
                    os.write(fd, b"reset\n")  # per-descriptor reset (Linux 6.12+)
                except OSError:
                    os.close(fd)
                else:
                    self._peak_fd = fd

    def end_turn_peak(self) -> None:
        if self._peak_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._peak_fd)
            self._peak_fd = None

    def _cpu_usec(self) -> int:
        try:
            text = self._read_kept("cpu.stat")
        except OSError:
            return 0
        head = text.partition("\n")[0]
        if head.startswith("usage_usec "):
            return int(head[11:])
        return _keyed(text).get("usage_usec", 0)

    def _read_kept(self, name: str) -> str:
        fd = self._kept.get(name)
        if fd is None:
            fd = self._kept[name] = os.open(self.file(name), os.O_RDONLY)
        return os.pread(fd, 4096, 0).decode()

    def _oom_kills(self) -> int:
        if "memory" not in self.controllers:
            return 0
        try:
            return _keyed(_read(self.file("memory.events"))).get("oom_kill", 0)
        except OSError:
            return 0

    def oom_killed(self) -> bool:
        """The memory limit killed something since ``begin_turn``."""
        return self._oom_kills() > self._oom0

    def _refused_forks(self, events: str | None = None) -> int:
        if "pids" not in self.controllers:
            return 0
        try:
            return _keyed(_read(self.file("pids.events")) if events is None else events).get(
                "max", 0
            )
        except OSError:
            return 0

    def pids_limit_hit(self, events: str | None = None) -> bool:
        """The turn's pids limit refused a fork since ``begin_turn`` (``events``: the text
        of ``pids.events`` when the caller read it already)."""
        if self.limits.get("pids") is None:
            return False
        return self._refused_forks(events) > self._refused0

    def usage(self) -> dict[str, float]:
        """This turn's figures (semantics §15.5), each only where its controller is on."""
        self._cpu_last = now = self._cpu_usec()
        out: dict[str, float] = {"cpu_ms": round((now - self._cpu0) / 1000, 3)}
        if "pids" in self.controllers:
            with contextlib.suppress(OSError, ValueError):
                out["processes"] = float(self._read_kept("pids.peak").strip())
        if self._peak_fd is not None:
            with contextlib.suppress(OSError, ValueError):
                peak = int(os.pread(self._peak_fd, 64, 0).decode().strip())
                out["memory_peak_mb"] = round(peak / 2**20, 3)
        return out


def _pidfds(pids: Iterable[int]) -> list[int]:
    fds = []
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already; or no pidfd_open (Linux < 5.3)
            fds.append(os.pidfd_open(pid))
    return fds


def _wait_exits(fds: list[int], timeout: float) -> None:
    """Until every pidfd says its process exited, or ``timeout``."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    left = len(fds)
    deadline = time.monotonic() + timeout
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0:
            return
        for fd, _ in poller.poll(wait * 1000):
            poller.unregister(fd)
            left -= 1


def kill_leaf(path: str, timeout: float = 5.0) -> bool:
    """``cgroup.kill`` the leaf at ``path`` until it says ``populated 0`` (forks racing a
    kill die too); True once empty (a leaf already gone is empty), False at ``timeout``.
    For a process that holds no ``Leaf`` (the Ray reaper and keeper)."""
    leaf = Leaf(path, frozenset())
    deadline = time.monotonic() + timeout
    while True:
        wait = min(_KILL_WAIT, max(deadline - time.monotonic(), 0.0))
        if leaf.kill(wait=wait, pids=leaf.pids()):
            return True
        if time.monotonic() >= deadline:
            return False


class Cgroups:
    """One host's group: where its workers' leaves are made, found again, removed."""

    def __init__(self, base: str, controllers: frozenset[str]) -> None:
        self.base = base
        self.controllers = controllers
        self._guard: subprocess.Popen[bytes] | None = None
        # This host's leaves carry its own prefix: a dead host's guard clears its own,
        # never those of the next host on the same store (one group per store).
        self.prefix = _owner_prefix()

    def guard(self) -> None:
        """Start the guard that clears this group when the host goes, a SIGKILL
        included (see ``guard``: a paused turn's frozen worker cannot)."""
        script = os.path.join(os.path.dirname(__file__), "guard.py")
        self._guard = subprocess.Popen(
            [sys.executable, "-I", "-S", script, self.base, self.prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a kill of the host's process group spares it
            close_fds=True,
        )

    @classmethod
    def open(cls, store_path: str | None, *, guard: bool = True) -> Cgroups:
        """Find a writable v2 hierarchy, make (or find) this store's group, and clear what
        a previous host left in it. CgroupUnavailable says why not. ``guard``: start the
        guard (a Ray slot does without: each of its children has a keeper that kills its
        leaf, and a guard would outlive the slot as a child of the host)."""
        mount = v2_mount()
        if mount is None:
            raise CgroupUnavailable("no cgroup v2 hierarchy is mounted")
        top = _writable_top(mount)
        base = os.path.join(top, _group_name(store_path))
        try:
            controllers = _make_group(mount, base, store=store_path is not None)
        except OSError as exc:
            raise CgroupUnavailable(f"cannot make a cgroup under {top}: {exc}") from None
        groups = cls(base, controllers)
        groups.recover()
        _remove_dead_memory_groups(top, base)
        if not guard:
            return groups
        try:
            groups.guard()
        except OSError as exc:  # no process to spare: contained, but not past a SIGKILL
            log.error("cgroup.guard_failed", group=base, error=repr(exc))
        return groups

    @classmethod
    def recover_existing(cls, store_path: str) -> None:
        """Without cgroup containment: still clear what a previous host on this store
        left in its group, if it had one (best effort, silent where none is)."""
        mount = v2_mount()
        if mount is None:
            return
        with contextlib.suppress(OSError):
            for parent in _parents(mount, _own_cgroup()):
                base = os.path.join(parent, _GROUP, _store_group(store_path))
                if os.path.isdir(base):
                    cls(base, frozenset()).recover()
                    cls(base, frozenset()).close()

    def leaf(self, name: str) -> Leaf:
        """This host's leaf ``name`` (under its prefix)."""
        return Leaf(os.path.join(self.base, self.prefix + name), self.controllers)

    def leaves(self) -> list[Leaf]:
        """Every leaf in the group, whichever host made it."""
        try:
            names = [n for n in os.listdir(self.base) if os.path.isdir(f"{self.base}/{n}")]
        except FileNotFoundError:
            return []
        return [Leaf(os.path.join(self.base, n), self.controllers) for n in names]

    def recover(self) -> list[str]:
        """Kill and remove every leaf left in this group (by a previous host on the same
        store; this host's own owner mark stays); returns the leaves cleared."""
        cleared = []
        mark = os.path.join(self.base, self.prefix + _OWNER)
        for leaf in self.leaves():
            if leaf.path == mark:
                continue
            try:
                for _ in range(10):
                    if leaf.kill() and leaf.remove():
                        cleared.append(os.path.basename(leaf.path))
                        break
                else:
                    log.error("cgroup.recover_stuck", leaf=leaf.path)
            except OSError as exc:  # one stuck leaf must not stop the host starting
                log.error("cgroup.recover_failed", leaf=leaf.path, error=repr(exc))
        if cleared:
            log.warning("cgroup.recovered", group=self.base, leaves=len(cleared))
        return cleared

    def close(self) -> None:
        """Remove the group once its leaves are gone (another host may hold it: fine),
        and let the guard go (it clears what is left, its owner mark too, then exits)."""
        guard, self._guard = self._guard, None
        if guard is not None:
            assert guard.stdin is not None
            with contextlib.suppress(OSError):
                guard.stdin.close()
            try:
                guard.wait(_GUARD_WAIT)
            except subprocess.TimeoutExpired:
                log.error("cgroup.guard_stuck", pid=guard.pid, group=self.base)
                guard.kill()
                guard.wait()
        with contextlib.suppress(OSError):  # the guard's job, unless there is none
            os.rmdir(os.path.join(self.base, self.prefix + _OWNER))
        with contextlib.suppress(OSError):
            os.rmdir(self.base)

    def missing(self, limits: Iterable[str]) -> list[str]:
        """The controllers ``limits`` need that this group cannot use."""
        return sorted(
            {LIMIT_CONTROLLERS[k] for k in limits if k in LIMIT_CONTROLLERS} - self.controllers
        )


def _writable_top(mount: str) -> str:
    """Where this host's groups go: under the host's own cgroup when it is delegated to
    us (writable), else at the root of the hierarchy (as root). CgroupUnavailable when
    neither is writable."""
    try:
        own = _own_cgroup()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read this process's cgroup: {exc}") from None
    top = next(
        (
            os.path.join(parent, _GROUP)
            for parent in _parents(mount, own)
            if os.access(os.path.join(parent, "cgroup.procs"), os.W_OK)
            and os.access(parent, os.W_OK)
        ),
        None,
    )
    if top is None:
        raise CgroupUnavailable(
            f"the cgroup v2 hierarchy at {mount} is not writable here "
            "(run as root, or inside a delegated cgroup)"
        )
    return top


def _group_name(store_path: str | None) -> str:
    """A file store's group (found again by its next host), or an in-memory store's own
    (named after this process, so any host can tell when it is gone)."""
    if store_path is None:
        ticks = _start_ticks("self") or "0"
        return f"m-{os.getpid()}-{ticks}-{next(_names)}"
    return _store_group(store_path)


def _make_group(mount: str, base: str, *, store: bool) -> frozenset[str]:
    """Make (or, a file ``store``'s, find and mark) the group ``base`` and enable what
    controllers reach it; CgroupUnavailable when the kernel's cgroup v2 lacks what
    containment needs (the group made for it is removed again). OSError: it could not
    be made."""
    owner = _owner_prefix()
    if store:
        _own_store_group(base, owner)
    else:
        os.makedirs(base, exist_ok=True)
    missing = [
        probe
        for probe in ("cgroup.kill", "cgroup.freeze")
        if not os.path.exists(os.path.join(base, probe))
    ]
    if missing:  # cgroup.kill is Linux 5.14+
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(base, owner + _OWNER))
        with contextlib.suppress(OSError):
            os.rmdir(base)
        raise CgroupUnavailable(f"this kernel's cgroup v2 has no {', '.join(missing)}")
    return _enable(mount, base)


def _parents(mount: str, own: str) -> list[str]:
    return list(dict.fromkeys([os.path.join(mount, own.lstrip("/")), mount]))


def _store_group(store_path: str) -> str:
    """A file store's group: found again by the next host on the same store."""
    digest = hashlib.sha256(os.path.realpath(store_path).encode()).hexdigest()
    return f"s-{digest[:16]}"


def _enable(mount: str, base: str) -> frozenset[str]:
    """Enable the wanted controllers from the top of the hierarchy down to ``base``'s
    children, where the kernel offers them; the set that reaches the leaves."""
    rel = os.path.relpath(base, mount)
    chain = [mount]
    for part in rel.split(os.sep):
        chain.append(os.path.join(chain[-1], part))
    reached = frozenset(_WANTED)
    for group in chain:
        offered = set(_read(f"{group}/cgroup.controllers").split())
        on = set(_read(f"{group}/cgroup.subtree_control").split())
        reached = reached & offered
        missing = reached - on
        for ctl in sorted(missing):
            try:
                _write(f"{group}/cgroup.subtree_control", f"+{ctl}")
            except OSError:
                # e.g. EBUSY: a group with processes of its own (the no-internal-process
                # rule) cannot hand a controller down
                reached = reached - {ctl}
    return reached


_OWNER = "owner"  # a host's mark in its store's group: an empty child cgroup
_OWNER_TRIES = 20
_MEM_GROUP = re.compile(r"m-(\d+)-(\d+)-\d+")
_HOST_PREFIX = re.compile(r"h(\d+)-(\d+)-")


def _owner_prefix() -> str:
    """This host's prefix for what it makes in its store's group: its pid and start time."""
    return f"h{os.getpid()}-{_start_ticks('self') or '0'}-"


def _own_store_group(base: str, owner: str) -> None:
    """Make (or find) a file store's group and put this host's mark in it: an empty child
    cgroup named after the host (``h<pid>-<ticks>-owner``). A store's group outlives a
    SIGKILLed host, and any host sweeps such groups (``_sweep_store_group``); the mark
    tells a live host's group from a dead one's, and, being a child, makes the kernel
    refuse the sweep's ``rmdir`` of the group from the moment it exists. A sweep that
    removed the group between its ``makedirs`` and the mark's ``mkdir`` shows as ENOENT:
    make it again. ``makedirs`` itself can lose that race (its ``mkdir`` sees the group,
    its ``isdir`` check no longer does: ``FileExistsError``): the same retry."""
    for _ in range(_OWNER_TRIES):
        try:
            os.makedirs(base, exist_ok=True)
        except FileExistsError:
            continue
        try:
            os.mkdir(os.path.join(base, owner + _OWNER))
        except FileExistsError:
            return
        except FileNotFoundError:
            continue
        return
    raise OSError(errno.ENOENT, f"{base} kept vanishing while it was being made")


def _host_alive(name: str) -> bool | None:
    """Whether the host that made ``name`` (a leaf or mark ``h<pid>-<ticks>-…``) runs;
    None when the name says no host."""
    m = _HOST_PREFIX.match(name)
    if m is None:
        return None
    return _start_ticks(m.group(1)) == m.group(2)


def _remove_dead_memory_groups(top: str, own: str | None = None) -> None:
    """An in-memory store's group whose host process is gone has no successor: any host
    kills and removes it (and sweeps file stores' groups, ``_sweep_store_group``;
    ``own``: this host's group, not swept)."""
    try:
        names = os.listdir(top)
    except OSError:
        return
    for name in names:
        m = _MEM_GROUP.fullmatch(name)
        if m is None:
            group = os.path.join(top, name)
            if name.startswith("s-") and group != own:
                _sweep_store_group(group)
            continue
        if _start_ticks(m.group(1)) == m.group(2):
            continue  # its host still runs
        groups = Cgroups(os.path.join(top, name), frozenset())
        groups.recover()
        with contextlib.suppress(OSError):
            os.rmdir(groups.base)


_ABANDONED_AGE = 60.0  # seconds: an empty leaf this old is no worker's that is starting


def _sweep_store_group(group: str) -> None:
    """A file store's group whose host was SIGKILLed, on a store nobody reopens: its
    workers killed their own leaves on the way out but could not remove them, and the
    group stays. Any host removes such a group once its host is dead and its leaves are
    empty. What the group holds is named after the host that made it (``h<pid>-<ticks>-``):
    a live host's mark or leaf leaves the group alone (but for a dead host's empty leaves
    in it); a dead host's empty leaf or mark goes; a dead host's populated leaf (its
    guard died too) stays, for the next host on that store to kill. Then the group goes
    if nothing is left in it: the kernel refuses the ``rmdir`` if a host made its mark
    meanwhile (see ``_own_store_group``). A leaf named after no host (a host from before
    the marks) goes only once it is empty and old."""
    now = time.time()
    for leaf in Cgroups(group, frozenset()).leaves():
        name = os.path.basename(leaf.path)
        with contextlib.suppress(OSError):
            if leaf.populated():
                continue
            if _host_alive(name) is False or (
                _host_alive(name) is None and now - os.stat(leaf.path).st_mtime > _ABANDONED_AGE
            ):
                os.rmdir(leaf.path)
    with contextlib.suppress(OSError):  # not empty: a live host's, or a populated leaf
        if not any(os.path.isdir(os.path.join(group, n)) for n in os.listdir(group)):
            os.rmdir(group)
            log.info("cgroup.swept", group=group)
