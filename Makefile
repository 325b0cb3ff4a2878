# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpool-installed
PYTEST_ARGS ?=

.PHONY: demo test lint venv sysdeps clean protos

# Each install step says what it is doing; pip's own lines are cut to one per package (Collecting ...),
# so a log shows progress without pages of output, and a failing pip still fails the step (pipefail).
PIP_PROGRESS := { grep --line-buffered -E '^(Collecting|Successfully installed)' || true; } | sed -u 's/^/    /'

$(STAMP): pyproject.toml
	@echo "[1/4] system packages (scripts/sysdeps.sh)"
	bash scripts/sysdeps.sh
	@echo "[2/4] virtual environment $(VENV) with current pip and setuptools"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@echo "[3/4] torch 2.13.0 (the CPU wheel on this disk)"
	bash -o pipefail -c "$(PY) -m pip install torch==2.13.0 | $(PIP_PROGRESS)"
	@echo "[4/4] kvpool and its test dependencies (about 60 packages, 1-2 minutes)"
	bash -o pipefail -c "$(PY) -m pip install -e '.[test]' | $(PIP_PROGRESS)"
	@echo "installed: $(VENV)"
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
