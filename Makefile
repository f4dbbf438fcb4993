# Two commands for a fresh machine:  `make demo` (tiny GRPO run on CPU)  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlsp-installed

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): setup.py requirements/cpu-constraints.txt scripts/install.sh
	bash scripts/install.sh

demo: setup
	$(PY) -m rlsp.main $(ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)
	$(VENV)/bin/lint-imports

test-fast: setup
	$(PY) -m pytest -m "not e2e and not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check rlsp tests benchmarks recipes
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) benchmarks/defaults_vs_trl.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
