# Tandem: one-command install, test, run.  A fresh machine needs only `make test` or `make run`.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
PYTEST    := $(BIN)/python -m pytest
export TANDEM_HOME ?= $(CURDIR)/.tandem

.PHONY: install test test-slow run bench lint clean

install: $(STAMP)

# torch first: on these machines `pip install torch==2.13.0` resolves to the local CPU build;
# the project's pin then finds it already satisfied and pulls no CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: install
	$(PYTEST) -q -m "not slow" tests

test-slow: install
	$(PYTEST) -q -m slow tests

run: install
	$(BIN)/python -m examples.demo

bench: install
	@for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .tandem .pytest_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
