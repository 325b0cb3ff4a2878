#!/usr/bin/env bash
# fla's Triton KDA kernels through kvpool's switch on CPU, under Triton's interpreter
# (scripts/fla_interpret_check.py says why and how). Builds .venv-fla (ignored: torch 2.13 CPU, triton
# 3.6.0, fla-core + einops from scripts/gpu_wheels.sh) once, then runs the check from a copy of the tree
# laid out as the package. A few minutes; not part of `make test` (triton is a 190 MB wheel).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/.venv-fla
if [ ! -x "$VENV/bin/python" ]; then
  [ -n "$(ls "$ROOT"/.gpu_wheels/*.whl 2>/dev/null)" ] || bash "$ROOT/scripts/gpu_wheels.sh"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 triton==3.6.0 numpy packaging "$ROOT"/.gpu_wheels/*.whl
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$VENV/bin/python" - "$ROOT" "$WORK" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, str(Path(sys.argv[1]) / "scripts"))
import lint_imports

lint_imports.build_mirror(Path(sys.argv[2]))
PY
PYTHONPATH="$WORK" "$VENV/bin/python" "$ROOT/scripts/fla_interpret_check.py"
