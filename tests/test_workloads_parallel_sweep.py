"""Sweeps in a process pool return what the sequential sweep returns, row for row; a pure-MLA evict-to-fit
LRU sweep takes the one-pass curve and gives the per-point rows; the CLI passes --jobs and watermarks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads.parallel import run_points
from kvpool.workloads.progress import PointProgress
from kvpool.workloads.provider_cost import ProviderInputs
from kvpool.workloads.provision import Target, provision
from kvpool.workloads.specs import get_spec
from kvpool.workloads.sweep import capacity_sweep, checkpoint_sweep
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

from kvpool.commands.main import main as kvpool_main

K3 = get_spec("k3")
GiB = 2**30


@pytest.fixture(scope="module")
def small() -> list[Request]:
    return sorted(read_mooncake(bundled_trace("synthetic")), key=lambda r: r.arrival_ms)[:300]


def _square(shared: int, task: int) -> int:
    return shared * task * task


def test_run_points_keeps_task_order_and_reports_each() -> None:
    seen: list[int] = []
    out = run_points(_square, 3, list(range(7)), jobs=2, done=lambda i, r, s: seen.append(i))
    assert out == [3 * t * t for t in range(7)] and sorted(seen) == list(range(7))
    assert run_points(_square, 3, [2], jobs=4) == [12]
    with pytest.raises(ValueError):
        run_points(_square, 3, [2], jobs=0)


def test_parallel_sweep_equals_sequential(small: list[Request]) -> None:
    caps = [40 * GiB, 120 * GiB]
    args = (small, K3, caps, "bytes", ["lru", "lfu", "optimum"], CheckpointPolicy())
    one = capacity_sweep(*args, jobs=1)
    stream = io.StringIO()
    two = capacity_sweep(*args, points=PointProgress(6, True, stream), jobs=2)
    assert one == two and len(one) == 6
    assert len(stream.getvalue().splitlines()) == 6  # one progress line per point, from the parent
    cks = [CheckpointPolicy(), CheckpointPolicy(junction=False)]
    assert checkpoint_sweep(small, K3, caps, "bytes", "lru", cks, jobs=1) == checkpoint_sweep(
        small, K3, caps, "bytes", "lru", cks, jobs=2
    )


def test_parallel_provision_equals_sequential(small: list[Request]) -> None:
    provider = ProviderInputs(gpu_hour_usd=2.0, gpu_flops=989e12, mfu=0.4, dram_gb_hour_usd=0.004,
                              ssd_gb_hour_usd=0.0001)  # fmt: skip
    grid = (small, K3, [40 * GiB, 120 * GiB], [0, 4], provider, Target(token_hit=0.0))
    assert provision(*grid, jobs=1) == provision(*grid, jobs=2)


def test_one_pass_sweep_rows_equal_per_point_rows(
    small: list[Request], monkeypatch: pytest.MonkeyPatch
) -> None:
    mla = get_spec("k3", pure_mla=True)
    caps = [500, 900, 4000]
    args = (small, mla, caps, "blocks", ["lru"], CheckpointPolicy())
    fast = capacity_sweep(*args, jobs=1, watermarks=(1.0, 1.0))
    monkeypatch.setenv("KVPOOL_LRU_ONE_PASS", "0")
    slow = capacity_sweep(*args, jobs=2, watermarks=(1.0, 1.0))
    assert fast == slow
    default = capacity_sweep(*args, jobs=2)  # the master's watermarks: batch eviction, simulated
    assert default != fast


def test_cli_sweep_takes_jobs_and_watermarks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "synthetic", "--sim", "--pure-mla", "--policy", "lru", "--capacity-blocks",
            "500,4000", "--high-watermark", "1", "--low-watermark", "1", "--limit", "300", "--jobs", "2",
            "--json", "--no-progress", "--out-dir", str(tmp_path)]  # fmt: skip
    assert kvpool_main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [int(r["capacity"]) for r in rows] == [500, 4000]
    assert rows[0]["token_hit_rate"] < rows[1]["token_hit_rate"]
