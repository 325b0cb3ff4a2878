#!/usr/bin/env bash
# NVIDIA Dynamo's standalone KV indexer against kvpool's KV events (docs/measurements/kv_events.md).
# Not part of `make test` (it installs Dynamo into its own venv and takes about a minute).
#   scripts/dynamo_indexer_check.sh [--requests 400] [--late-join]
# Dynamo 1.6.1 lives in DYN_VENV (default /tmp/dynvenv): ai-dynamo-runtime, and ai-dynamo without its
# dependencies (one of them, aisimulate, is a placeholder wheel that downloads from pypi.nvidia.com).
set -euo pipefail
cd "$(dirname "$0")/.."
DYN_VENV=${DYN_VENV:-/tmp/dynvenv}
if ! "$DYN_VENV/bin/python" -c "import dynamo.indexer" 2>/dev/null; then
  python3 -m venv "$DYN_VENV"
  "$DYN_VENV/bin/pip" install -q ai-dynamo-runtime==1.6.1
  "$DYN_VENV/bin/pip" install -q --no-deps ai-dynamo==1.6.1
fi
exec .venv/bin/python scripts/dynamo_indexer_check.py --dynamo-python "$DYN_VENV/bin/python" "$@"
