# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpool-installed
PYTEST_ARGS ?=

.PHONY: demo test lint venv sysdeps clean protos

$(STAMP): pyproject.toml
	bash scripts/sysdeps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvpool demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) scripts/lint_imports.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) scripts/lint_imports.py
	$(PY) -m pytest -q $(PYTEST_ARGS)

protos: $(STAMP)
	$(PY) -m kvpool.proto.generate

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
