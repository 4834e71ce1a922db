"""A process that hides from a stop the way a careless build script does, and a way to
find it: for tests and demos of containment (semantics §15.5)."""

from __future__ import annotations

import contextlib

import psutil

__all__ = ["escapee", "escapee_loop", "escapee_procs"]


def escapee(token: str, then: str = "sleep 60") -> str:
    """A shell command that leaves a process behind: a double fork, ``setsid``, its
    environment cleared, renamed ``token`` (its argv[0]), deaf to SIGTERM, looping; the
    command itself then runs ``then`` (which keeps its tool call running)."""
    inner = 'trap \\"\\" TERM; while :; do sleep 0.05; done'
    return f"( ( exec env -i setsid bash -c 'exec -a {token} bash -c \"{inner}\"' ) & ) & {then}"


def escapee_procs(token: str) -> list[psutil.Process]:
    """Live processes whose argv[0] is ``token``, and their descendants."""
    out: list[psutil.Process] = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = p.info["cmdline"] or []
            if cmd and cmd[0] == token and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
                out.extend(p.children(recursive=True))
    return out


def escapee_loop(procs: list[psutil.Process], token: str) -> list[psutil.Process]:
    """The escapee's loop among ``procs`` (as ``escapee_procs`` found them): named
    ``token``, and not a fork of it that has yet to exec its next ``sleep`` (such a fork
    is named ``token`` too, for a moment)."""
    named: dict[int, int] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.cmdline()[:1] == [token]:
                named[p.pid] = p.ppid()
    return [p for p in procs if p.pid in named and named[p.pid] not in named]
