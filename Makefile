# crossover: `make demo` and `make test` set everything up on a fresh machine, then run.
# Inside an active virtualenv/conda env that env is used; otherwise .venv at the repo root.
PY := $(if $(or $(VIRTUAL_ENV),$(CONDA_PREFIX)),python,$(CURDIR)/.venv/bin/python)
PYTEST_ARGS ?=

.PHONY: setup test test-all test-tf setup-tf demo bench lint clean-venv

setup:
	bash scripts/setup.sh

# The default suite (fits CI: under 45 minutes on 2 cores, first Horovod build included).
test: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS) tests

# Everything, the long-running checks marked `slow` included.
test-all: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests

# TensorFlow: a separate environment (TF_VENV, default .venv-tf) with TensorFlow, tf-keras and a
# Horovod built with its TensorFlow ops (cached wheel), then the TensorFlow tests (marker `tensorflow`).
TF_VENV ?= $(CURDIR)/.venv-tf

setup-tf:
	@test -x $(TF_VENV)/bin/python || python3 -m venv $(TF_VENV)
	env -u CONDA_PREFIX VIRTUAL_ENV=$(TF_VENV) PATH=$(TF_VENV)/bin:$$PATH WITH_TF=1 bash scripts/setup.sh

test-tf: setup-tf
	$(TF_VENV)/bin/python -m pytest -m tensorflow $(PYTEST_ARGS) tests

demo: setup
	$(PY) benchmarks/demo.py

bench: setup
	$(PY) -m benchmarks.run_all

lint: setup
	$(PY) -m ruff check .

clean-venv:
	rm -rf .venv $(TF_VENV)
