# Two commands on a fresh machine: `make train` and `make test`. Both build .venv first when it is
# missing or pyproject.toml changed (plain venv + pip; torch comes from the pins in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test test-all lint bench bench-training bench-gpu venv help

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# two workers; tests that share a resource carry its xdist_group and run one after another on one
# worker (slurm: the test cluster's CPUs; processes: several processes at once), before the rest
TEST_WORKERS := -n 2 --dist loadgroup

test: $(STAMP)
	$(PY) -m pytest -q $(TEST_WORKERS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(TEST_WORKERS) -m "slow or not slow"

lint: $(STAMP)
	$(PY) -m ruff check src tests train.py
	$(PY) -m ruff format --check src tests train.py

# the attnlab command keeps freed buffers for reuse itself (attnlab.allocator): the timings measure
# the ops, not page faults
bench: $(STAMP)
	$(VENV)/bin/attnlab bench attention $(ARGS)

# training samples/s per backend at each task's real length (docs/benchmarks.md, "CPU: training samples/s per task")
bench-training: $(STAMP)
	$(VENV)/bin/attnlab bench training --threads 1 --repeats 5 $(ARGS)

# the GPU check (scripts/bench_gpu.sh): each Triton op checked against torch on the device first, then
# ops fwd+bwd over T = 1K..64K in bf16/fp16/fp32 and training throughput with MFU, inside BUDGET_S
# (default 480 s); prints the GPU name and a summary. It uses the environment `make venv` built and never
# builds one itself: a GPU node may have no network.
bench-gpu:
	PY=$(PY) OUT=$(or $(OUT),bench_results/gpu) scripts/bench_gpu.sh

help:
	@echo "make train           train the default model (ListOps, sliced ReLU, CPU); overrides in ARGS=\"...\""
	@echo "make test            the fast test suite"
	@echo "make test-all        every test, the slow ones too"
	@echo "make lint            ruff check and ruff format --check"
	@echo "make bench           attention ops: time and memory against sequence length (CPU)"
	@echo "make bench-training  training samples/s per task and backend (CPU, about 7 minutes)"
	@echo "make bench-gpu       the GPU check: Triton ops checked, then timed; training throughput"
	@echo "make venv            build .venv from pyproject.toml (train and test do it when needed)"
	@echo "make help            this list"
