"""Client retention hints on the workloads side (docs/design/eviction.md §1.3): the trace fields round-trip
and are checked, the generators send what a provider-API client would, the simulator pins and releases
through the index and counts refusals, and bills price written tokens at the request's own tier."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvpool.workloads.checkpoints import parse_checkpoints
from kvpool.workloads.errors import PricingError, TraceFormatError
from kvpool.workloads.generators import LONG_TIER, SHORT_TIER, generate
from kvpool.workloads.live import replay_live_async
from kvpool.workloads.pricing import get_profile, price_result
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.sim_result import SimResult
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request, kvpool_record, read_kvpool, read_mooncake
from kvpool.workloads.trace_record import RETENTION_TIERS_MS
from kvpool.workloads.trace_write import to_kvpool_dict, write_kvpool, write_mooncake
from kvpool.workloads.workload_params import make_params

from kvpool.commands.main import main


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
    assert kvpool_record({**base, "cache_key": "k" * 256}).cache_key == "k" * 256  # the gateway's bound
    assert (
        kvpool_record({**base, "retention_tier": "2h", "retention_ms": 7_200_000}).retention_ms == 7_200_000
    )
    for bad, message in (
        ({"retention_tier": "2h"}, "has no TTL"),
        ({"retention_ms": 5}, "come together"),
        ({"session_end": "yes"}, "true or false"),
        ({"cache_key": 3}, "cache_key must be a string"),
        ({"cache_key": ""}, "cache_key must be 1 to 256 characters, got 0"),
        ({"cache_key": "k" * 257}, "cache_key must be 1 to 256 characters, got 257"),
        ({"retained_prefix_tokens": 5, "prefix_retention_tier": "1h"}, "> input_length"),
        ({"retained_prefix_tokens": 1}, "come together"),
    ):
        with pytest.raises(TraceFormatError, match=message):
            kvpool_record({**base, **bad})


# ------------------------------------------------------------------------------------------- generators


def test_sessions_carry_their_key_a_short_tier_until_their_last_turn_which_ends_them() -> None:
    small = make_params("coding", {"repo_tokens": 2000, "file_tokens": 200})
    reqs = generate("coding", 120, rate=2.0, seed=3, params=small)
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
    assert ended >= len(by_session) // 3  # sessions cut by the request count keep their turns open
    plain = generate("coding", 120, rate=2.0, seed=3, params=small, hints=False)
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


# ------------------------------------------------------------------------------------------- simulator


def _blocks(*ids: int) -> list[int]:
    return [t for i in ids for t in [i] * 64]


def _req(rid: str, blocks: list[int], t: float, tenant: str = "default", **hints: object) -> Request:
    tokens = [*_blocks(*blocks), 9]  # one token into a private block: the last full block is looked up
    return Request(rid, t, len(tokens), 0, tokens=tokens, tenant=tenant, workload="w", **hints).validate()


FIVE_MIN = {"retention_tier": "5m", "retention_ms": 300_000}


def _worked_example(hints: bool = True, pin_share: float = 0.5) -> SimResult:
    """docs/design/eviction.md §1.3, worked example: tiny spec (checkpoint = 6 block units), LRU, 20 units,
    one conversation (session S) whose follow-up comes after two other chains have filled the cache."""
    reqs = [
        _req("A", [1, 2], 0, cache_key="S", **FIVE_MIN),  # S turn 1: M1 M2 + K2 = 8 units (full blocks only)
        _req("X", [11, 12], 1000),  # 8 units: 16 held
        _req("Y", [13, 14], 2000),  # 8 more: 24, over 20, LRU evicts the oldest evictable chain
        _req("B", [1, 2, 3], 3000, cache_key="S", session_end=True),  # S turn 2, the last
        _req("Z", [15, 16], 4000),
        _req("W", [17, 18], 5000),
    ]
    cfg = SimConfig(
        spec=get_spec("tiny"),
        policy="lru",
        capacity=20,
        capacity_unit="blocks",
        block_size=64,
        high_watermark=1.0,
        low_watermark=1.0,
        checkpoints=parse_checkpoints("prompt"),
        hints=hints,
        pin_share=pin_share,
    )
    return simulate(reqs, cfg)


def test_worked_example_a_retained_conversation_survives_the_flood_and_its_end_releases_it() -> None:
    plain = _worked_example(hints=False)
    assert plain.per_request["cached"][3] == 0  # LRU evicted S's chain before its follow-up
    assert plain.hints["pins"] == 0
    res = _worked_example()
    assert res.per_request["cached"][3] == 128  # pinned (8 units <= 0.5 x 20): X went instead
    assert res.hints == {
        "pins": 1,
        "pins_refused": 0,
        "pins_incomplete": 0,
        "objects_pinned": 3,  # M1 M2 K2
        "sessions_ended": 1,
        "objects_released": 3,
    }
    assert res.pinned_bytes == 0  # the session's end released everything it held
    d = res.to_dict()
    assert (d["pins"], d["pins_refused"], d["config"]["hints"]) == (1, 0, True)


def test_a_pin_over_the_budget_is_refused_counted_and_the_request_still_served() -> None:
    res = _worked_example(pin_share=0.3)  # 8 units > 0.3 x 20
    assert res.hints["pins"] == 1 and res.hints["pins_refused"] == 1 and res.hints["objects_pinned"] == 0
    assert res.per_request["cached"][3] == 0 and res.total.requests == 6  # as without hints


def test_retention_pins_the_prompts_chain_and_the_one_its_reply_closes_as_prefill_and_decode_do() -> None:
    tokens = _blocks(1, 2)
    turn = Request("t", 0.0, len(tokens), 65, tokens=tokens, output_tokens=[*_blocks(3), 6], workload="w",
                   cache_key="S", **FIVE_MIN)  # fmt: skip
    cfg = SimConfig(spec=get_spec("tiny"), block_size=64, checkpoints=parse_checkpoints("prompt,output"))
    res = simulate([turn.validate()], cfg)
    # prefill: M1 M2 + K2 (the prompt's end); decode: M1 M2 M3 + K3 (the reply's)
    assert (res.hints["pins"], res.hints["objects_pinned"]) == (2, 7)


def test_supersede_a_turn_whose_spans_pin_one_chain_releases_the_previous_turns_chain() -> None:
    prefix = {"retained_prefix_tokens": 128, "prefix_retention_tier": "1h", "prefix_retention_ms": 3_600_000}
    reqs = [
        _req("t1", [1, 2, 3, 4], 0, cache_key="S", **prefix, **FIVE_MIN),  # pins M1 M2 K2; M1..M4 K4
        # the prompt ends at the prefix: both spans end at K2, one pin (the whole prompt's and the prefix's)
        _req("t2", [1, 2], 1000, cache_key="S", **prefix, **FIVE_MIN),
    ]
    cfg = SimConfig(
        spec=get_spec("tiny"),  # a checkpoint weighs 6 block units
        policy="lru",
        capacity=100,
        capacity_unit="blocks",
        block_size=64,
        checkpoints=parse_checkpoints("prompt"),
        supersede=True,
    )
    assert simulate(reqs[:1], cfg).pinned_bytes == 4 + 6 + 6  # turn 1: M1..M4, K2 and K4
    res = simulate(reqs, cfg)
    assert res.hints["pins"] == 3 and res.hints["pins_refused"] == 0
    assert res.pinned_bytes == 2 + 6  # turn 1's M3 M4 K4 released: only turn 2's chain M1 M2 K2 is held
    assert simulate(reqs, replace(cfg, supersede=False)).pinned_bytes == 4 + 6 + 6  # every turn's pin stays


def test_a_retained_prefix_gets_its_checkpoint_and_outlives_one_session_while_another_holds_it() -> None:
    prefix = {"retained_prefix_tokens": 128, "prefix_retention_tier": "1h", "prefix_retention_ms": 3_600_000}
    reqs = [
        _req("a1", [1, 2, 3], 0, cache_key="a", **prefix, **FIVE_MIN),
        _req("b1", [1, 2, 4], 500, cache_key="b", **prefix, **FIVE_MIN),
        _req("a2", [1, 2, 3, 5], 1000, cache_key="a", session_end=True, **prefix),
    ]
    cfg = SimConfig(
        spec=get_spec("tiny"), policy="lru", block_size=64, checkpoints=parse_checkpoints("prompt")
    )
    res = simulate(reqs, cfg)
    # a1 wrote a checkpoint at the prefix's end (block 2) besides its prompt's (3): b1 resumes at the prefix
    assert res.per_request["cached"] == [0, 128, 192]
    assert res.hints["sessions_ended"] == 1 and res.pinned_bytes > 0  # b still holds the prefix
    off = simulate(reqs, replace(cfg, hints=False))
    assert off.per_request["cached"] == [0, 0, 192] and off.per_request["write_tier"] == [None] * 3


def test_replay_cli_hints_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chat.jsonl"
    write_kvpool(generate("chat", 40, rate=2.0, seed=2, vocab=1000), path)
    out = {}
    for flag in ("--hints", "--no-hints"):
        argv = ["replay", str(path), "--spec", "tiny", "--capacity-bytes", "2MiB", "--json", "--no-progress"]
        assert main([*argv, flag]) == 0
        out[flag] = json.loads(capsys.readouterr().out)
    assert out["--hints"]["pins"] > 0 and out["--hints"]["hints"]["sessions_ended"] > 0
    assert out["--no-hints"]["pins"] == 0 and out["--no-hints"]["config"]["hints"] is False


# ------------------------------------------------------------------------------------------- bench


def _policy_bench() -> object:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "policy_bench.py"
    spec = importlib.util.spec_from_file_location("policy_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_policy_bench_rows_and_the_hint_goals() -> None:
    pb: Any = _policy_bench()
    assert pb._rows("mix", ["lru", "reference", "hybrid+ssd4"], ["off", "on"]) == [
        "lru", "lru+hints", "reference", "hybrid+ssd4", "hybrid+ssd4+hints",
    ]  # fmt: skip
    assert pb._rows("conversation", ["lru"], ["on"]) == ["lru"]  # a Mooncake trace has no hints
    rows = {
        "lru": {"29": 0.30},
        "hybrid": {"29": 0.40},
        "lru+hints": {"29": 0.35},
        "hybrid+hints": {"29": 0.34},
        "reference": {"29": 0.50},
    }
    met = pb.goals_met({"mix": {"token_hit": rows}}, [1.0])
    assert met["default_ge_0_995x_lru_everywhere"]["met"] is True
    assert met["default_with_hints_ge_0_995x_lru_with_hints_everywhere"]["misses"] == [
        "mix@29: 0.971x lru+hints"
    ]
    assert met["mix_with_hints_ge_0_85x_reference"]["misses"] == ["@29: 0.680x reference"]
    nothing = pb.goals_met({}, [])
    assert nothing["mix_with_hints_ge_0_85x_reference"]["met"] is None
    assert nothing["sim_s_per_point_le"]["met"] is None  # conversation not run: not a miss


# ------------------------------------------------------------------------------------------- live replay


def test_live_replay_sends_the_hints_and_ends_the_session() -> None:
    seen: list[tuple[str, str | bytes, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            seen.append(("DELETE", request.url.raw_path, dict(request.url.params)))
            return httpx.Response(200, json={"deleted": True})
        seen.append(("POST", request.url.path, json.loads(request.content)))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
        return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": usage})

    reqs = [
        Request("a", 0, 3, 1, tokens=[1, 2, 3], tenant="t1", cache_key="conv/1", **FIVE_MIN),
        Request("b", 1, 3, 1, tokens=[1, 2, 3], tenant="t1", cache_key="conv/1", session_end=True),
    ]
    transport = httpx.MockTransport(handler)
    outcomes = asyncio.run(
        replay_live_async(reqs, "http://fake", speed=0, concurrency=1, transport=transport, hints=True)
    )
    assert [o.session_end for o in outcomes] == ["", "ok"]
    (_, _, first), (_, _, second), end = seen
    assert first["prompt_cache_key"] == "conv/1" and first["prompt_cache_retention"] == "5m"
    assert second["prompt_cache_key"] == "conv/1" and "prompt_cache_retention" not in second
    # the key quoted, as sent (``url.path`` is decoded: the raw path is what went on the wire)
    assert end == ("DELETE", b"/v1/prompt_cache/conv%2F1?cache_salt=t1", {"cache_salt": "t1"})
    seen.clear()
    asyncio.run(replay_live_async(reqs, "http://fake", speed=0, concurrency=1, transport=transport))
    assert len(seen) == 2 and all("prompt_cache_key" not in body for _, _, body in seen)


def test_a_chain_with_a_key_gone_pins_nothing_is_no_refusal_and_one_shallower_checkpoint_is_tried() -> None:
    from kvpool.kvstore.index.records import ObjectKind
    from kvpool.workloads.sim import NODE, _Replay

    r = _Replay(SimConfig(spec=get_spec("tiny"), block_size=64, capacity=100, capacity_unit="blocks"), 64)
    idx = r.shard_indexes[0]
    mla = [b"M" + bytes([i]) * 32 for i in range(4)]
    for j, key in enumerate(mla):
        idx.insert(key, ObjectKind.MLA, 1, node_id=NODE, parent=mla[j - 1] if j else b"")
    for c in (1, 2):  # checkpoints at blocks 1 and 2; the one at 4 (its put failed) and at 3 are not there
        idx.insert(b"K" + mla[c - 1][1:], ObjectKind.KDA, 6, node_id=NODE)
    t = r.hints
    # as the master: the chain at 4 misses K4, so nothing is pinned and it is no refusal; then the next one
    assert r._retain(idx, mla, [4, 2], 1000, "s") == [*mla[:2], b"K" + mla[1][1:]]
    assert (t.pins, t.pins_incomplete, t.pins_refused, t.objects_pinned) == (2, 1, 0, 3)
    assert r._retain(idx, mla, [4, 3], 1000, "s") == []  # both incomplete: nothing retained
    assert (t.pins, t.pins_incomplete, t.pins_refused) == (4, 3, 0)
    assert idx.stats().pinned_bytes == 1 * 2 + 6
