"""Provisioning picks the cheapest grid point that meets the target, prices it by the stated formula,
and an SSD tier under a small DRAM is charged at SSD prices and SSD speed; bad targets exit 2."""

from __future__ import annotations

import json

import pytest
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.provider_cost import ProviderInputs
from kvpool.workloads.provision import Target, provision
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

from kvpool.commands.main import main

K3 = get_spec("k3")
GiB = 2**30
PROVIDER = ProviderInputs(gpu_hour_usd=3.5, gpu_flops=989e12, mfu=0.4, dram_gb_hour_usd=0.004,
                          ssd_gb_hour_usd=0.0001)  # fmt: skip


@pytest.fixture(scope="module")
def conv() -> list[Request]:
    return sorted(read_mooncake(bundled_trace("conversation")), key=lambda r: r.arrival_ms)[:600]


@pytest.fixture(scope="module")
def grid(conv: list[Request]) -> dict:
    return provision(conv, K3, [8 * GiB, 256 * GiB], [0, 8], PROVIDER, Target(token_hit=0.05))


def test_every_point_is_priced_as_compute_of_the_misses_plus_memory_held(
    conv: list[Request], grid: dict
) -> None:
    assert len(grid["rows"]) == 4
    for r in grid["rows"]:
        d = simulate(
            conv, SimConfig(spec=K3, capacity=r["dram_bytes"], ssd_capacity=r["ssd_bytes"])
        ).to_dict()
        assert r["token_hit_rate"] == d["token_hit_rate"]
        hours = d["duration_s"] / 3600
        misses = d["input_tokens"] - d["cached_tokens"]
        compute = misses * K3.prefill_flops_per_token / (989e12 * 0.4) / 3600 * 3.5
        memory = (r["dram_bytes"] * 0.004 + r["ssd_bytes"] * 0.0001) / 1e9 * hours
        assert r["total_usd"] == pytest.approx(compute + memory)
        assert r["meets_target"] == (r["token_hit_rate"] >= 0.05)


def test_the_answer_is_the_cheapest_point_meeting_the_target(grid: dict) -> None:
    ok = [r for r in grid["rows"] if r["meets_target"]]
    assert ok, "the grid is sized so that some point meets 5%"
    assert grid["best"] == min(ok, key=lambda r: r["total_usd"])
    assert grid["best_dram_only"] == min((r for r in ok if r["ssd_bytes"] == 0), key=lambda r: r["total_usd"])
    small = {(r["dram_bytes"], r["ssd_bytes"]): r for r in grid["rows"]}
    with_ssd, without = small[(8 * GiB, 64 * GiB)], small[(8 * GiB, 0)]
    assert with_ssd["token_hit_rate"] > without["token_hit_rate"]  # the SSD tier holds what DRAM evicts
    assert with_ssd["ssd_token_hit_rate"] > 0


def test_a_ttft_target_uses_the_estimate_quantile(conv: list[Request]) -> None:
    out = provision(conv, K3, [64 * GiB], [0], PROVIDER, Target(ttft_ms=1e9, quantile="p99"))
    (row,) = out["rows"]
    d = simulate(conv, SimConfig(spec=K3, capacity=64 * GiB)).to_dict()
    assert row["ttft_ms"] == pytest.approx(d["ttft_est_ms_p99"]) and out["best"] is row
    tight = provision(conv, K3, [64 * GiB], [0], PROVIDER, Target(ttft_ms=1e-3))
    assert tight["best"] is None and tight["best_dram_only"] is None


@pytest.mark.parametrize(
    "target, message",
    [(Target(), "give a target"), (Target(token_hit=1.5), "fraction"), (Target(ttft_ms=-1), "> 0"),
     (Target(token_hit=0.1, quantile="p75"), "p50, p90, p99, mean")],
)  # fmt: skip
def test_a_bad_target_is_refused(conv: list[Request], target: Target, message: str) -> None:
    with pytest.raises(ReplayError, match=message):
        provision(conv[:5], K3, [GiB], [0], PROVIDER, target)


def test_provision_command_prints_json_and_exits_1_when_nothing_meets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["provision", "conversation", "--limit", "300", "--dram", "16GiB,64GiB", "--ssd-ratios", "0,4",
            "--json", "--no-progress"]  # fmt: skip
    assert main([*argv, "--target-hit", "0.01"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 4 and out["best"]["meets_target"] and "user_cost_usd" in out["best"]
    assert main([*argv, "--target-hit", "0.99"]) == 1
    assert json.loads(capsys.readouterr().out)["best"] is None
    assert main(["provision", "conversation", "--limit", "5"]) == 2
    assert "give a target" in capsys.readouterr().err
    assert main(["provision", "conversation", "--target-hit", "0.1", "--ssd-ratios", "x"]) == 2
    assert main(["provision", "conversation", "--target-hit", "0.1", "--policy", "reference"]) == 2


def test_the_report_summary_reads_the_reference_at_the_chosen_capacity(conv: list[Request]) -> None:
    from kvpool.worker.checkpoint_policy import CheckpointPolicy
    from kvpool.workloads.pricing import load_profiles
    from kvpool.workloads.report_summary import price_curves, summary_row
    from kvpool.workloads.sweep import capacity_sweep

    profiles, _ = load_profiles()
    caps = [8 * GiB, 256 * GiB]
    curves = price_curves(conv, K3, caps, PROVIDER, profiles["moonshot-k3"], 512, "hybrid")
    rows = capacity_sweep(conv, K3, caps, "bytes", ["reference"], CheckpointPolicy(), 512)
    s, _ = summary_row("conv", conv, K3, curves, rows, profiles, 512, "hybrid")
    assert s["capacity_bytes"] == curves["best_dram_only"]["dram_bytes"]
    ref = next(r for r in rows if int(r["capacity_bytes"]) == s["capacity_bytes"])
    assert s["of_reference"] == pytest.approx(s["token_hit_rate"] / float(ref["token_hit_rate"]))
    assert set(s["savings_usd"]) == set(profiles) and s["mix"]["token_hit_rate"] >= s["token_hit_rate"]
