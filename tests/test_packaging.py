"""The project builds without setuptools warnings, and the wheel carries the shipped data files and the
compiled index."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_builds_without_warnings_and_ships_its_data(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT),
           "-w", str(tmp_path)]  # fmt: skip
    had_build = (ROOT / "build").exists()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    finally:
        if not had_build:  # setuptools builds in ./build: leave the checkout as it was
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Warning" not in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]
    (wheel,) = tmp_path.glob("kvpool-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("pricing.toml", "conversation_trace.jsonl.gz", "synthetic_trace.jsonl.gz", "NOTICE"):
        assert f"kvpool/workloads/data/{data}" in names
    # the index core is compiled from its source, and the wheel ships the module, not the build's by-products
    for module in ("kvstore/index/prefix_index", "workloads/lru_stack", "workloads/id_chains"):
        assert any(n.startswith(f"kvpool/{module}.") and n.endswith(".so") for n in names), (module, names)
    assert "kvpool/kvstore/index/prefix_index.cpp" not in names
