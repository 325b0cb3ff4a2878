"""Client retention hints on the workloads side (docs/design/eviction.md §1.3): the trace fields round-trip
and are checked, the generators send what a provider-API client would, the simulator pins and releases
through the index and counts refusals, and bills price written tokens at the request's own tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvpool.workloads.errors import PricingError, TraceFormatError
from kvpool.workloads.generators import LONG_TIER, SHORT_TIER, generate
from kvpool.workloads.pricing import get_profile, price_result
from kvpool.workloads.trace import RETENTION_TIERS_MS, Request, kvpool_record, read_kvpool, read_mooncake
from kvpool.workloads.trace_write import to_kvpool_dict, write_kvpool, write_mooncake


def _hinted(**kw: object) -> Request:
    base: dict = dict(request_id="r", arrival_ms=0.0, input_length=4, output_length=0, tokens=[1, 2, 3, 4])
    base.update(kw)
    return Request(**base).validate()


# ------------------------------------------------------------------------------------------- trace


def test_hints_round_trip_and_are_absent_from_mooncake(tmp_path: Path) -> None:
    reqs = [
        _hinted(cache_key="conv-1", retention_tier="5m", retention_ms=300_000),
        _hinted(
            request_id="s",
            cache_key="conv-1",
            session_end=True,
            retained_prefix_tokens=2,
            prefix_retention_tier="1h",
            prefix_retention_ms=3_600_000,
        ),
        _hinted(request_id="plain"),
    ]
    path = tmp_path / "t.jsonl"
    write_kvpool(reqs, path)
    assert read_kvpool(path) == reqs
    assert set(to_kvpool_dict(reqs[2])).isdisjoint({"cache_key", "retention_tier", "session_end"})
    write_mooncake(reqs, tmp_path / "m.jsonl")
    back = read_mooncake(tmp_path / "m.jsonl")
    assert all(not r.has_hints and r.cache_key is None for r in back)


def test_a_standard_tier_alone_names_its_ttl_and_bad_hints_are_refused() -> None:
    base = {"request_id": "r", "arrival_ms": 0, "input_length": 1, "output_length": 0, "tokens": [7]}
    assert kvpool_record({**base, "retention_tier": "1h"}).retention_ms == RETENTION_TIERS_MS["1h"]
    assert (
        kvpool_record({**base, "retention_tier": "2h", "retention_ms": 7_200_000}).retention_ms == 7_200_000
    )
    for bad, message in (
        ({"retention_tier": "2h"}, "has no TTL"),
        ({"retention_ms": 5}, "come together"),
        ({"session_end": "yes"}, "true or false"),
        ({"cache_key": 3}, "cache_key must be a string"),
        ({"retained_prefix_tokens": 5, "prefix_retention_tier": "1h"}, "> input_length"),
        ({"retained_prefix_tokens": 1}, "come together"),
    ):
        with pytest.raises(TraceFormatError, match=message):
            kvpool_record({**base, **bad})


# ------------------------------------------------------------------------------------------- generators


def test_sessions_carry_their_key_a_short_tier_until_their_last_turn_which_ends_them() -> None:
    reqs = generate("coding", 120, rate=2.0, seed=3)
    by_session: dict[str, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.conversation_id or "", []).append(r)
    ended = 0
    for sid, turns in by_session.items():
        turns.sort(key=lambda r: r.turn)
        for r in turns:
            assert r.cache_key == sid
            assert r.retained_prefix_tokens > 0 and r.prefix_retention_tier == LONG_TIER
            if r.session_end:
                assert r is turns[-1] and r.retention_tier is None and r.retention_ms == 0
            else:
                assert (r.retention_tier, r.retention_ms) == (SHORT_TIER, RETENTION_TIERS_MS[SHORT_TIER])
        ended += turns[-1].session_end
    assert ended >= len(by_session) // 2  # sessions cut by the request count keep their turns open
    plain = generate("coding", 120, rate=2.0, seed=3, hints=False)
    assert not any(r.has_hints or r.cache_key for r in plain)
    assert [r.tokens for r in plain] == [r.tokens for r in reqs]  # hints change nothing else


def test_agent_loop_retains_its_shared_prefix_long_and_each_call_short() -> None:
    reqs = generate("agent_loop", 60, rate=6.0, seed=1)
    prefixes = {tuple(r.tokens[: r.retained_prefix_tokens]) for r in reqs if r.tokens}
    assert len(prefixes) <= 2  # the deployments' shared prefixes, nothing per run
    assert all(r.prefix_retention_tier == LONG_TIER for r in reqs)
    assert {r.retention_tier for r in reqs if not r.session_end} == {SHORT_TIER}
    assert json.loads(json.dumps(to_kvpool_dict(reqs[0])))["prefix_retention_ms"] == 3_600_000


# ------------------------------------------------------------------------------------------- pricing


def test_a_requests_own_tier_prices_its_written_tokens() -> None:
    p = get_profile("anthropic-style")  # 5m = 1.25x, 1h = 2x of input 3.00 $/M; reads 0.30
    per = {
        "workload": ["a", "a", "b"],
        "input": [10_000, 10_000, 10_000],
        "cached": [4_000, 4_000, 4_000],
        "output": [0, 0, 0],
        "write_tier": ["1h", None, "5m"],
        "prefix_tokens": [0, 0, 6_000],
        "prefix_tier": [None, None, "1h"],
    }
    out = price_result(p, {"per_request": per}, write_tier="5m")
    # 1: 6000 written x 3 x 2 + 4000 x 0.3 = 37,200; 2: no tier of its own, --write-tier 5m:
    # 6000 x 3.75 + 1200 = 23,700; 3: written tokens 4000..6000 are the 1h prefix's: 2000 x 6 + 4000 x 3.75
    # + 1200 = 28,200
    assert out["cost_usd"] == pytest.approx((37_200 + 23_700 + 28_200) / 1e6)
    assert out["workloads"]["b"]["cost_usd"] == pytest.approx(0.0282)
    # a profile without tiers does not sell retention: the request's tier prices at its cache_write
    flat = price_result(get_profile("moonshot-k3"), {"per_request": per})
    assert flat["cost_usd"] == pytest.approx(3 * (6_000 * 3 + 4_000 * 0.3) / 1e6)


def test_a_tier_the_profile_does_not_sell_is_refused_naming_its_tiers(tmp_path: Path) -> None:
    per = {"input": [2_000], "cached": [0], "output": [0], "write_tier": ["24h"]}
    with pytest.raises(PricingError, match=r"no write tier '24h'; tiers: \['1h', '5m'\]"):
        price_result(get_profile("anthropic-style"), {"per_request": per})
