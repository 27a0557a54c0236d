# Two commands for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)  ## plan and run the example models on a local simulated cluster, headless
	$(BIN)/alpa-lab demo

test: $(STAMP)  ## the test suite CI runs (slow tests excluded)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)  ## only the slow tests
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)  ## every benchmark script, printing its figures
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
