#!/usr/bin/env bash
# The prepared GPU check (docs/measurements/gpu_check.md): equality, bitwise resume, fla kernels, speed
# and the device-to-host push, in one run of under 8 minutes; writes gpu_check.json + gpu_check.txt to
# $OUT. GPU_CHECK_DRY=1 runs the same steps on CPU at tiny sizes (make test does).
#
# It needs no install: kvpool's package-dir layout is copied into an importable tree, and the wheels of
# scripts/gpu_wheels.sh (.gpu_wheels/, if present) are unpacked beside it. Only the Python on PATH (or
# $PYTHON) with torch is required.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out/gpu_check}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PY" - "$ROOT" "$WORK/src" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, str(Path(sys.argv[1]) / "scripts"))
import lint_imports

lint_imports.build_mirror(Path(sys.argv[2]))
PY
mkdir -p "$WORK/site"
for wheel in "$ROOT"/.gpu_wheels/*.whl; do
  [ -e "$wheel" ] || continue
  "$PY" -m zipfile -e "$wheel" "$WORK/site"
done
export PYTHONPATH="$WORK/src:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS for the bitwise resume step
mkdir -p "$OUT"
timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" "$ROOT/scripts/gpu_check.py" --out "$OUT"
