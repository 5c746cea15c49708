# Two commands on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test lint install clean

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

## test: install the test tools, lint, run the test suite
test: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/pytest

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
