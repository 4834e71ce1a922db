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
count), so this ranks overheads and shows a change's effect; a timed run on a quiet
machine is still the figure's own measure.

Usage: ``python -m benchmarks.instructions [usage|telemetry|watchdog|aa ...] [--reps R]``.
Needs ``valgrind`` on PATH (Debian: ``apt install valgrind``); each case takes a few
minutes (the host runs ~50x slower under callgrind).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def _side(side: str, turns: int) -> None:
    """Run ``turns`` turns of ``side`` in this process (the one callgrind counts)."""
    import tether
    from benchmarks.tether_cases import _SINK

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
            for i in range(turns):
                rt.prompt(roots[i % SESSIONS], "x", data=data)
            for _ in range(turns):
                if not ended.acquire(timeout=900):
                    raise SystemExit(f"{side}: a turn did not end within 900 s")
            for root in roots:
                rt.wait(root, timeout=60)
    finally:
        if sink is not None:
            sink.kill()
            sink.wait()


def _count(side: str, turns: int) -> int:
    """The host's instructions for ``turns`` turns of ``side``, under callgrind."""
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--trace-children=no",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "benchmarks.instructions",
        "--side",
        side,
        str(turns),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{side} x{turns} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def _per_turn(side: str) -> float:
    return (_count(side, HIGH) - _count(side, LOW)) / (HIGH - LOW)


def run(case: str, reps: int) -> dict[str, Any]:
    """``reps`` rounds of base, other, other, base; the overhead per round, in percent."""
    base, other = CASES[case]
    rounds: list[dict[str, Any]] = []
    pcts: list[float] = []
    for _ in range(reps):
        b1, o1, o2, b2 = _per_turn(base), _per_turn(other), _per_turn(other), _per_turn(base)
        pct = ((o1 + o2) / (b1 + b2) - 1) * 100
        rounds.append({"base": [b1, b2], "other": [o1, o2], "overhead_pct": pct})
        pcts.append(pct)
        print(
            f"{case}: base {b1:,.0f} {b2:,.0f}  other {o1:,.0f} {o2:,.0f} instructions/turn"
            f"  overhead {pct:+.2f} %",
            flush=True,
        )
    print(f"{case}: overhead median {statistics.median(pcts):+.2f} % over {reps} round(s)")
    return {"case": case, "rounds": rounds, "overhead_pct_median": statistics.median(pcts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("cases", nargs="*", default=["usage", "telemetry", "watchdog"])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--side", nargs=2, metavar=("SIDE", "TURNS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side is not None:
        _side(args.side[0], int(args.side[1]))
        return 0
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if shutil.which("valgrind") is None:
        print("needs valgrind on PATH (Debian: apt install valgrind)", file=sys.stderr)
        return 2
    for case in args.cases:
        run(case, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
