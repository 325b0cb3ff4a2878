"""Clusters for tests, both through the one launcher (``kvpool.launch.cluster.Cluster``).

``start_up``: ``kvpool up`` as a child of a test, the way a user runs it, for every module that needs a whole
cluster behind its command line (gateway, multi-host faults, HA). ``worker_cluster``: master, storage node,
one prefill and one decode in the test's own process's hands, for tests that call the workers and the store
themselves (no gateway, no cluster secret) and may kill and restart a service.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.launch.cluster import Cluster
from kvpool.launch.config import load_config, merge_config

WORKER_CLUSTER = {
    # a killed storage node is noticed, and a store call given up, within a test's patience
    "master": {"heartbeat_ms": 200, "node_timeout_ms": 1500},
    "prefill": {"count": 1, "transport": "tcp", "args": ["--store-timeout", "3"]},
    "decode": {"transport": "tcp", "args": ["--store-timeout", "3"]},
}


def worker_cluster(run_dir: Path, overrides: dict | None = None) -> Cluster:
    """A ``Cluster`` (not started: use it as a context manager) of master, node, one prefill and one decode
    on loopback, workers on the tcp data plane; ``overrides`` are merged over ``WORKER_CLUSTER`` and the
    shipped defaults. No gateway, no secret, and ``kvpool status`` is left to a real ``kvpool up``."""
    config = load_config(overrides=merge_config(WORKER_CLUSTER, overrides or {}))
    return Cluster(config, run_dir, gateway=False, auth=False, publish=False)


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
