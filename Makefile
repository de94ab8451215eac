# crossover: `make demo` and `make test` set everything up on a fresh machine, then run.
# Inside an active virtualenv/conda env that env is used; otherwise .venv at the repo root.
PY := $(if $(or $(VIRTUAL_ENV),$(CONDA_PREFIX)),python,$(CURDIR)/.venv/bin/python)
PYTEST_ARGS ?=

.PHONY: setup test test-all demo bench lint clean-venv

setup:
	bash scripts/setup.sh

# The default suite (fits CI: under 45 minutes on 2 cores, first Horovod build included).
test: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS) tests

# Everything, the long-running checks marked `slow` included.
test-all: setup
	$(PY) -m pytest $(PYTEST_ARGS) tests

demo: setup
	$(PY) benchmarks/demo.py

bench: setup
	$(PY) -m benchmarks.run_all

lint: setup
	$(PY) -m ruff check .

clean-venv:
	rm -rf .venv
