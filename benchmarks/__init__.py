"""Tether's benchmark harness (issue 5): `python -m benchmarks [--quick] [--json PATH]`.

Layout:
  figures.py       the named figures, their targets and baselines (the contract other checks read)
  _harness.py      runs each case in its own process, aggregates repetitions, prints, writes JSON
  _case.py         what a case gets (Cfg: sample counts, notes) and may raise (Skip)
  _procs.py        process-tree helpers shared by the stop measurements (wedge, find, wait dead)
  tether_cases.py  the Tether measurements
  baselines.py     the floors each Tether figure is compared with
  peers.py         other runtimes measured in the same run (pykka, Thespian, anyio, Ray)
  _thespian_actor.py  Thespian's echo actor (importable only where thespian is installed)
  drivers.py       benchmark-only drivers that Tether workers import by name
  adapter_cases.py the framework adapters' cancel (issue 27), and the Claude Code CLI's floor
  adapter_agents.py  the framework agents those cases' workers build by name

A case is a generator: it sets up once, then yields one dict of sample series per
repetition, so setup cost (a Ray cluster, 10,000 sessions) is paid where the case chooses.
`python -m benchmarks --list` names every figure; `--only NAME` (figure or case, fnmatch)
runs a selection together with the baselines it is compared with. `--quick` leaves out the
full-only cases (a million sessions) unless `--only` names one exactly.

For development on a small machine, `TETHER_BENCH_SCALE=0.05` runs the large-session cases
(10k, 100k, 1M sessions, the 1,000 loaded sessions) at that fraction of their counts; the
run's header and each scaled case's notes say so, and their figures are then not
comparable with the targets.
"""
