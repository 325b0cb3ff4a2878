"""Simulator: hit rates equal independent computations written here, the joint rule and checkpoint
policies behave as overview §3 says, and the offline optimum is optimal on small exhaustive cases."""

from __future__ import annotations

import functools
import itertools
import random
from collections import OrderedDict

import pytest
from kvpool.cache.hashing import hash_blocks, root_hash
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads.chains import ChainBuilder, model_fingerprint
from kvpool.workloads.checkpoints import parse_checkpoints
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.optimum import optimum
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

MLA_ONLY = get_spec("k3", pure_mla=True)


@pytest.fixture(scope="module")
def conversation() -> list[Request]:
    return read_mooncake(bundled_trace("conversation"))


def _infinite_reference(reqs: list[Request]) -> tuple[float, float, float]:
    """(block hit, Mooncake token-weighted hit, tokens prefill may skip) with a plain set."""
    seen: set[int] = set()
    hit_blocks = blocks = hit_tokens = usable_tokens = tokens = 0
    for r in reqs:
        assert r.hash_ids is not None
        run = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            run += 1
        hit_blocks += run
        blocks += len(r.hash_ids)
        hit_tokens += min(run * 512, r.input_length)
        usable_tokens += min(run, (r.input_length - 1) // 512) * 512  # the last token is always computed
        tokens += r.input_length
        seen.update(r.hash_ids)
    return hit_blocks / blocks, hit_tokens / tokens, usable_tokens / tokens


def _lru_reference(reqs: list[Request], cap: int, high: float = 1.0, low: float = 1.0) -> float:
    """Plain OrderedDict LRU of block ids. Every block of a request's chain is used (the hit blocks prefill
    fetches, and each block it puts: a present one is refreshed) and re-stamped deepest-first, so a prefix
    root is always more recent than its suffixes (leaf-first eviction); watermarks as the master's."""
    od: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in reqs:
        assert r.hash_ids is not None
        run = 0
        for h in r.hash_ids:
            if h not in od:
                break
            run += 1
        hit += run
        total += len(r.hash_ids)
        for h in r.hash_ids:  # insert what is missing, evicting as each block arrives
            if h in od:
                od.move_to_end(h)  # a put of a present block refreshes it
                continue
            if len(od) + 1 > cap:
                while len(od) > min(int(low * cap), cap - 1):
                    od.popitem(last=False)
            od[h] = None
            if len(od) > high * cap:
                while len(od) > int(low * cap):
                    od.popitem(last=False)
        for h in reversed(r.hash_ids):  # then those blocks become the newest, the root newest of all
            if h in od:
                od.move_to_end(h)
    return hit / total


def test_infinite_cache_equals_set_computation_on_both_traces(conversation: list[Request]) -> None:
    for reqs in (conversation, read_mooncake(bundled_trace("synthetic"))):
        res = simulate(reqs, SimConfig(spec=MLA_ONLY)).to_dict()
        block_ref, token_ref, usable_ref = _infinite_reference(reqs)
        assert res["requests"] == len(reqs)
        assert res["block_hit_rate"] == pytest.approx(block_ref, abs=1e-12)
        assert res["mla_token_hit_rate"] == pytest.approx(token_ref, abs=1e-12)
        assert res["token_hit_rate"] == pytest.approx(usable_ref, abs=1e-12)
    # the figure the Mooncake FAST'25 trace analysis reports for the full conversation trace
    assert _infinite_reference(conversation)[0] == pytest.approx(0.3664, abs=5e-5)


@pytest.mark.parametrize("cap", [300, 1500, 6000])
def test_exact_lru_equals_ordereddict(conversation: list[Request], cap: int) -> None:
    reqs = conversation[:1500]
    cfg = SimConfig(
        policy="lru",
        spec=MLA_ONLY,
        capacity=cap,
        capacity_unit="blocks",
        high_watermark=1.0,
        low_watermark=1.0,
    )
    got = simulate(reqs, cfg).to_dict()["block_hit_rate"]
    assert got == pytest.approx(_lru_reference(reqs, cap), abs=1e-12)
    assert 0.0 < got < _infinite_reference(reqs)[0]


def test_watermark_lru_equals_ordereddict(conversation: list[Request]) -> None:
    reqs = conversation[:1500]
    cfg = SimConfig(spec=MLA_ONLY, policy="lru", capacity=2000, capacity_unit="blocks")  # 0.95 / 0.85
    got = simulate(reqs, cfg).to_dict()["block_hit_rate"]
    assert got == pytest.approx(_lru_reference(reqs, 2000, 0.95, 0.85), abs=1e-12)
    exact = _lru_reference(reqs, 2000)
    assert got != exact  # watermarks really change the answer, so this test can tell them apart


def test_bytes_capacity_is_respected_and_accounted(conversation: list[Request]) -> None:
    spec = get_spec("k3")
    cap = 3000 * 512 * spec.mla_bytes_per_token
    res = simulate(conversation[:800], SimConfig(spec=spec, capacity=cap))
    d = res.to_dict()
    assert 0 < res.bytes_held <= cap
    written = d["mla_bytes_written"] + d["kda_bytes_written"]
    assert written - d["bytes_evicted"] == res.bytes_held
    assert d["checkpoints_written"] * spec.kda_bytes_per_checkpoint == d["kda_bytes_written"]
    assert d["workloads"]["conversation"]["bytes_evicted"] == d["bytes_evicted"] > 0
    assert d["cached_tokens"] + d["lost_tokens"] <= d["mla_hit_tokens"]


def _tok_request(rid: str, tokens: list[int], t: float, output: list[int] | None = None) -> Request:
    out = output or []
    return Request(rid, t, len(tokens), len(out), tokens=tokens, output_tokens=out or None, workload="w")


def _blocks(*ids: int) -> list[int]:
    return [t for i in ids for t in [i] * 64]


def test_token_chains_are_the_production_hashes() -> None:
    req = _tok_request("a", _blocks(1, 2, 3) + [9] * 10, 0)
    chain = ChainBuilder("tiny", 64).chain(req)
    want = hash_blocks(req.tokens, 64, root_hash(model_fingerprint("tiny"), "default"))
    assert chain.hashes == [bytes(h) for h in want] and chain.prompt_blocks == 3


def _run(reqs: list[Request], ck: str) -> list[dict[str, int]]:
    cfg = SimConfig(spec=get_spec("tiny"), checkpoints=CheckpointPolicy.parse(ck), block_size=64)
    res = simulate(reqs, cfg)
    return [{"cached": c} for c in res.per_request["cached"]]


def test_joint_rule_needs_a_checkpoint_and_counts_lost_tokens() -> None:
    a = _tok_request("a", [*_blocks(1, 2, 3), 9], 0)
    b = _tok_request("b", _blocks(1, 2, 3) + [7] * 5, 1)
    assert [r["cached"] for r in _run([a, b], "prompt")] == [0, 192]
    cfg = SimConfig(spec=get_spec("tiny"), checkpoints=CheckpointPolicy.parse("none"), block_size=64)
    res = simulate([a, b], cfg).to_dict()
    assert res["cached_tokens"] == 0 and res["lost_tokens"] == 192 and res["hit_blocks"] == 3


def test_junction_checkpoint_serves_the_third_request() -> None:
    a = _tok_request("a", [*_blocks(1, 2, 3), 9], 0)
    b = _tok_request("b", [*_blocks(1, 2, 4), 9], 1)
    c = _tok_request("c", [*_blocks(1, 2, 5), 9], 2)
    assert [r["cached"] for r in _run([a, b, c], "prompt")] == [0, 0, 0]
    assert [r["cached"] for r in _run([a, b, c], "prompt,junction")] == [0, 0, 128]


def test_end_of_output_checkpoint_serves_the_next_turn() -> None:
    turn1 = _tok_request("t1", _blocks(1, 2), 0, output=[*_blocks(3), 6])
    turn2 = _tok_request("t2", [*_blocks(1, 2, 3), 6, *_blocks(4)], 1)
    assert [r["cached"] for r in _run([turn1, turn2], "prompt")] == [0, 128]
    assert [r["cached"] for r in _run([turn1, turn2], "prompt,output")] == [0, 192]
    # decode never feeds its last sampled token: a reply of exactly one block closes no block
    short = _tok_request("t1", _blocks(1, 2), 0, output=_blocks(3))
    assert [r["cached"] for r in _run([short, turn2], "end,output")] == [0, 128]


def test_prompts_shorter_than_a_block_store_nothing_and_hit_nothing() -> None:
    short = _tok_request("s", [1] * 30, 0, output=[2] * 10)
    assert [r["cached"] for r in _run([short, short], "prompt,output,junction,every=1")] == [0, 0]
    tiny_trace = [Request(f"r{i}", float(i), 300, 5, hash_ids=[7], workload="w") for i in range(2)]
    res = simulate(tiny_trace, SimConfig(spec=get_spec("k3"))).to_dict()
    assert res["checkpoints_written"] == 0 and res["hit_blocks"] == 1 and res["cached_tokens"] == 0


def test_the_last_prompt_token_is_always_computed() -> None:
    a = _tok_request("a", _blocks(1, 2, 3), 0)  # block-aligned, sent twice
    cfg = SimConfig(spec=get_spec("tiny", pure_mla=True), block_size=64)
    res = simulate([a, a], cfg)
    assert res.per_request["cached"] == [0, 128] and res.total.hit_blocks == 3


def test_visibility_delay_hides_objects_of_requests_still_in_flight() -> None:
    a = _tok_request("a", [*_blocks(1, 2, 3), 9], 0)
    b = _tok_request("b", [*_blocks(1, 2, 3), 8], 100)  # 100 ms later
    c = _tok_request("c", [*_blocks(1, 2, 3), 7], 1000)

    def cached(delay_ms: float) -> list[int]:
        cfg = SimConfig(spec=get_spec("tiny"), block_size=64, visibility_delay_ms=delay_ms)
        return simulate([a, b, c], cfg).per_request["cached"]

    assert cached(0) == [0, 192, 192]
    assert cached(50) == [0, 192, 192]
    assert cached(500) == [0, 0, 192]
    assert cached(5000) == [0, 0, 0]
    with pytest.raises(ReplayError, match="visibility delay"):
        cached(-1)
    # per request (e.g. measured TTFTs): a is slow (visible at 500 ms, after b looked), b fast
    cfg = SimConfig(spec=get_spec("tiny"), block_size=64, visibility_delay_ms=5000)
    # given in the caller's order (c, a, b), not arrival order
    res = simulate([c, a, b], cfg, visibility_delays_ms=[0, 500, 10])
    assert res.per_request["cached"] == [0, 0, 192]  # per_request follows arrival order: a, b, c
    with pytest.raises(ReplayError, match="visibility delays"):
        simulate([a, b], cfg, visibility_delays_ms=[0])


def test_interval_checkpoints() -> None:
    a = _tok_request("a", [*_blocks(1, 2, 3, 4, 5), 9], 0)
    b = _tok_request("b", [*_blocks(1, 2, 3, 9, 9), 9], 1)
    assert [r["cached"] for r in _run([a, b], "every=2")] == [0, 128]


def test_pure_mla_spec_needs_no_checkpoint() -> None:
    a = _tok_request("a", [*_blocks(1, 2, 3), 9], 0)
    b = _tok_request("b", [*_blocks(1, 2, 4), 9], 1)
    cfg = SimConfig(spec=get_spec("tiny", pure_mla=True), block_size=64)
    assert simulate([a, b], cfg).per_request["cached"] == [0, 128]


def test_bad_config_is_a_replay_error() -> None:
    with pytest.raises(ReplayError, match="unknown eviction policy"):
        simulate([], SimConfig(spec=MLA_ONLY, policy="fifo"))
    with pytest.raises(ReplayError, match="positive integer"):
        simulate([], SimConfig(spec=MLA_ONLY, capacity=-5))
    with pytest.raises(ReplayError, match="checkpoint policy part"):
        parse_checkpoints("prompt,sometimes")


# ------------------------------------------------------------------------------------------- optimum


def _random_chained_trace(rng: random.Random, n: int) -> list[Request]:
    """Requests whose id lists are root-to-node paths of a small random tree (so ids are chained)."""
    paths: list[list[int]] = [[0]]
    next_id = 1
    reqs = []
    for i in range(n):
        base = rng.choice(paths)[: rng.randint(1, 3)]
        path = list(base)
        while len(path) < rng.randint(1, 4) or rng.random() < 0.3:
            path.append(next_id)
            next_id += 1
        paths.append(path)
        reqs.append(Request(f"r{i}", float(i), len(path) * 512, 1, hash_ids=path, workload="w"))
    return reqs


def _brute_force_best(reqs: list[Request], cap: int) -> int:
    """Max prefix-hit blocks over every possible cache content after every request."""
    paths = [tuple(r.hash_ids or ()) for r in reqs]

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(paths):
            return 0
        run = 0
        for h in paths[i]:
            if h not in cache:
                break
            run += 1
        pool = sorted(cache | set(paths[i]))
        sizes = range(min(cap, len(pool)) + 1)
        options = [frozenset(c) for k in sizes for c in itertools.combinations(pool, k)]
        return run + max(best(i + 1, o) for o in options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_optimum_matches_exhaustive_search(seed: int) -> None:
    rng = random.Random(seed)
    reqs = _random_chained_trace(rng, 7)
    for cap in (1, 2, 3):
        got = optimum(reqs, cap, "k3", 512).total.hit_blocks
        assert got == _brute_force_best(reqs, cap), (seed, cap)


def test_optimum_bounds_every_policy_and_meets_infinite(conversation: list[Request]) -> None:
    reqs = conversation[:1500]
    inf_rate = _infinite_reference(reqs)[0]
    assert optimum(reqs, None, "k3", 512).total.to_dict()["block_hit_rate"] == pytest.approx(inf_rate)
    for cap in (500, 3000):
        best = optimum(reqs, cap, "k3", 512).total.to_dict()["block_hit_rate"]
        for policy in ("lru", "lfu", "cost"):
            cfg = SimConfig(spec=MLA_ONLY, policy=policy, capacity=cap, capacity_unit="blocks")
            assert simulate(reqs, cfg).to_dict()["block_hit_rate"] <= best + 1e-12
        assert best > _lru_reference(reqs, cap)


def test_hybrid_admission_beats_lru_where_the_cache_is_small(conversation: list[Request]) -> None:
    """At 40 GiB of K3 (~95 checkpoints) LRU evicts nearly everything before its reuse; the default policy
    refuses part of the new chains (counted, never an error) and keeps the rest long enough to hit."""
    reqs, k3 = conversation[:3000], get_spec("k3")
    lru = simulate(reqs, SimConfig(spec=k3, policy="lru", capacity=40 * 2**30)).to_dict()
    hybrid = simulate(reqs, SimConfig(spec=k3, capacity=40 * 2**30)).to_dict()
    assert hybrid["config"]["policy"] == "hybrid" and lru["objects_not_admitted"] == 0
    assert hybrid["objects_not_admitted"] > 0
    assert hybrid["token_hit_rate"] > 1.4 * lru["token_hit_rate"] > 0  # 1.61x when written
    unbounded = simulate(reqs, SimConfig(spec=k3)).to_dict()
    assert unbounded["objects_not_admitted"] == 0  # nothing is evicted, so the rate stays at 1


def test_a_sweep_shares_the_trace_chains_and_gets_the_same_result(conversation: list[Request]) -> None:
    """``warmed_builder`` hashes a trace once for all the points of a sweep: a simulation on it equals one
    that hashes for itself (id records: the first-seen parent decides a hash, so the warm-up must meet the
    requests in the simulator's order; token records too), and chains of another spec or block size are
    refused rather than used."""
    from kvpool.workloads.chains import warmed_builder
    from kvpool.workloads.generators import generate

    k3 = get_spec("k3")
    shuffled = random.Random(3).sample(conversation[:600], 600)  # arrival order is not list order
    chat = generate("chat", 150, rate=20.0, seed=2, tenants=3)
    for reqs, cfg in (
        (shuffled, SimConfig(spec=k3, capacity=40 * 2**30)),
        (chat, SimConfig(spec=k3, capacity=2 * 2**30, block_size=64)),
    ):
        bs = 512 if reqs is shuffled else 64
        chains = warmed_builder(reqs, k3.name, bs)
        assert simulate(reqs, cfg, chains=chains).to_dict() == simulate(reqs, cfg).to_dict()
    with pytest.raises(ReplayError, match="another spec or block size"):
        simulate(
            shuffled,
            SimConfig(spec=get_spec("k3", pure_mla=True)),
            chains=warmed_builder(shuffled, "k3", 512),
        )
