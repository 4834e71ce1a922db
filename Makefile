# Every target works on a fresh machine with only Python 3.11+: .venv is made from
# pyproject.toml when it is missing or older than it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench bench-full clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tether demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy --strict src

test: lint
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks --quick --json benchmarks/results/latest.json

bench-full: $(STAMP)
	$(BIN)/python -m benchmarks --json benchmarks/results/latest.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
