"""``kvpool verify --model tiny-dsa-fp8``: the disaggregated workers + shared cache path (its own master,
node, prefill and decode on loopback) carries DSA indexer keys (fp8 + scale inside every MLA block, tail and
resume) and stays exactly the plain model: the verify CLI needs nothing DSA-specific, only the model name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # master + node + two workers (~10-30 s on 2 busy cores)
def test_verify_tiny_dsa_fp8_on_a_local_cluster():
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "verify", "--model", "tiny-dsa-fp8", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["identical_fraction"] == 1.0 and report["cached_tokens_verified"]
    assert report["cached_tokens"] > report["prompt_tokens"] // 3
    rows = {r["name"]: r for r in report["rows"]}
    assert max(r["prompt_tokens"] for r in rows.values()) > 64 * 4  # index_topk 64: selection is exercised
    assert all(r["bitwise_logits"] for name, r in rows.items() if not name.endswith("turn2"))
