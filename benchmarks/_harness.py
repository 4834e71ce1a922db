"""Runs the cases, aggregates repetitions, prints the table and writes the JSON.

Each case runs in a fresh `python -m benchmarks --run-case NAME` process, in its own
process group: memory figures start from a clean interpreter, one runtime's threads never
disturb another's timings, and a wedged case is killed at its deadline without taking the
run down. The harness makes itself a child subreaper, so anything a case leaves running
(an orphaned tool, a worker that outlived `close()`) is adopted, reported and reaped here.

Statistics: each repetition reduces its samples to one number (p50 or p99); a figure is
the median of those per-repetition numbers, its spread their min-max. The p99 column is
taken over the pooled samples of all repetitions (blank when a repetition yields only one
number, as a throughput does).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

import psutil

from benchmarks import _procs
from benchmarks._case import SCALE_ENV, CaseFunc, Cfg, Samples, Skip, scale
from benchmarks.figures import CASES, FIGURES, FIGURES_BY_NAME, Case, Figure

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"


# ---------------------------------------------------------------- statistics


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (the usual definition; no numpy needed)."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def reduce(samples: list[float], stat: str) -> float:
    return statistics.median(samples) if stat == "p50" else percentile(samples, 99)


# ---------------------------------------------------------------- one case, in a child


@dataclass
class CaseResult:
    reps: list[Samples] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    skipped: bool = False
    seconds: float = 0.0


def _write(out: Path, res: CaseResult) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res.__dict__))
    tmp.replace(out)


def run_case_here(name: str, reps: int, quick: bool, out: Path) -> int:
    """The child side: run `reps` repetitions of one case, saving after each one."""
    case = CASES[name]
    res = CaseResult()
    cfg = Cfg(quick=quick, notes=res.notes)
    t0 = time.monotonic()
    try:
        module, _, attr = case.func.partition(":")
        func = cast(CaseFunc, getattr(importlib.import_module(module), attr))
        gen = func(cfg)
        try:
            for _ in range(reps):
                res.reps.append(next(gen))
                res.seconds = time.monotonic() - t0
                _write(out, res)
        finally:
            gen.close()  # the case's own cleanup (runtime close, peer shutdown) runs here
    except Skip as e:
        res.skipped = True
        cfg.note(f"skipped: {e}")
    except Exception:
        res.error = traceback.format_exc(limit=8)
    stray = _procs.stray_descendants(grace=1.0)
    if stray:
        cfg.note("left running after the case closed: " + "; ".join(map(_procs.describe, stray)))
        _procs.kill_all(p.pid for p in stray)
    res.seconds = time.monotonic() - t0
    _write(out, res)
    return 0


def _run_child(case: Case, reps: int, quick: bool, timeout: float, log: IO[str]) -> CaseResult:
    """One child process running `reps` repetitions of `case`, killed at `timeout`."""
    fd, out_name = tempfile.mkstemp(prefix="bench-", suffix=".json")
    os.close(fd)
    out = Path(out_name)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--run-case",
        case.name,
        "--reps",
        str(reps),
        "--out",
        str(out),
    ] + (["--quick"] if quick else [])
    log.flush()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + max(timeout, 1.0)
    while proc.poll() is None and time.monotonic() < deadline:
        # Reap, while the case runs, the orphans it leaves us (the sleeps of each killed
        # tree). Left as zombies, hundreds would pile up in /proc, where every process
        # scan (the runtime's kill-tree snapshot among them) would wade through them.
        _procs.reap_zombies(exclude=proc.pid)
        time.sleep(0.25)
    timed_out = proc.poll() is None
    if timed_out:
        # Only the case's own group dies here; children in other groups (runtime
        # workers) are orphaned, adopted by us as subreaper, and reaped by the caller.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
    res = CaseResult()
    with contextlib.suppress(OSError, ValueError):
        res = CaseResult(**json.loads(out.read_text()))
    out.unlink(missing_ok=True)
    if timed_out:
        res.error = f"killed at its deadline after {len(res.reps)} repetition(s)"
    elif proc.returncode != 0 and res.error is None:
        res.error = f"case process exited {proc.returncode}"
    return res


def run_case(case: Case, quick: bool, logdir: Path) -> CaseResult:
    """The parent side: a child process per case (or per repetition), within one deadline."""
    reps = case.reps[0] if quick else case.reps[1]
    t0 = time.monotonic()
    deadline = t0 + (case.timeout[0] if quick else case.timeout[1])
    total = CaseResult()
    logfile = logdir / f"{case.name}.log"
    with logfile.open("w") as log:
        for batch in [1] * reps if case.fresh_process_per_rep else [reps]:
            res = _run_child(case, batch, quick, deadline - time.monotonic(), log)
            total.reps += res.reps
            total.notes += [n for n in res.notes if n not in total.notes]
            total.error, total.skipped = res.error, res.skipped
            if res.error or res.skipped:
                break
    if total.error and not total.error.startswith("Traceback"):
        total.error += f" (log: {logfile})"
    total.seconds = time.monotonic() - t0
    leaks = _procs.reap_adopted()
    if leaks:
        total.notes.append("orphans left running: " + "; ".join(leaks))
    return total


# ---------------------------------------------------------------- aggregation


@dataclass
class Row:
    fig: Figure
    value: float | None = None
    per_rep: list[float] = field(default_factory=list)
    p99: float | None = None
    baseline_value: float | None = None
    ratio: float | None = None

    @property
    def passed(self) -> bool | None:
        checks: list[bool] = []
        if self.fig.target and self.value is not None:
            checks.append(self.fig.target.holds(self.value))
        if self.fig.ratio_target and self.ratio is not None:
            checks.append(self.fig.ratio_target.holds(self.ratio))
        has_target = self.fig.target is not None or self.fig.ratio_target is not None
        if not has_target:
            return None
        if self.value is None:
            return False
        return all(checks)

    def json(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else float(f"{x:.6g}")

        return {
            "name": self.fig.name,
            "value": r(self.value),
            "unit": self.fig.unit,
            "baseline": self.fig.baseline,
            "baseline_value": r(self.baseline_value),
            "ratio": r(self.ratio),
            "target": str(self.fig.target) if self.fig.target else None,
            "ratio_target": str(self.fig.ratio_target) if self.fig.ratio_target else None,
            "ok": self.passed,
        }


def aggregate(figures: list[Figure], results: dict[str, CaseResult]) -> list[Row]:
    rows: dict[str, Row] = {}
    for fig in figures:
        row = Row(fig)
        res = results.get(fig.case)
        if res is not None:
            series = [rep[fig.series] for rep in res.reps if rep.get(fig.series)]
            row.per_rep = [reduce(s, fig.stat) for s in series]
            if row.per_rep:
                row.value = statistics.median(row.per_rep)
            if any(len(s) > 1 for s in series):
                row.p99 = percentile([x for s in series for x in s], 99)
        rows[fig.name] = row
    for row in rows.values():
        base = rows.get(row.fig.baseline or "")
        if base is not None and base.value is not None:
            row.baseline_value = base.value
            if row.value is not None and base.value != 0:
                row.ratio = row.value / base.value
    return list(rows.values())


# ---------------------------------------------------------------- output


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def target_text(fig: Figure) -> str:
    """`<= 4, ratio <= 0.2`: the absolute target and the target on value / baseline."""
    parts = [str(fig.target)] if fig.target else []
    if fig.ratio_target:
        parts.append(f"ratio {fig.ratio_target}")
    return ", ".join(parts)


def table(rows: list[Row]) -> str:
    head = [
        "name",
        "median",
        "unit",
        "p99",
        "spread (min-max)",
        "target",
        "ok",
        "baseline",
        "base",
        "ratio",
    ]
    lines = [head]
    for r in rows:
        spread = f"{fmt(min(r.per_rep))} - {fmt(max(r.per_rep))}" if r.per_rep else "-"
        target = target_text(r.fig)
        ok = {True: "pass", False: "MISS", None: ""}[r.passed]
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        lines.append(
            [
                r.fig.name,
                fmt(r.value),
                r.fig.unit,
                fmt(r.p99),
                spread,
                target,
                ok,
                r.fig.baseline or "",
                fmt(r.baseline_value),
                ratio,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    right = {1, 3, 8, 9}
    out = []
    for i, line in enumerate(lines):
        cells = [
            c.rjust(w) if j in right else c.ljust(w)
            for j, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def machine() -> str:
    """CPU model, memory and Python version, for the results table (benchmarks/RESULTS.md)."""
    cpu = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    mem = psutil.virtual_memory().total / 2**30
    return f"{cpu}, {mem:.0f} GiB, Python {platform.python_version()}"


# ---------------------------------------------------------------- selection and main


def _runs(fig: Figure, quick: bool, pats: list[str]) -> bool:
    """A full-only figure runs in --quick only when a pattern names it or its case exactly."""
    if not quick or not CASES[fig.case].full_only:
        return True
    return any(p in (fig.name, fig.case) for p in pats)


def select(only: list[str], quick: bool = False) -> tuple[list[Figure], list[Case]]:
    """Figures matching any pattern (figure or case name, fnmatch), plus their baselines;
    in --quick, without the full-only figures (see `_runs`)."""
    pats = [p for arg in only for p in arg.split(",") if p]
    if not only:
        chosen = [f for f in FIGURES if _runs(f, quick, pats)]
    else:
        matched = [
            f
            for f in FIGURES
            if any(fnmatch.fnmatch(f.name, p) or fnmatch.fnmatch(f.case, p) for p in pats)
        ]
        chosen = [f for f in matched if _runs(f, quick, pats)]
        if not chosen:
            why = (
                "only full-only figures match; in --quick, name one exactly"
                if matched
                else "no figure or case matches"
            )
            raise SystemExit(f"--only {only}: {why}")
        names = {f.name for f in chosen}
        for f in list(chosen):
            if f.baseline and f.baseline not in names:
                chosen.append(FIGURES_BY_NAME[f.baseline])
                names.add(f.baseline)
        chosen.sort(key=FIGURES.index)
    # Cases in the order of CASES, so a run always measures in the same sequence.
    wanted = {f.case for f in chosen}
    return chosen, [c for c in CASES.values() if c.name in wanted]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer repetitions and samples, no full-only case (about 4 minutes on 2 cores)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=RESULTS / "latest.json",
        help="where to write the result rows (default: %(default)s)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="figure or case names (fnmatch patterns, comma-separated, repeatable)",
    )
    p.add_argument("--list", action="store_true", help="list figures and cases, run nothing")
    p.add_argument(
        "--check", action="store_true", help="exit 1 when a target misses or a required case fails"
    )
    # Internal: the child side of run_case.
    p.add_argument("--run-case", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.run_case:
        return run_case_here(args.run_case, args.reps, args.quick, args.out)
    figures, cases = select(args.only, args.quick)
    if args.list:
        for f in figures:
            base = f" (x {f.baseline})" if f.baseline and f.ratio_target else ""
            print(f"{f.name:42} {f.case:24} {target_text(f)}{base}")
        return 0
    _procs.become_subreaper()
    logdir = RESULTS / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, CaseResult] = {}
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    for case in cases:
        print(f"[bench] {case.name} ...", end=" ", file=sys.stderr, flush=True)
        res = results[case.name] = run_case(case, args.quick, logdir)
        status = "skipped" if res.skipped else "FAILED" if res.error else "ok"
        print(f"{status} ({res.seconds:.1f}s, {len(res.reps)} reps)", file=sys.stderr, flush=True)
    rows = aggregate(figures, results)
    mode = "quick" if args.quick else "full"
    # The load average says whether other work shared the machine: every figure here is
    # sensitive to it, the stop latencies most.
    print(
        f"\nTether benchmarks ({mode}, {time.monotonic() - t0:.0f}s, {os.cpu_count()} cpus, "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)"
    )
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}")
    if scale() != 1:
        print(
            f"SCALED: {SCALE_ENV}={scale():g}; figures named for a session count are not "
            "comparable with their targets"
        )
    print()
    print(table(rows))
    notes = [(name, n) for name, res in results.items() for n in res.notes]
    errors = [(name, res.error) for name, res in results.items() if res.error]
    if notes:
        print("\nnotes:")
        for name, n in notes:
            print(f"  {name}: {n}")
    if errors:
        print("\nerrors:")
        for name, e in errors:
            print(f"  {name}: " + (e or "").strip().replace("\n", "\n    "))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r.json() for r in rows], indent=1) + "\n")
    print(f"\nwrote {args.json}")
    missed = [r.fig.name for r in rows if r.passed is False]
    failed = [n for n, res in results.items() if res.error and not CASES[n].optional]
    print(
        f"targets: {sum(r.passed is True for r in rows)} pass, {len(missed)} miss"
        + (f" ({', '.join(missed)})" if missed else "")
    )
    return 1 if args.check and (missed or failed) else 0
