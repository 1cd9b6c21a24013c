# Two commands on a fresh machine: `make lab` (the main job) and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0 triton==3.6.0  # the Triton the kernels are tested with (CPU interpreter, H100/H200)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,explore,serve]'
	touch $@

.PHONY: lab test test-all typecheck clean
lab: $(BIN)/.installed
	$(BIN)/evict recall --quick

test: $(BIN)/.installed
	$(BIN)/python -m pytest -m "not slow" tests

typecheck: $(BIN)/.installed
	$(BIN)/python -m mypy

test-all: $(BIN)/.installed
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV)
