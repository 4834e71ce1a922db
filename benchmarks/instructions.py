"""The overhead figures counted in instructions, not timed: ``make bench-instructions``.

``usage_frame_overhead_pct``, ``telemetry_overhead_pct`` and ``watchdog_overhead_pct``
compare two sides' host CPU per turn; on a shared 2-vCPU VM that instrument reads an A/A
difference to ±10 % (benchmarks/RESULTS.md), twice the 5 % each figure is held to. Here
each side runs in a process of its own under Valgrind's callgrind, which counts the
instructions the host process executes (every thread of it, none of its workers: they
are started by exec and run natively). A side is run for ``low`` and ``high`` turns and
its cost per turn is the difference over ``high - low`` turns, so the start-up and the
imports drop out. The count does not move with the machine's load; what still moves it
is how the host's threads interleave (its batches), which callgrind's serialized
threads make steadier than a timed run: A/A pairs agree to about 1 %.

An instruction is not a microsecond (a cache miss or a futex wait costs more than its
count), but these three figures are decided by this count, since it can resolve 5 % here
and the timed one cannot; the timed cases stay in ``make bench`` beside it
(docs/DECISIONS.md, "Overhead figures").

One timer differs between the usage case's sides: the store writes running turns'
reported usage ``_USAGE_EVERY`` (0.25 s) after the first report held. Callgrind runs the
host tens of times slower, so at that interval the write would come as many times more
often per turn than natively, and count as the reports' cost. The case first measures
the slow-down on its usage side (the turns' wall time under callgrind against native)
and scales the interval by it, so the write's rate per turn is native; ``--raw`` keeps
the store's own interval.

Usage: ``python -m benchmarks.instructions [usage|telemetry|watchdog|aa ...] [--reps R]
[--raw]``; each case's figure against its target is printed and written to
``benchmarks/results/instructions.json``. Needs ``valgrind`` on PATH (Debian: ``apt
install valgrind``); each case takes a few minutes (the host runs ~50x slower under
callgrind).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

LOW, HIGH = 100, 500
SESSIONS = 8
# Each case: (base side, other side); a side names what its runtime and prompts get.
CASES: dict[str, tuple[str, str]] = {
    "usage": ("responder", "responder+usage"),  # 3 replies a turn; usage with each, budget
    "telemetry": ("scripted", "scripted+otlp"),  # spans exported to a sink on loopback
    "watchdog": ("scripted", "scripted+stall"),  # a stall policy on every session
    "aa": ("scripted", "scripted"),  # the instrument's own floor
}
# The figure each case decides (docs/DECISIONS.md, "Overhead figures"), all held to 5 %.
FIGURES = {
    "usage": "usage_frame_overhead_pct",
    "telemetry": "telemetry_overhead_pct",
    "watchdog": "watchdog_overhead_pct",
}
TARGET_PCT = 5.0
OUT = Path(__file__).parent / "results" / "instructions.json"
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")
_AGREE = 0.05  # a side's two readings in a round further apart than this: run it again
_WALL = "turns' wall seconds:"
_WALL_RE = re.compile(_WALL + r" ([\d.e+-]+)")
# valgrind's own lines (such as its warning for pidfd_open, which it does not emulate)
# and the side's wall time
_QUIET = re.compile(r"==\d+==|--\d+--|" + _WALL)


def _side(side: str, turns: int, usage_every: float | None = None) -> None:
    """Run ``turns`` turns of ``side`` in this process (the one callgrind counts) and
    print the turns' wall seconds. ``usage_every``: the store's usage write interval
    instead of its own (see ``_usage_every``)."""
    import tether
    import tether.runtime.store
    from benchmarks.tether_cases import _SINK

    if usage_every is not None:
        tether.runtime.store._USAGE_EVERY = usage_every

    base, _, extra = side.partition("+")
    driver = "benchmarks.drivers:Responder" if base == "responder" else "tether:Scripted"
    data: dict[str, Any] | None = (
        {"responses": 3, "usage": extra == "usage"} if base == "responder" else None
    )
    spawn: dict[str, Any] = {}
    if extra == "usage":
        spawn["budget"] = {"tokens": 10**15}
    if extra == "stall":
        spawn["stall"] = {"after": 60.0}
    sink = None
    telemetry: Any = False
    if extra == "otlp":
        sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
        assert sink.stdout is not None
        telemetry = {"endpoint": f"http://127.0.0.1:{sink.stdout.readline().strip()}"}
    ended = threading.Semaphore(0)

    def on_event(ev: Any) -> None:
        if ev.name == "turn.ended":
            ended.release()

    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-instr-") as d,
            tether.Runtime(Path(d) / "t.db", workers=2, telemetry=telemetry) as rt,
        ):
            roots = [rt.open_session(driver, **spawn) for _ in range(SESSIONS)]
            rt.subscribe(on_event)
            began = time.monotonic()
            for i in range(turns):
                rt.prompt(roots[i % SESSIONS], "x", data=data)
            for _ in range(turns):
                if not ended.acquire(timeout=900):
                    raise SystemExit(f"{side}: a turn did not end within 900 s")
            took = time.monotonic() - began
            for root in roots:
                rt.wait(root, timeout=60)
    finally:
        if sink is not None:
            sink.kill()
            sink.wait()
    print(f"{_WALL} {took}", file=sys.stderr)


def _run_side(
    side: str, turns: int, usage_every: float | None, *, counted: bool = True
) -> tuple[int, float]:
    """The host's instructions for ``turns`` turns of ``side`` under callgrind (0 when
    not ``counted``: run natively), and the turns' wall seconds."""
    cmd = [sys.executable, "-m", "benchmarks.instructions", "--side", side, str(turns)]
    if usage_every is not None:
        cmd += ["--usage-every", repr(usage_every)]
    if counted:
        grind = ["valgrind", "--tool=callgrind", "--trace-children=no"]
        cmd = [*grind, "--callgrind-out-file=/dev/null", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    found = _REFS.search(done.stderr)
    wall = _WALL_RE.search(done.stderr)
    if done.returncode != 0 or wall is None or (counted and found is None):
        raise SystemExit(f"{side} x{turns} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    said = [ln for ln in done.stderr.splitlines() if not _QUIET.match(ln)]
    if said:  # the host logged something: shown, since it may be what a reading counted
        print(f"  {side} x{turns} logged:\n    " + "\n    ".join(said[-40:]), flush=True)
    return (int(found.group(1).replace(",", "")) if found else 0), float(wall.group(1))


def _per_turn(side: str, usage_every: float | None) -> float:
    high = _run_side(side, HIGH, usage_every)[0]
    return (high - _run_side(side, LOW, usage_every)[0]) / (HIGH - LOW)


def _usage_every(side: str) -> float:
    """The store's usage write interval that keeps its writes per turn native under
    callgrind. That write is timed (``_USAGE_EVERY`` after the first report held), and
    callgrind runs the host tens of times slower, so at its own interval it would come
    that many times more often per turn than natively and count as the reports' cost.
    The interval is scaled by the ratio of the turns' wall time under callgrind to
    native, both measured here on ``side``."""
    from tether.runtime.store import _USAGE_EVERY

    native = _run_side(side, HIGH, None, counted=False)[1] / HIGH
    slowed = _run_side(side, LOW, None)[1] / LOW
    scaled = _USAGE_EVERY * slowed / native
    print(
        f"  the usage write: callgrind runs the turns {slowed / native:.0f}x slower here,"
        f" so its interval is {scaled:.1f} s, not {_USAGE_EVERY} s",
        flush=True,
    )
    return scaled


def run(case: str, reps: int, *, raw: bool = False) -> dict[str, Any]:
    """``reps`` rounds of base, other, other, base; the overhead per round, in percent.
    The usage case keeps the usage write's native rate per turn unless ``raw``."""
    base, other = CASES[case]
    rounds: list[dict[str, Any]] = []
    every = _usage_every(other) if case == "usage" and not raw else None
    discarded: list[dict[str, Any]] = []
    while len(rounds) < reps:
        b1, o1 = _per_turn(base, every), _per_turn(other, every)
        o2, b2 = _per_turn(other, every), _per_turn(base, every)
        pct = ((o1 + o2) / (b1 + b2) - 1) * 100
        got = {"base": [b1, b2], "other": [o1, o2], "overhead_pct": pct}
        apart = max(abs(b1 - b2) / min(b1, b2), abs(o1 - o2) / min(o1, o2))
        if apart > _AGREE and len(discarded) < reps:
            # a side's readings agree to ~1 % (its A/A); far apart, one of them counted
            # something other than turns (seen twice, on a machine busy with other runs)
            print(f"{case}: a side's two readings are {apart:.0%} apart {got}: run again")
            discarded.append(got)
            continue
        rounds.append(got)
        print(
            f"{case}: base {b1:,.0f} {b2:,.0f}  other {o1:,.0f} {o2:,.0f} instructions/turn"
            f"  overhead {pct:+.2f} %",
            flush=True,
        )
    median = statistics.median(r["overhead_pct"] for r in rounds)
    figure = FIGURES.get(case)
    verdict = ""
    if figure is not None:
        verdict = f": {figure} {'holds' if median <= TARGET_PCT else 'MISSED'} (<= {TARGET_PCT:g})"
    print(f"{case}: overhead median {median:+.2f} % over {reps} round(s){verdict}")
    return {
        "case": case,
        "figure": figure,
        "usage_every_s": every,
        "target_pct": TARGET_PCT if figure is not None else None,
        "rounds": rounds,
        "discarded": discarded,
        "overhead_pct_median": median,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("cases", nargs="*", default=["usage", "telemetry", "watchdog"])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--raw",
        action="store_true",
        help="usage: keep the store's own usage write interval (callgrind slows the host"
        " tens of times, so that write then comes as many times more often per turn)",
    )
    parser.add_argument("--side", nargs=2, metavar=("SIDE", "TURNS"), help=argparse.SUPPRESS)
    parser.add_argument("--usage-every", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side is not None:
        _side(args.side[0], int(args.side[1]), args.usage_every)
        return 0
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if shutil.which("valgrind") is None:
        print("needs valgrind on PATH (Debian: apt install valgrind)", file=sys.stderr)
        return 2
    results = [run(case, args.reps, raw=args.raw) for case in args.cases]
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"unit": "host instructions per turn", "cases": results}, indent=2))
    print(f"written to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
