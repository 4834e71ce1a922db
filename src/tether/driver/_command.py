"""What running a command takes in the worker, apart from killing its tree: the
permission check, the tag in its environment, and reading its pipes until it exits.

The kill walk (``tether.contain.procs``) stays with the worker: a context reaches it through
its ``WorkerPort`` (``_turn.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Iterator

from tether.wire.errors import error_from_code

__all__ = [
    "COMMAND_ENV",
    "EXIT_POLL",
    "check_command",
    "command_ids",
    "drain",
    "exit_waits",
    "pidfd",
    "read_some",
    "wait_exit",
]


def wait_exit(
    proc: subprocess.Popen[bytes],
    bufs: dict[int, bytearray],
    timeout: float | None,
    kill: Callable[[subprocess.Popen[bytes]], None],
) -> None:
    """Collect the command's output until the command itself exits (or times out).

    Not until its pipes close: a background child (``sleep 30 &``) keeps them open long
    after the command is done, and a turn waiting for that has no boundary, so neither
    cancel nor preempt could end it. What the command wrote last is read by ``drain``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    exit_fd = pidfd(proc.pid)
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ)  # readable once the command exits
        try:
            for wait in exit_waits(proc, deadline, exit_fd, kill):
                for key, _ in sel.select(wait):
                    if key.fd != exit_fd and not read_some(key.fd, bufs[key.fd]):
                        sel.unregister(key.fd)  # end of that pipe
        finally:
            if exit_fd is not None:
                os.close(exit_fd)


EXIT_POLL = 0.05  # without pidfd_open, how often to look for the command's exit


def exit_waits(
    proc: subprocess.Popen[bytes],
    deadline: float | None,
    exit_fd: int | None,
    kill: Callable[[subprocess.Popen[bytes]], None],
) -> Iterator[float | None]:
    """How long to wait, each time, for the command's next output or its exit (None: until
    one comes), until it has exited; past ``deadline`` it is killed and reaped instead.
    One loop for both waits: ``wait_exit``'s selector and the async context's readers."""
    while proc.poll() is None:
        wait = EXIT_POLL if exit_fd is None else None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                kill(proc)
                proc.wait()
                return
            wait = left if wait is None else min(wait, left)
        yield wait


def pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # an old kernel, or the command already exited and was reaped


def read_some(fd: int, buf: bytearray) -> bool:
    """Read what is there; False at the end of the pipe."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return True
    buf += chunk
    return bool(chunk)


def drain(fd: int, buf: bytearray) -> None:
    with contextlib.suppress(OSError):
        os.set_blocking(fd, False)
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            buf += chunk


# Set in each command's environment to a tag of its own (see ``run_command``).
COMMAND_ENV = "TETHER_COMMAND"
command_ids = itertools.count(1)


def check_command(permissions: dict[str, str], argv: list[str]) -> None:
    """``run_command``'s input and permission, checked before anything runs."""
    if permissions.get("run_command", "allow") == "deny":
        raise error_from_code(
            "subagent-unauthorized", "run_command is denied by this session's permissions"
        )
    if not argv or not all(isinstance(a, str) for a in argv):
        raise error_from_code("invalid-params", "argv must be a non-empty list of strings")
