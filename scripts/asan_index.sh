#!/usr/bin/env bash
# The compiled code under AddressSanitizer: builds kvstore/index/*.pyx (the core, the recency guard,
# admission, the LRU map), workloads/lru_stack.pyx (the one-pass LRU curve) and workloads/id_chains.pyx (hash-id
# chains and their SHA-256) with -fsanitize=address
# into a scratch copy of the tree (laid out as
# kvpool/<package>/, the import paths), then runs the index's tests there (differential against the oracle,
# trace equality, the index and master-core suites) with libasan preloaded. Run once per change to the
# compiled code; exits non-zero on a test failure or an ASan report (ASan aborts the process on the first bad
# access).
#
#   bash scripts/asan_index.sh            # uses .venv
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d /tmp/kvpool-asan-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
"$PY" - "$ROOT" "$WORK/tree" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]) / "scripts"))
from lint_imports import build_mirror
build_mirror(Path(sys.argv[2]))
PY
cp -r "$ROOT/workloads/data" "$WORK/tree/kvpool/workloads/"
find "$WORK/tree" -name '*.so' -delete
cp -r "$ROOT/tests" "$WORK/run_tests" && mkdir -p "$WORK/run" && mv "$WORK/run_tests" "$WORK/run/tests"
cp -r "$ROOT/docs" "$WORK/run/docs"  # the worked examples' tests read their design notes
(cd "$WORK/tree" && "$PY" - <<'PY'
from Cython.Build import cythonize
from setuptools import Extension, setup
flags = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1", "-std=c++17"]
exts = [
    Extension(
        f"kvpool.kvstore.index.{m}", [f"kvpool/kvstore/index/{m}.pyx"],
        include_dirs=["kvpool/kvstore/index"], language="c++", extra_compile_args=flags,
        extra_link_args=["-fsanitize=address"],
    )
    for m in ("prefix_index", "recency_guard", "admission", "lru_map")
] + [
    Extension(
        f"kvpool.workloads.{m}", [f"kvpool/workloads/{m}.pyx"], include_dirs=["kvpool/workloads"],
        language="c++", extra_compile_args=flags, extra_link_args=["-fsanitize=address"],
    )
    for m in ("lru_stack", "id_chains")
]
setup(
    ext_modules=cythonize(exts, include_path=["kvpool/kvstore/index"], quiet=True),
    script_args=["build_ext", "--inplace", "-q"],
)
PY
)
cd "$WORK/run"
LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc \
PYTHONPATH="$WORK/tree:$WORK/run" "$PY" - "$WORK" <<'PY'
import sys

import kvpool.kvstore.index.admission as admission
import kvpool.kvstore.index.lru_map as lru_map
import kvpool.kvstore.index.prefix_index as core
import kvpool.kvstore.index.recency_guard as guard
import kvpool.workloads.id_chains as id_chains
import kvpool.workloads.lru_stack as lru_stack
import pytest

for module in (core, guard, admission, lru_map, lru_stack, id_chains):
    assert module.__file__.startswith(sys.argv[1]), f"not the ASan build: {module.__file__}"
    print("ASan build:", module.__file__)
sys.exit(pytest.main([
    "-q", "-p", "no:cacheprovider", "--rootdir", ".",
    "tests/test_index_core_differential.py", "tests/test_index_core_traces.py", "tests/test_index_core_bad_input.py",
    "tests/test_index_core_guard.py", "tests/test_index_core_admission.py", "tests/test_index_core_lru_map.py",
    "tests/test_store_index.py",
    "tests/test_store_index_ckpt.py", "tests/test_store_index_policies.py", "tests/test_store_index_admission.py",
    "tests/test_store_index_return_time.py", "tests/test_store_master_core.py",
    "tests/test_workloads_lru_stack.py", "tests/test_workloads_lru_curve.py", "tests/test_workloads_id_chains.py",
]))
PY
