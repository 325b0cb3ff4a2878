"""The one-pass LRU curve (``workloads/lru_curve.py``) equals one ``simulate()`` per capacity, integer for
integer (blocks and tokens hit, bytes written, evicted and held), wherever it claims a point: on both
bundled traces, on random chained traces with repeated prompts (present put-only blocks, refreshed by the
put), on token records, tenants and mixes, and on the worked example of docs/design/workloads.md §3b,
computed there by hand."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from kvpool.kvstore.index import prefix_index
from kvpool.workloads import sim
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.lru_curve import lru_curve, refusal
from kvpool.workloads.sim import SimConfig, effective_block_size, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

MLA = get_spec("k3", pure_mla=True)
FIELDS = ("hit_blocks", "usable_blocks", "mla_hit_tokens", "cached_tokens", "mla_bytes_written",
          "bytes_evicted", "objects_evicted", "bytes_held", "input_blocks", "input_tokens")  # fmt: skip


def _exact(unit: str = "blocks") -> SimConfig:
    return SimConfig(spec=MLA, policy="lru", capacity_unit=unit, high_watermark=1.0, low_watermark=1.0)


def _check(reqs: list[Request], caps: list[int], unit: str) -> dict[int, dict]:
    """Every claimed point equals its own simulation; returns the claimed points as dicts."""
    cfg = _exact(unit)
    points, _ = lru_curve(reqs, cfg, caps, effective_block_size(reqs, MLA, None))
    for cap, point in points.items():
        want = simulate(reqs, SimConfig(**{**_fields(cfg), "capacity": cap})).to_dict()
        got = point.to_dict()
        assert {k: got[k] for k in FIELDS} == {k: want[k] for k in FIELDS}, (unit, cap)
    return {c: p.to_dict() for c, p in points.items()}


def _fields(cfg: SimConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def _mooncake(name: str, n: int) -> list[Request]:
    return sorted(read_mooncake(bundled_trace(name)), key=lambda r: r.arrival_ms)[:n]


def _req(i: int, ids: list[int], tail: int = 100) -> Request:
    """Hash-id record: full 512-token blocks, the last one ``tail`` tokens (never looked up)."""
    return Request(f"r{i}", float(i), (len(ids) - 1) * 512 + tail, 10, hash_ids=ids)


# The worked example: a=1 b=2 c=3 d=4 e=5 f=6, x1..x5 = 11..15 the partial last blocks.
EXAMPLE = [[1, 2, 11], [1, 3, 12], [1, 2, 4, 13], [5, 6, 14], [1, 2, 4, 15]]
BY_HAND = {4: (4, 4 * 512), 5: (5, 5 * 512), 8: (6, 6 * 512)}  # capacity -> (run blocks, cached tokens)


def test_worked_example_equals_the_hand_computation_and_the_simulator() -> None:
    reqs = [_req(i, ids) for i, ids in enumerate(EXAMPLE)]
    points = _check(reqs, list(BY_HAND), "blocks")
    assert {c: (p["usable_blocks"], p["cached_tokens"]) for c, p in points.items()} == BY_HAND
    doc = (Path(__file__).resolve().parent.parent / "docs/design/workloads.md").read_text(encoding="utf-8")
    prompt = sum(r.input_length for r in reqs)
    shares = " / ".join(f"{BY_HAND[c][1] / prompt:.1%}".rstrip("%") for c in sorted(BY_HAND))
    assert "Usable blocks 4 / 5 / 6, i.e. 2,048 / 2,560 / 3,072 cached of 6,644 prompt tokens" in doc
    assert f"({shares} %)" in doc


def test_conversation_blocks_every_point_equals_simulate() -> None:
    reqs = _mooncake("conversation", 3000)
    caps = [200, 400, 1500, 6000, 40000]  # 200 < the largest request (247 blocks): simulated instead
    cfg = _exact()
    _, fallback = lru_curve(reqs, cfg, caps, 512)
    assert set(fallback) == {200} and "evict itself" in fallback[200]
    got = _check(reqs, caps[1:], "blocks")
    assert set(got) == set(caps[1:])
    rates = [got[c]["token_hit_rate"] for c in caps[1:]]
    assert rates == sorted(rates) and rates[0] < rates[-1]  # a curve, not one point repeated


def test_synthetic_bytes_every_point_equals_simulate() -> None:
    reqs = _mooncake("synthetic", 3000)
    full = MLA.mla_bytes_per_token * 512
    caps = [400 * full, 1200 * full + 12345, 5000 * full, 30000 * full]
    got = _check(reqs, caps, "bytes")
    assert set(got) == set(caps)


@pytest.mark.parametrize("seed", range(6))
def test_random_chained_traces_with_repeats(seed: int) -> None:
    """Prompts that repeat or stop where another went on: last blocks seen before, which only the put
    refreshes (the rule that keeps every capacity on one recency order)."""
    rng = random.Random(seed)
    paths: list[list[int]] = []
    nxt = 1
    reqs = []
    for i in range(300):
        if paths and rng.random() < 0.7:
            base = rng.choice(paths)
            ids = base[: rng.randint(1, len(base))]  # a prefix of an earlier prompt, maybe all of it
            if rng.random() < 0.5:
                grow = rng.randint(1, 4)
                ids = ids + list(range(nxt, nxt + grow))
                nxt += grow
        else:
            grow = rng.randint(1, 6)
            ids = list(range(nxt, nxt + grow))
            nxt += grow
        paths.append(ids)
        reqs.append(_req(i, ids, tail=512))  # one size per id, as in a real trace
    caps = [12, 15, 20, 30, 45, 70, 120, 400]
    got = _check(reqs, caps, "blocks")
    assert set(got) == set(caps)


def test_the_curve_never_runs_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("the one-pass curve must not simulate")

    monkeypatch.setattr(sim, "simulate", boom)
    monkeypatch.setattr(sim, "PrefixIndex", boom)
    monkeypatch.setattr(prefix_index, "PrefixIndex", boom)
    reqs = [_req(i, ids) for i, ids in enumerate(EXAMPLE)]
    points, _ = lru_curve(reqs, _exact(), [4, 5, 8], 512)
    assert points[8].total.cached_tokens == 6 * 512


def test_what_takes_the_fallback() -> None:
    reqs = [_req(i, ids) for i, ids in enumerate(EXAMPLE)]
    exact = _exact()
    assert refusal(exact, reqs) is None
    assert "hybrid" in (refusal(SimConfig(**{**_fields(exact), "spec": get_spec("k3")}), reqs) or "")
    assert "batch" in (refusal(SimConfig(spec=MLA, policy="lru"), reqs) or "")
    assert "LRU" in (refusal(SimConfig(**{**_fields(exact), "policy": "lfu"}), reqs) or "")
    hinted = [*reqs, Request("h", 9.0, 700, 1, hash_ids=[1, 2], retention_ms=1000)]
    assert "hints" in (refusal(exact, hinted) or "")
    assert refusal(SimConfig(**{**_fields(exact), "hints": False}), hinted) is None
    points, fallback = lru_curve(reqs, SimConfig(spec=MLA, policy="lru"), [4, 8], 512)
    assert not points and set(fallback) == {4, 8}


def _tokens(i: int, toks: list[int], out: list[int] | None = None, tenant: str = "default") -> Request:
    return Request(
        f"t{i}", float(i), len(toks), len(out or ()), tokens=toks, output_tokens=out, tenant=tenant
    )


ID_PATHS = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9, 10]]


def test_token_records_tenants_and_a_mix_equal_simulate() -> None:
    """Token records (chain hashes, reply blocks stored), two tenants sharing trace ids, a mix of both
    kinds, and a trailing record with no block at all, in blocks and in bytes."""
    rng = random.Random(3)
    bs = 64
    prompts = [[rng.randrange(50) for _ in range(rng.randint(80, 320))] for _ in range(6)]
    reqs: list[Request] = []
    for i in range(60):
        base = rng.choice(prompts)
        toks = base[: rng.randint(33, len(base))]
        reqs.append(
            _tokens(i, toks, [rng.randrange(50) for _ in range(rng.randint(1, 40))], rng.choice("ab"))
        )
        ids = rng.choice(ID_PATHS)[: rng.randint(1, 4)]  # chained: equal id, equal prefix
        reqs.append(
            Request(f"h{i}", i + 0.5, len(ids) * bs, 5, hash_ids=ids, block_size=bs, tenant=rng.choice("ab"))
        )
    reqs.append(Request("empty", 99.0, 0, 0, hash_ids=[], block_size=bs))
    full = MLA.mla_bytes_per_token * bs
    for unit, caps in (("blocks", [40, 80, 400]), ("bytes", [40 * full, 90 * full + 7, 400 * full])):
        got = _check(reqs, caps, unit)
        assert set(got) == set(caps), unit
        assert got[caps[-1]]["hit_blocks"] > 0


def test_a_block_put_at_another_size_while_held_takes_the_fallback() -> None:
    """Trace id 2 ends one prompt (a partial block) and sits whole inside the next while the cache holds it:
    the store keeps its first size, the capacities that lack it would take the new one."""
    reqs = [_req(0, [1, 2], tail=100), Request("r1", 1.0, 3 * 512, 1, hash_ids=[1, 2, 3])]
    points, fallback = lru_curve(reqs, _exact(), [8], 512)
    assert not points and "another" not in fallback[8] and "tokens" in fallback[8], fallback
    assert _check([reqs[0], Request("r1", 1.0, 3 * 512, 1, hash_ids=[1, 9, 3])], [8], "blocks")


def test_unchained_trace_ids_take_the_fallback_while_held() -> None:
    """Id 2 under id 1, then as a root while the cache holds it: the store keeps its first parent."""
    points, fallback = lru_curve([_req(0, [1, 2, 11]), _req(1, [2, 3, 12])], _exact(), [8], 512)
    assert not points and "not chained" in fallback[8]


def test_hash_ids_past_63_bits_and_past_64() -> None:
    big = (1 << 63) + 5
    reqs = [_req(0, [big, big + 1]), _req(1, [big, big + 2])]
    assert _check(reqs, [4, 8], "blocks")
    with pytest.raises(ReplayError, match="64 bits"):
        lru_curve([_req(0, [1 << 64, 3])], _exact(), [8], 512)
