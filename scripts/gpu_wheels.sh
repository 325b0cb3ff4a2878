#!/usr/bin/env bash
# Fetch the wheels the GPU check needs that a lent GPU machine lacks (it has no internet): fla-core (its
# Triton KDA kernels) and einops, pure-Python, into the ignored folder .gpu_wheels/. They travel with the
# working tree (carry ".gpu_wheels"; ~1.2 MB of the 64 MiB allowed). Run once on a machine with PyPI.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$ROOT/.gpu_wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/.gpu_wheels" \
  "fla-core==0.6.0" "einops==0.8.1"
ls -l "$ROOT/.gpu_wheels"
