# Two commands on a fresh machine: `make train` and `make test`. Both build .venv first when it is
# missing or pyproject.toml changed (plain venv + pip; torch comes from the pins in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test test-all lint bench venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(PY) -m ruff check src tests train.py
	$(PY) -m ruff format --check src tests train.py

bench: $(STAMP)
	$(VENV)/bin/attnlab bench attention $(ARGS)
