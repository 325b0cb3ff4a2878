"""Pricing arithmetic: golden cases per shipped profile (computed by hand in the comments), rules for
minimum / step / write tiers, user profile files, the provider view, and bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvpool.workloads.errors import PricingError
from kvpool.workloads.pricing import (
    get_profile,
    load_profiles,
    price,
    price_many,
    price_result,
)
from kvpool.workloads.provider_cost import ProviderInputs, best_capacity, provider_view
from kvpool.workloads.specs import get_spec

from kvpool.commands.main import main


def test_shipped_profiles_are_the_four_conventions() -> None:
    profiles, provider = load_profiles()
    assert {"moonshot-k3", "anthropic-style", "openai-style", "deepseek-style"} <= set(profiles)
    k3 = profiles["moonshot-k3"]
    assert (k3.input, k3.cached_input, k3.output) == (3.00, 0.30, 15.00)
    assert provider.gpu_flops > 0


@pytest.mark.parametrize(
    ("profile", "tier", "inp", "cached", "out", "cost", "without"),
    [
        # 5000 x 3.00 + 5000 x 0.30 + 1000 x 15.00 = 31,500 -> $0.0315 ; no cache 30,000 + 15,000
        ("moonshot-k3", None, 10_000, 5_000, 1_000, 0.0315, 0.045),
        # uncached 5000 written at 1.25 x 3.00: 18,750 + 5000 x 0.30 + 15,000 = 35,250
        ("anthropic-style", None, 10_000, 5_000, 1_000, 0.03525, 0.045),
        # 1 h tier: 5000 x 6.00 + 1,500 + 15,000 = 46,500
        ("anthropic-style", "1h", 10_000, 5_000, 1_000, 0.0465, 0.045),
        # prompt below 1024: nothing cached, nothing written: 1000 x 3 + 100 x 15 = 4,500
        ("anthropic-style", None, 1_000, 0, 100, 0.0045, 0.0045),
        # cached 5000 -> 4992 (39 x 128): 5008 x 1.25 + 4992 x 0.125 + 1000 x 10 = 16,884
        ("openai-style", None, 10_000, 5_000, 1_000, 0.016884, 0.0225),
        # cached 1000 rounds to 896 < 1024 minimum -> no discount: 2000 x 1.25 = 2,500
        ("openai-style", None, 2_000, 1_000, 0, 0.0025, 0.0025),
        # cached 1100 -> 1024: 976 x 1.25 + 1024 x 0.125 = 1,348
        ("openai-style", None, 2_000, 1_100, 0, 0.001348, 0.0025),
        # 5000 x 0.28 + 5000 x 0.028 + 1000 x 0.42 = 1,960
        ("deepseek-style", None, 10_000, 5_000, 1_000, 0.00196, 0.00322),
    ],
)
def test_golden_prices(
    profile: str, tier: str | None, inp: int, cached: int, out: int, cost: float, without: float
) -> None:
    bill = price(get_profile(profile), inp, cached, out, write_tier=tier)
    assert bill.cost_usd == pytest.approx(cost, rel=1e-12)
    assert bill.cost_without_cache_usd == pytest.approx(without, rel=1e-12)
    assert bill.savings_usd == pytest.approx(without - cost, rel=1e-9, abs=1e-15)


def test_explicit_write_tokens_and_storage_fee(tmp_path: Path) -> None:
    bill = price(get_profile("anthropic-style"), 10_000, 5_000, 0, cache_write_tokens=1_000)
    # 4000 x 3 + 1000 x 3.75 + 5000 x 0.3 = 17,250
    assert bill.cost_usd == pytest.approx(0.01725)
    f = tmp_path / "mine.toml"
    f.write_text(
        "[profiles.mine]\ninput = 2.0\ncached_input = 0.5\noutput = 8.0\nstorage_per_mtok_hour = 1.0\n"
    )
    mine = get_profile("mine", f)
    # 1000 x 2 + 1000 x 0.5 + storage 2e6 token-hours x $1/M = 2,500 / 1e6 + 2.0
    assert price(mine, 2_000, 1_000, 0, cached_token_hours=2e6).cost_usd == pytest.approx(2.0025)


def test_per_request_pricing_of_a_replay_result_applies_rules_per_request() -> None:
    p = get_profile("openai-style")
    per = {"workload": ["a", "b"], "input": [2_000, 900], "cached": [1_100, 800], "output": [10, 10]}
    out = price_result(p, {"per_request": per})
    each = price(p, 2_000, 1_100, 10).cost_usd + price(p, 900, 800, 10).cost_usd
    assert out["cost_usd"] == pytest.approx(each)
    assert out["billable_cached_tokens"] == 1_024  # the 900-token prompt is below the minimum
    assert set(out["workloads"]) == {"a", "b"}
    agg = price_result(p, {"input_tokens": 2_900, "cached_tokens": 1_900, "output_tokens": 20})
    assert agg["approximate"] is True
    assert price_many(p, [1], [1], [1]).cost_usd > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 0, 0), "input tokens must be >= 0"),
        ((10, 20, 0), "cannot exceed input tokens"),
        ((10, 0, -3), "output tokens must be >= 0"),
        ((1.5, 0, 0), "integer"),
    ],
)
def test_bad_counts(args: tuple, message: str) -> None:
    with pytest.raises(PricingError, match=message):
        price(get_profile("moonshot-k3"), *args)


def test_bad_profiles(tmp_path: Path) -> None:
    with pytest.raises(PricingError, match="unknown pricing profile 'nope'"):
        get_profile("nope")
    with pytest.raises(PricingError, match="no write tier '2h'"):
        price(get_profile("anthropic-style"), 10, 0, 0, write_tier="2h")
    bad = tmp_path / "bad.toml"
    bad.write_text("[profiles.x]\ninput = 1.0\noutput = 2.0\n")
    with pytest.raises(PricingError, match="lacks 'cached_input'"):
        load_profiles(bad)
    bad.write_text("[profiles.x]\ninput = 1.0\ncached_input = -1\noutput = 2.0\n")
    with pytest.raises(PricingError, match="non-negative"):
        load_profiles(bad)
    bad.write_text("[profiles.x\n")
    with pytest.raises(PricingError, match="not valid TOML"):
        load_profiles(bad)
    with pytest.raises(PricingError, match="cannot read"):
        load_profiles(tmp_path / "missing.toml")


def test_provider_view_arithmetic() -> None:
    spec = get_spec("k3")
    inputs = ProviderInputs(
        gpu_hour_usd=3.6, gpu_flops=1e15, mfu=0.5, dram_gb_hour_usd=0.01, ssd_gb_hour_usd=0.001
    )
    v = provider_view(spec, inputs, 2_000_000, 1_000_000, capacity_bytes=10**12, hours=2.0)
    saved_s = 1e6 * spec.prefill_flops_per_token / (1e15 * 0.5)
    assert v["compute_saved_usd"] == pytest.approx(saved_s / 3600 * 3.6)
    assert v["storage_usd"] == pytest.approx(1000 * 2.0 * 0.01)
    assert v["net_saving_usd"] == pytest.approx(v["compute_saved_usd"] - v["storage_usd"])
    rows = [
        {"capacity_bytes": 10**11, "input_tokens": 10**9, "cached_tokens": 10**8, "duration_s": 3600},
        {"capacity_bytes": 10**12, "input_tokens": 10**9, "cached_tokens": 5 * 10**8, "duration_s": 3600},
        {"capacity_bytes": 10**14, "input_tokens": 10**9, "cached_tokens": 6 * 10**8, "duration_s": 3600},
    ]
    best = best_capacity(spec, inputs, rows)["best"]
    assert best["capacity_gb"] == pytest.approx(1000.0)
    with pytest.raises(PricingError, match="mfu"):
        provider_view(spec, ProviderInputs(1, 1, 2.0, 0, 0), 1, 0, 1, 1.0)


def _cli_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_price_json(capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        "price",
        "--input-tokens",
        "10000",
        "--cached-tokens",
        "5000",
        "--output-tokens",
        "1000",
        "--json",
    ]
    d = _cli_json(capsys, [*base, "--profile", "moonshot-k3"])
    assert d["cost_usd"] == pytest.approx(0.0315)
    assert d["cost_without_cache_usd"] == pytest.approx(0.045)
    assert d["savings_usd"] == pytest.approx(0.0135)
    everything = _cli_json(capsys, [*base, "--profile", "all"])
    assert set(everything["profiles"]) >= {"moonshot-k3", "openai-style", "anthropic-style", "deepseek-style"}
    prov = _cli_json(capsys, [*base, "--provider", "--capacity-bytes", "1TB", "--hours", "1"])
    assert prov["provider"]["storage_usd"] == pytest.approx(1000 * 0.004)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--input-tokens", "-5"], "input tokens must be >= 0"),
        (["--input-tokens", "10", "--cached-tokens", "11"], "cannot exceed"),
        (["--input-tokens", "10", "--profile", "nope"], "unknown pricing profile"),
        ([], "give --input-tokens"),
        (["--result", "/nonexistent.json"], "cannot read"),
    ],
)
def test_cli_price_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["price", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("kvpool price: error:")


def test_savings_fraction_prints_as_a_short_decimal(capsys) -> None:
    from kvpool.commands.main import main

    argv = ["price", "--input-tokens", "1000000", "--cached-tokens", "400000", "--output-tokens", "0"]
    argv.append("--json")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert '"savings_fraction": 0.36,' in out or '"savings_fraction": 0.36}' in out, out


def test_a_retained_prefix_without_a_tier_of_its_own_writes_only_the_prefix() -> None:
    """Anthropic's explicit caching: a breakpoint writes the prompt up to it; past the last breakpoint the
    tokens are plain input (not written at --write-tier)."""
    per = {
        "input": [10_000],
        "cached": [4_000],
        "output": [0],
        "write_tier": [None],
        "prefix_tokens": [6_000],
        "prefix_tier": ["1h"],
    }
    out = price_result(get_profile("anthropic-style"), {"per_request": per}, write_tier="5m")
    # tokens 4000..6000 written at 1h (2 x 3 $/M), 6000..10000 plain input, 4000 read at 0.30
    assert out["cost_usd"] == pytest.approx((2_000 * 6 + 4_000 * 3 + 4_000 * 0.3) / 1e6)
