"""Sampled LRU curves (``--sample R``): a sample by chain root at capacities x R estimates the exact one-pass
curve of a generated trace within a measured error; R = 1 is the exact curve, integer for integer; bad input
is one ReplayError naming the flag."""

from __future__ import annotations

import json

import pytest
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.generators import generate
from kvpool.workloads.lru_curve import lru_curve
from kvpool.workloads.sampled import chain_root, curve_error, sample, sample_band, sampled_lru_curve
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request

from kvpool.commands.main import main

MLA = get_spec("k3", pure_mla=True)
BS = 512
CAPS = [170, 310, 564, 1028, 1874, 3414]  # 5 % of the distinct blocks to all of them, geometric
CFG = SimConfig(spec=MLA, policy="lru", capacity_unit="blocks", block_size=BS, hints=False,
                high_watermark=1.0, low_watermark=1.0)  # fmt: skip


@pytest.fixture(scope="module")
def chat() -> list[Request]:
    # 40 tenants x 4 system prompts: 160 chain roots; 3,000 requests, 3,414 distinct blocks
    return generate("chat", 3000, rate=20.0, seed=5, tenants=40, hints=False)


@pytest.fixture(scope="module")
def exact(chat: list[Request]) -> dict[int, dict]:
    curve, fallback = lru_curve(chat, CFG, CAPS, BS)
    assert not fallback
    return {c: p.to_dict() for c, p in curve.items()}


def test_a_ten_percent_sample_is_within_the_measured_error(
    chat: list[Request], exact: dict[int, dict]
) -> None:
    """Measured when written: mean absolute token-hit error 0.028 / 0.033 / 0.020 (max 0.054 / 0.048 /
    0.053) over salts 0-2; the bounds leave room for nothing else."""
    means = []
    for salt in range(3):
        est = sampled_lru_curve(chat, CFG, CAPS, BS, 0.1, salt)
        assert 0 < est.sampled_requests < len(chat) and est.rate == 0.1
        assert all(p["estimate"] and p["sampled_capacity"] == max(1, c // 10) for c, p in est.points.items())
        for metric in ("token_hit_rate", "block_hit_rate"):
            mean, worst = curve_error(exact, est.points, metric)
            assert worst <= 0.07, (salt, metric, worst)
            if metric == "token_hit_rate":
                means.append(mean)
    assert sum(means) / len(means) <= 0.035, means


def test_rate_one_is_the_exact_curve(chat: list[Request], exact: dict[int, dict]) -> None:
    est = sampled_lru_curve(chat, CFG, CAPS, BS, 1.0, salt=7)
    assert est.sampled_requests == len(chat) and not est.simulated
    for c in CAPS:
        for k, v in exact[c].items():
            assert est.points[c][k] == v, (c, k)


def test_a_root_is_kept_or_dropped_whole(chat: list[Request]) -> None:
    picked = sample(chat, 0.3, salt=1)
    kept_roots = {chain_root(r) for r in picked}
    assert [r for r in chat if chain_root(r) in kept_roots] == picked
    assert sample(chat, 0.3, salt=1) == picked  # deterministic
    assert sample(chat, 0.3, salt=2) != picked


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5, float("nan")])
def test_a_rate_outside_zero_one_names_the_flag(chat: list[Request], rate: float) -> None:
    with pytest.raises(ReplayError, match="--sample"):
        sampled_lru_curve(chat, CFG, CAPS, BS, rate)


def test_where_the_one_pass_curve_does_not_apply_the_error_names_the_flag(chat: list[Request]) -> None:
    for cfg in (SimConfig(spec=get_spec("k3"), policy="lru", capacity_unit="blocks", hints=False,
                          high_watermark=1.0, low_watermark=1.0),  # hybrid
                SimConfig(spec=MLA, policy="lru", capacity_unit="blocks", hints=False),  # batch eviction
                SimConfig(spec=MLA, policy="lfu", capacity_unit="blocks", hints=False)):  # fmt: skip
        with pytest.raises(ReplayError, match="--sample"):
            sampled_lru_curve(chat[:200], cfg, CAPS, BS, 0.5)


def test_the_command_prints_the_rate_and_the_estimate_note(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["replay", "conversation", "--limit", "2000", "--pure-mla", "--high-watermark", "1",
            "--low-watermark", "1", "--capacity-blocks", "2000,8000,40000", "--no-progress"]  # fmt: skip
    assert main([*base, "--policy", "lru", "--sample", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "sample rate 0.2" in out and "estimates" in out and "measured error" in out
    assert main([*base, "--policy", "lru", "--sample", "0.2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["sample_rate"] == 0.2 and len(d["points"]) == 3 and "estimates" in d["note"]
    bad_args = [
        (["--policy", "lfu", "--sample", "0.5"], "--sample"),
        (["--policy", "lru", "--sample", "0"], "--sample"),
        (["--policy", "lru", "--sample", "0.5", "--sample-depth", "-1"], "--sample-depth"),
    ]
    for bad, flag in bad_args:
        assert main([*base, *bad]) == 2
        assert flag in capsys.readouterr().err


def test_the_band_spans_the_salts_around_the_exact_curve_and_collapses_onto_it_at_rate_one(
    chat: list[Request], exact: dict[int, dict]
) -> None:
    """What ``kvpool report`` draws: per capacity the exact value and the salts' mean, least and greatest
    estimate; at R = 1 every salt keeps everything, so the band is the exact curve and the error is 0."""
    caps = CAPS[1::2]  # three capacities: a band needs no more, and each costs the exact pass and 3 samples
    band = sample_band(chat, CFG, caps, BS, 0.1, salts=3)
    assert [r["capacity"] for r in band.rows] == caps
    for r in band.rows:
        assert r["exact"] == exact[r["capacity"]]["token_hit_rate"]
        assert r["lo"] <= r["mean"] <= r["hi"] and r["lo"] < r["hi"], r  # three salts, three samples
    errs = [abs(r[k] - r["exact"]) for r in band.rows for k in ("lo", "hi")]
    assert 0 < band.mean_abs_err <= band.max_abs_err == pytest.approx(max(errs))
    whole = sample_band(chat, CFG, caps[:1], BS, 1.0, salts=2)
    assert all(r["exact"] == r["mean"] == r["lo"] == r["hi"] for r in whole.rows)
    assert whole.mean_abs_err == whole.max_abs_err == 0.0
    with pytest.raises(ReplayError, match="salt"):
        sample_band(chat, CFG, CAPS, BS, 0.1, salts=0)
