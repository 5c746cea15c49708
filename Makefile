# Two commands on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test test-slow test-isa typecheck lint install clean docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.installed
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

## demo: set up .venv, fetch MNIST (cached), run FedAvg vs FedSGD (2NN, non-IID) -> runs/demo/
demo: $(VENV)/.installed
	$(BIN)/fedax data fetch mnist
	$(BIN)/fedax demo --out runs/demo

# The multi-device and cross-strategy tests again under another vector ISA (x86 only), which
# reduces floats in other orders: they must hold the README's guarantee on any CPU.
# (tests/test_algorithms_common.py, test_nan_safety.py and test_fused_sum.py pass there too;
# run them by hand with these flags.)
ISA_TESTS := tests/test_runner.py tests/test_federated.py tests/test_device_data.py
# ... less the tests there that compare nothing across orders (CLI plumbing, same-seed runs),
# and the `fedax run --devices` subprocess test, whose numbers the in-process
# test_rounds_sharded_over_devices_equal_one_device checks here at 2 and 8 devices (26 s saved).
ISA_SKIP := not builds_every_algorithm and not writes_metrics and not same_seed \
	and not leaves_the_callers and not bad_config and not devices_flag_shards

# The suite runs on every core (pytest-xdist, one test file per worker so that a file's
# compiled programs and module fixtures are made once); the tests marked `serial` (network
# deadlines of a few seconds) then run by themselves, two files at a time at most (they
# mostly wait on the network: 3m50s against 6m20s on 2 cores, the same results).
# PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= auto
PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
SERIAL_WORKERS ?= 2
SERIAL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(SERIAL_WORKERS) --dist loadfile)

## typecheck: mypy over all of src/fedax ([tool.mypy] in pyproject.toml; no errors allowed)
typecheck: $(VENV)/.test-installed
	$(BIN)/mypy

## test: install the test tools, lint, type-check, run the test suite
test: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest $(PARALLEL) -m "not serial and not slow"
	$(BIN)/pytest $(SERIAL) -m "serial and not slow"

## test-slow: the end-to-end reproductions and long docs pages that CI leaves out (20 minutes)
test-slow: $(VENV)/.test-installed
	$(BIN)/pytest $(PARALLEL) -m "slow and not serial"
	$(BIN)/pytest $(SERIAL) -m "slow and serial"

## test-isa: the multi-device tests again at AVX2 (x86), as before a release; CI leaves them
## out to stay within its 20 minutes
test-isa: $(VENV)/.test-installed
	@if [ "$$(uname -m)" = x86_64 ]; then \
	  echo "== multi-device tests with XLA_FLAGS=--xla_cpu_max_isa=AVX2"; \
	  XLA_FLAGS="$$XLA_FLAGS --xla_cpu_max_isa=AVX2" $(BIN)/pytest $(PARALLEL) $(ISA_TESTS) \
	    -k "$(ISA_SKIP)"; \
	fi

$(VENV)/.docs-installed: pyproject.toml $(VENV)/.installed
	$(PIP) install -e '.[docs]'
	touch $@

## docs: build the documentation site into site/ (mkdocs.yml; warnings are errors)
docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache .mypy_cache

# --- Benchmarks (benchmarks/README.md) ------------------------------------------------------
# PyTorch and Flower are never dependencies of fedax: they live in their own venv, built on
# demand. torch is installed FIRST and pinned in every later install, so that nothing that
# depends on it (flwr, ray) pulls in another (multi-GB CUDA) build.
BENCH_VENV := .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_PIP := $(BENCH_BIN)/python -m pip --disable-pip-version-check -q
BENCH_TORCH := torch==2.13.0
BENCH_ROUNDS_2NN ?= 10
BENCH_ROUNDS_CNN ?= 4

.PHONY: bench-env bench

$(BENCH_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	echo '*' > $(BENCH_VENV)/.gitignore
	$(BENCH_PIP) install --upgrade pip
	$(BENCH_PIP) install '$(BENCH_TORCH)'
	$(BENCH_PIP) install '$(BENCH_TORCH)' 'flwr[simulation]' psutil threadpoolctl
	# pfl 0.6.0 pins dp-accounting<0.6 (pip downgrades it to 0.5.1); the next step puts back
	# fedax's dp-accounting 0.6 (pip then reports pfl's pin as a conflict). pfl's own
	# accountants are unused here, and they import with 0.6.
	$(BENCH_PIP) install '$(BENCH_TORCH)' 'pfl[pytorch]==0.6.0'
	$(BENCH_PIP) install '$(BENCH_TORCH)' -e .
	$(BENCH_BIN)/python -c "import torch, flwr, ray, pfl, fedax; print('bench env: torch', torch.__version__, 'flwr', flwr.__version__, 'ray', ray.__version__, 'pfl', pfl.__version__)"
	touch $@

## bench-env: build .venv-bench (torch CPU, flwr[simulation], pfl[pytorch], psutil, threadpoolctl, fedax)
bench-env: $(BENCH_VENV)/.installed

## bench: fedax vs PyTorch vs Flower vs pfl vs the FLOP/s limit, 2NN and CNN -> benchmarks/results/
bench: $(BENCH_VENV)/.installed
	$(BENCH_BIN)/python benchmarks/compare.py 2nn --rounds $(BENCH_ROUNDS_2NN)
	$(BENCH_BIN)/python benchmarks/compare.py cnn --rounds $(BENCH_ROUNDS_CNN)
