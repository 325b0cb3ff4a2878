"""The prepared GPU check never rots: its CPU dry run (``GPU_CHECK_DRY=1 scripts/gpu_check.sh``) runs every
step it can, from a copy of the tree laid out as the package, and writes a JSON with every field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_every_field(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_CHECK_DRY": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check import FIELDS

    assert set(FIELDS) <= set(report) and report["dry"] is True and report["errors"] == {}
    for name in ("tiny", "k3_shaped"):
        assert report["equality"][name]["within"] and report["equality"][name]["greedy_equal"]
        assert report["resume"][name]["bitwise"]
    assert "skipped" in report["kernels"]  # no CUDA here: said, not faked
    speed = report["speed"]
    assert all(v["ours"] > 0 and v["fla"] is None for v in speed["prefill_tokens_per_s"].values())
    assert speed["decode_ms_per_token"]["ours"] > 0
    push = report["push"]
    assert push["mla_bytes_per_token"] > 0 and push["checkpoint_bytes"] > 0 and push["hbm_copy_gbps"] > 0
    assert set(push) >= {"d2h_pinned_gbps", "d2h_pageable_gbps", "overlap", "produced_mla_bytes_per_s"}
    assert push["staged_equal"] is True  # the chunked device -> host staging, checked for equality on CPU
    assert "resume.k3_shaped.bitwise" in (tmp_path / "gpu_check.txt").read_text()
