# The few targets a newcomer needs. Both `demo` and `test` set up .venv first if needed:
# torch 2.13.0 (the CPU wheel) goes in before anything else, and every later install is
# constrained to it so pip never swaps in a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.realrl-installed
ARGS ?=
# Test files run on this many pytest processes (pytest-xdist; one file stays on one process, so
# a module's fixtures are built once). Most of a CLI test is process start-up, which leaves a
# core idle: two at once take about two thirds of the time on 2 cores. 0: one process.
TEST_PROCESSES ?= 2

.PHONY: demo test test-fast lint format docs clean-venv

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m realrl.apps.quickstart ppo-math $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile -m "not slow" $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check realrl tests benchmarks examples
	$(PY) -m mypy

format: $(STAMP)
	$(PY) -m ruff format realrl tests benchmarks examples

docs: $(STAMP)
	$(PY) -m realrl.apps.config_reference > docs/config.md

clean-venv:
	rm -rf $(VENV)
