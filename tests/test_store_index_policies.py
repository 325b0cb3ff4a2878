"""Eviction policies rank as documented; tiers, promotion, quotas and location rows of the index."""

from __future__ import annotations

import hashlib

import pytest
from kvpool.kvstore.index.eviction import POLICIES, UnknownPolicyError, make_policy
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import ObjectKind, Tier
from kvpool.kvstore.keys import kda_key, mla_key

from tests.harness.clock import Clock

BLOB, MLA, KDA = ObjectKind.BLOB, ObjectKind.MLA, ObjectKind.KDA


def index(policy: str, cap: int = 100, low_watermark: float = 0.85) -> tuple[PrefixIndex, Clock]:
    clock = Clock(10.0)
    idx = PrefixIndex(policy, clock=clock, high_watermark=0.9, low_watermark=low_watermark)
    idx.add_node("n", cap)
    return idx, clock


def first_victim(idx: PrefixIndex, size: int = 25) -> bytes:
    """Push the pool (70 of 100 bytes used) over the 90% watermark and return what went first."""
    idx.insert(b"trigger", BLOB, size, node_id="n")
    gone = [e.key for e in idx.drain_events()]
    assert gone, "nothing was evicted"
    return gone[0]


@pytest.mark.parametrize(("policy", "victim"), [("lru", b"hot"), ("lfu", b"once"), ("cost", b"once")])
def test_frequency_vs_recency(policy: str, victim: bytes) -> None:
    idx, clock = index(policy)
    idx.insert(b"hot", BLOB, 35, node_id="n")
    for _ in range(10):
        clock.t += 1
        idx.lookup([b"hot"], touch=True)
    clock.t += 1
    idx.insert(b"once", BLOB, 35, node_id="n")  # used once, but most recently
    clock.t += 1
    assert first_victim(idx) == victim


def test_lfu_ages_old_popularity_away() -> None:
    idx, clock = index("lfu")
    idx.policy = make_policy("lfu", half_life_s=10.0)
    idx.insert(b"was-hot", BLOB, 35, node_id="n")
    idx.lookup([b"was-hot"] * 1, touch=True)
    for _ in range(8):
        idx.lookup([b"was-hot"], touch=True)
    clock.t += 200  # 20 half-lives: 9 hits are worth ~1e-5 now
    idx.insert(b"fresh", BLOB, 35, node_id="n")
    idx.lookup([b"fresh"], touch=True)
    assert first_victim(idx) == b"was-hot"


def test_cost_prefers_keeping_deep_checkpoints_and_small_objects() -> None:
    idx, _ = index("cost", cap=10_000, low_watermark=0.3)
    hs = [hashlib.sha256(bytes([i])).digest() for i in range(64)]
    parent = b""
    for h in hs:
        idx.insert(mla_key(h), MLA, 1, parent=parent, node_id="n")
        parent = mla_key(h)
    idx.insert(kda_key(hs[0]), KDA, 1000, node_id="n")  # saves 1 block
    idx.insert(kda_key(hs[63]), KDA, 1000, node_id="n")  # saves 64 blocks, same bytes, same use
    idx.insert(b"small", BLOB, 100, node_id="n")
    idx.insert(b"big", BLOB, 4000, node_id="n")  # same use, 40x the bytes
    idx.insert(b"fill", BLOB, 3000, node_id="n")  # 9_164 > 9_000: evict down to 3_000
    gone = [e.key for e in idx.drain_events()]
    # per byte: big 1/4000 < shallow checkpoint 1/1000 < small 1/100 < deep checkpoint 64/1000
    assert gone[:4] == [b"big", kda_key(hs[0]), b"small", kda_key(hs[63])]


def test_same_operations_same_evictions() -> None:
    def run() -> list[bytes]:
        idx, clock = index("lru", cap=1000)
        for i in range(200):
            clock.t += 0.5
            idx.insert(f"k{i}".encode(), BLOB, 10 + i % 7, node_id="n")
            if i % 3 == 0:
                idx.lookup([f"k{i // 2}".encode()], touch=True)
        return [e.key for e in idx.drain_events()]

    assert run() == run()


def test_policy_names() -> None:
    assert set(POLICIES) == {"hybrid", "depth", "lru", "lfu", "cost"}
    with pytest.raises(UnknownPolicyError, match="choose one of"):
        make_policy("arc")
    with pytest.raises(ValueError):
        make_policy("lfu", half_life_s=0)


def test_ssd_full_falls_back_to_dropping_leaves_and_promotion_accounts_bytes() -> None:
    clock = Clock(10.0)
    idx = PrefixIndex(clock=clock, high_watermark=0.9, low_watermark=0.5)
    idx.add_node("n", 100, ssd_bytes=60)
    for i in range(10):
        clock.t += 1
        idx.insert(f"o{i}".encode(), BLOB, 20, node_id="n")
    usage = idx.node_usage("n")
    assert usage[Tier.DRAM][0] <= 90 and usage[Tier.SSD][0] <= 60
    st = idx.stats()
    assert st.demotions > 0 and st.evictions > 0, "SSD filled up: later pressure must drop"
    on_ssd = [k for k in idx if (info := idx.get(k)) is not None and info.tier == Tier.SSD]
    assert on_ssd
    assert idx.promote(on_ssd[-1])
    info = idx.get(on_ssd[-1])
    assert info is not None and info.tier == Tier.DRAM
    after = idx.node_usage("n")
    assert after[Tier.DRAM][0] <= 100 and after[Tier.SSD][0] <= 60
    held = {t: sum(i.size for k in idx if (i := idx.get(k)) is not None and i.tier == t) for t in Tier}
    assert held == {t: after[t][0] for t in Tier}, "per-tier accounting drifted"
    assert not idx.promote(b"o-absent") and not idx.promote(on_ssd[-1]), "already in DRAM"


def test_set_quota_enforces_immediately() -> None:
    clock = Clock(10.0)
    idx = PrefixIndex(clock=clock)
    idx.add_node("n", 10_000)
    for i in range(10):
        clock.t += 1
        idx.insert(f"t{i}".encode(), BLOB, 100, tenant="t", node_id="n")
    idx.set_quota("t", 450)
    assert idx.stats().bytes_per_tenant["t"] == 400
    assert [e.reason for e in idx.drain_events()] == ["quota"] * 6
    assert b"t9" in idx and b"t0" not in idx


def test_rows_match_get() -> None:
    clock = Clock(10.0)
    idx = PrefixIndex(clock=clock)
    idx.add_node("n", 10_000)
    idx.insert(b"a", BLOB, 5, tenant="x", checksum=99, node_id="n")
    idx.insert(b"Tt", ObjectKind.TAIL, 7, ttl_ms=1500, node_id="n")
    rows = idx.rows([b"a", b"missing", b"Tt"])
    assert [r.key for r in rows] == [b"a", b"Tt"]
    a = idx.get(b"a")
    assert a is not None
    assert (rows[0].size, rows[0].checksum, rows[0].tenant, rows[0].node_id, rows[0].tier) == (
        a.size,
        a.checksum,
        a.tenant,
        a.node_id,
        int(a.tier),
    )
    assert rows[1].ttl_ms == 1500 and rows[0].ttl_ms == 0
