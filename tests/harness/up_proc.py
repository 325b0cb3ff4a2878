"""``kvpool up`` as a child of a test, the way a user runs it: one helper for every module that needs a
whole cluster (gateway, multi-host faults, HA), so they start and wait for it the same way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


def start_up(base: Path, config: str, *flags: str, timeout_s: float) -> tuple[subprocess.Popen, Path]:
    """Write ``config`` to ``base/cluster.toml``, run ``kvpool up FLAGS`` with its runs root under ``base``
    (log ``base/up.log``) and wait for its ``state.json``; fails the test with the log's tail otherwise."""
    (base / "cluster.toml").write_text(config)
    run_dir = base / "run"
    env = dict(os.environ, KVPOOL_RUNS=str(base / "runs"))
    argv = [sys.executable, "-m", "kvpool", "up", *flags]
    with (base / "up.log").open("wb") as log:
        popen = subprocess.Popen(
            [*argv, "--config", str(base / "cluster.toml"), "--run-dir", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "state.json").exists():
        if popen.poll() is not None or time.monotonic() > deadline:
            popen.kill()
            pytest.fail(f"kvpool up {' '.join(flags)} failed: {(base / 'up.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return popen, run_dir
