# Two commands for a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

# The JupyterLab extension (labextension/, TypeScript) is built with the venv's jlpm and
# jupyter-builder into alpa_lab/labextension/ and linked into the venv's Jupyter. It needs
# node >= 20; `make demo` does not build it.
LABEXT := labextension
LABEXT_OUT := alpa_lab/labextension/package.json
LABEXT_STAMP := $(VENV)/.labextension
LABEXT_SOURCES := $(wildcard $(LABEXT)/src/*.ts $(LABEXT)/style/*) \
	$(LABEXT)/package.json $(LABEXT)/yarn.lock $(LABEXT)/tsconfig.json $(LABEXT)/.yarnrc.yml
VENV_PATH := PATH="$(abspath $(BIN)):$$PATH"

# `make lab`: kernels see 8 simulated CPU devices and start with `%load_ext alpa_lab` done
# (the python3 kernelspec in labextension/jupyter/ adds --InteractiveShellApp.extensions).
LAB_ENV := XLA_FLAGS="--xla_force_host_platform_device_count=8" JUPYTER_PATH="$(abspath $(LABEXT)/jupyter)"
LAB_ARGS ?=
# JupyterLab refuses to run as root unless told to
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--ServerApp.allow_root=True)

.PHONY: demo test test-slow bench lab labextension wheel clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

$(LABEXT_OUT): $(STAMP) $(LABEXT_SOURCES)
	cd $(LABEXT) && $(VENV_PATH) jlpm install
	cd $(LABEXT) && $(VENV_PATH) jlpm build:prod
	touch $(LABEXT_OUT)

$(LABEXT_STAMP): $(LABEXT_OUT)
	$(VENV_PATH) jupyter-builder develop --overwrite .
	touch $(LABEXT_STAMP)

labextension: $(LABEXT_STAMP)  ## build the JupyterLab extension and install it into the venv's Jupyter

# The wheel carries the prebuilt extension (pyproject.toml's data-files, checked by setup.py):
# installing it needs no node.
wheel: $(STAMP) $(LABEXT_OUT)  ## build the extension, then a wheel carrying it into dist/
	$(BIN)/python -m pip wheel --no-deps -w dist .

demo: $(STAMP)  ## plan and run the example models on a local simulated cluster, headless
	$(BIN)/alpa-lab demo

test: $(STAMP) $(LABEXT_STAMP)  ## the test suite CI runs (slow tests excluded)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP) $(LABEXT_STAMP)  ## only the slow tests
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

bench: $(STAMP)  ## every benchmark script, printing its figures
	for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lab: $(STAMP) $(LABEXT_STAMP)  ## JupyterLab on notebooks/ at 127.0.0.1, with the extension and 8 simulated devices
	mkdir -p notebooks
	$(LAB_ENV) $(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=notebooks $(LAB_ROOT) $(LAB_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build dist alpa_lab/labextension $(LABEXT)/lib $(LABEXT)/tsconfig.tsbuildinfo
