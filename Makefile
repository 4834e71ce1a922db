# Every target works on a fresh machine with only Python 3.11+: .venv is made from
# pyproject.toml when it is missing or older than it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

RAY_STAMP := $(VENV)/.installed-ray
# pytest processes for `make test` and `make test-walk` (pytest-xdist); 0: one process.
# The Ray suite runs in one: it shares one Ray instance across the session.
TEST_WORKERS ?= 2
XDIST  = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

.PHONY: demo demo-agent demo-adapters test test-unit test-install test-walk test-ray lint browser tmux bench bench-full bench-instructions bench-ray soak soak-ray clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench,agents,pydantic-ai,openai-agents,claude,otel]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tether demo

# Model agents (tether.agents:ChatAgent) against the local scripted model server: no key,
# no network. A steer mid-stream, a cancel cutting a streamed reply, a preempt of a hung tool.
demo-agent: $(STAMP)
	$(BIN)/tether demo --agent

# Agents of other frameworks (Pydantic AI, the OpenAI Agents SDK, Claude Code's bundled
# CLI) against the same server: a steer, a cancel mid-stream, an abort of a Bash command's
# setsid escapee that leaves no process.
demo-adapters: $(STAMP)
	$(BIN)/tether demo --adapters

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy --strict src tests benchmarks

# The Ray cases (marker `ray`, `ray_cluster`) run under `make test-ray`, which installs
# the extra tether-runtime[ray]; `make test` leaves them out (without Ray they would only skip).
test: lint
	$(BIN)/python -m pytest $(XDIST) -m "not ray and not ray_cluster"

# The tests marked `unit`: one process, no worker, no server (a process start fails the
# test), about 70 s of CPU: the state machines, outcomes, records, codecs, the store.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -m unit -q

# The install test alone (marker `install`; `make test` runs it too): the wheel built from
# this checkout, in a fresh venv with the extra [pydantic-ai] only, runs a Pydantic AI agent.
test-install: $(STAMP)
	$(BIN)/python -m pytest -m install -q

# The suites that freeze and kill process trees once more with the walk forced (semantics
# §15.5): `make test` uses cgroup containment where the machine allows it (root in CI does),
# this covers the fallback. (The interrupt suite's trees are the same trees, killed by the
# same code as test_containment's and test_faults', which run both paths.)
# The tests marked host_decides are left out: no process of a turn decides their outcome.
test-walk: $(STAMP)
	TETHER_CONTAINMENT=walk $(BIN)/python -m pytest $(XDIST) -m "not ray and not ray_cluster and not host_decides" \
	  tests/engine/test_pause.py tests/engine/test_faults.py tests/engine/test_containment.py

$(RAY_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench,agents,pydantic-ai,openai-agents,claude,otel,ray]'
	touch $(RAY_STAMP)

# Every Ray case: the interrupt and core suites on Ray, tests/on_ray/test_ray.py (one Ray
# instance for the session: ray.init takes seconds), and the two-node cluster tests
# (tests/on_ray/test_ray_cluster.py, a ray.cluster_utils.Cluster of their own). CI runs it.
test-ray: $(RAY_STAMP)
	$(BIN)/python -m pytest -m "ray or ray_cluster"

# Debian's headless Chromium for the browser tests (tests/faces/test_console.py). Playwright
# drives it through executable_path: `playwright install` cannot download browsers here.
# Idempotent: apt runs only when the package is missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if dpkg -s chromium-headless-shell >/dev/null 2>&1; then \
	  echo "browser: chromium-headless-shell is installed"; \
	else \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y --no-install-recommends chromium-headless-shell; \
	fi

# tmux, for the terminal UI's test in a real terminal (tests/faces/test_tui.py: keys sent
# with send-keys, the screen read with capture-pane). Idempotent, as `make browser`.
tmux:
	@if command -v tmux >/dev/null 2>&1; then \
	  echo "tmux: installed"; \
	else \
	  $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tmux; \
	fi

bench: $(STAMP)
	$(BIN)/python -m benchmarks --quick --json benchmarks/results/latest.json

bench-full: $(STAMP)
	$(BIN)/python -m benchmarks --json benchmarks/results/latest.json

# The overhead figures (usage, telemetry, watchdog) counted in host instructions under
# Valgrind's callgrind, which the machine's load does not move (benchmarks/instructions.py).
bench-instructions: $(STAMP)
	$(BIN)/python -m benchmarks.instructions --reps 2

# The chaos run of issue 10 (benchmarks/soak.py): 10 minutes, checked against its ledger;
# figures in benchmarks/results/soak.json. SEED=2 make soak for another seed;
# make soak-ray runs it on the Ray backend (each host starts its own Ray).
SEED    ?= 1
MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak --minutes $(MINUTES) --seed $(SEED)

soak-ray: $(RAY_STAMP)
	$(BIN)/python -m benchmarks.soak --minutes $(MINUTES) --seed $(SEED) --backend ray

bench-ray: $(RAY_STAMP)
	$(BIN)/python -m benchmarks --quick --only 'ray_*' --json benchmarks/results/ray.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
