# `make demo` and `make test` each work on a fresh clone: they create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev,ray,rewards,aws,serve,train

.PHONY: setup demo showcase test lint unit bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

# the main job: GRPO on FrozenLake with a tiny torch policy, a local Ray cluster, local
# fabric pools and process containers (5-8 minutes on 2 cores; runs/frozenlake/ holds the
# metrics, plots and summary)
demo: setup
	$(BIN)/fabric run examples/frozenlake/config.yaml

# a one-minute tour of the fabric and envpool (register, call, bench, sessions)
showcase: setup
	$(BIN)/python examples/demo.py

# mypy twice: the sandbox's own programs lie beside the files a run gets, outside the packages
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy functions/verifiers/native/cdecls.py

# three workers on 2 cores, a test module on one (its module-scoped fixtures, such as a Ray
# cluster, start once): many tests wait on processes, sockets and timers, so a third worker
# fills the idle time (6.4 minutes where two took 8.1, when the suite was smaller; now
# 8-10 minutes of tests, make test 9.5-11.5 on a fresh clone; four workers saved 3%, not worth
# more load-sensitive tests); JOBS=0 runs it in this process
JOBS ?= 3
unit: setup
	$(BIN)/python -m pytest -q $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

test: lint unit

bench: setup
	$(BIN)/fabric bench exact_match --backend local --n 20000 --concurrency 64 --baseline ray --json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
