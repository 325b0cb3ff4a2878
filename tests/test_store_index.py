"""PrefixIndex rules: joint prefix match, dependencies, eviction by bytes, pins, leases, TTL, quotas."""

from __future__ import annotations

import random

import pytest
from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.eviction import UnknownPolicyError
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import (
    PUT_EXISTS,
    PUT_NO_ROOM,
    PUT_NOT_ADMITTED,
    BadObjectError,
    CapacityError,
    DuplicateKeyError,
    ObjectKind,
    QuotaExceededError,
    Tier,
    UnknownKeyError,
)
from kvpool.kvstore.keys import kda_key, mla_key

from tests.harness.chains import chain
from tests.harness.clock import Clock

MLA, KDA, TAIL, BLOB = ObjectKind.MLA, ObjectKind.KDA, ObjectKind.TAIL, ObjectKind.BLOB


def put_chain(
    idx: PrefixIndex,
    hashes: list[bytes],
    *,
    checkpoints: tuple[int, ...] = (),
    size: int = 10,
    ck_size: int = 10,
    tenant: str = "",
    node: str | None = "n0",
) -> None:
    """Insert MLA blocks of a chain in order, plus checkpoints closing block c-1 for each c."""
    parent = b""
    for i, h in enumerate(hashes):
        idx.insert(mla_key(h), MLA, size, parent=parent, tenant=tenant, node_id=node)
        parent = mla_key(h)
        if i + 1 in checkpoints:
            idx.insert(kda_key(h), KDA, ck_size, tenant=tenant, node_id=node)


def make(clock: Clock | None = None, cap: int = 10_000, **kw: object) -> PrefixIndex:
    idx = PrefixIndex(clock=clock or Clock(), **kw)  # type: ignore[arg-type]
    idx.add_node("n0", cap)
    return idx


def assert_prefix_closed(idx: PrefixIndex) -> None:
    """Every committed MLA block's parent and every checkpoint's MLA block is committed."""
    for key in idx:
        if key[:1] == b"M":
            info = idx.get(key)
            assert info is not None and (not info.parent or info.parent in idx), (
                "an MLA block outlived its parent"
            )
        elif key[:1] == b"K":
            assert mla_key(key[1:]) in idx, "a checkpoint outlived its MLA block"


# ---------------------------------------------------------------- joint prefix rule


def test_joint_rule_picks_largest_checkpointed_prefix() -> None:
    idx = make()
    hs = chain(10)
    put_chain(idx, hs[:8], checkpoints=(2, 5))
    m = idx.match_prefix(hs)
    assert (m.usable_blocks, m.mla_run_blocks, m.checkpoint_blocks) == (5, 8, (2, 5))
    assert m.mla_keys == tuple(mla_key(h) for h in hs[:5])
    assert m.checkpoint_key == kda_key(hs[4])
    assert m.blocks_lost_to_checkpoint == 3
    plain = idx.match_prefix(hs, require_checkpoint=False)
    assert (plain.usable_blocks, plain.checkpoint_key) == (8, None)
    assert len(plain.mla_keys) == 8


def test_p_zero_and_gap_and_checkpoint_past_run() -> None:
    idx = make()
    hs = chain(6)
    assert idx.match_prefix(hs).usable_blocks == 0
    put_chain(idx, hs[:2])
    idx.insert(mla_key(hs[3]), MLA, 10, parent=mla_key(hs[2]), node_id="n0")  # orphan past a gap
    idx.insert(kda_key(hs[3]), KDA, 10, node_id="n0")  # checkpoint past the run is useless
    m = idx.match_prefix(hs)
    assert (m.usable_blocks, m.mla_run_blocks, m.checkpoint_key) == (0, 2, None)
    idx.insert(mla_key(hs[2]), MLA, 10, parent=mla_key(hs[1]), node_id="n0")  # gap filled: re-linked
    assert idx.match_prefix(hs).usable_blocks == 4
    assert_prefix_closed(idx)


def test_pending_objects_are_invisible_until_commit() -> None:
    idx = make()
    hs = chain(1)
    idx.insert(mla_key(hs[0]), MLA, 10, node_id="n0", pending=True)
    idx.insert(kda_key(hs[0]), KDA, 10, node_id="n0", pending=True)
    assert idx.match_prefix(hs).mla_run_blocks == 0
    assert idx.lookup([mla_key(hs[0])]) == [None]
    with pytest.raises(DuplicateKeyError) as err:
        idx.insert(mla_key(hs[0]), MLA, 10, node_id="n0")
    assert err.value.pending
    idx.commit(mla_key(hs[0]))
    idx.commit(kda_key(hs[0]))
    assert idx.match_prefix(hs).usable_blocks == 1
    with pytest.raises(UnknownKeyError):
        idx.commit(mla_key(hs[0]))


def test_bad_input_raises_typed_errors() -> None:
    idx = make()
    with pytest.raises(BadObjectError):
        idx.insert(b"M" + b"x" * 5, MLA, 10, node_id="n0")
    with pytest.raises(BadObjectError):
        idx.insert(b"blob", BLOB, 0, node_id="n0")
    with pytest.raises(BadObjectError):
        idx.insert(b"Ttail", TAIL, 10, node_id="n0")  # no TTL
    with pytest.raises(BadObjectError):
        idx.match_prefix([b"short"])
    with pytest.raises(CapacityError):
        idx.insert(b"big", BLOB, 10_001, node_id="n0")
    with pytest.raises(UnknownPolicyError):
        PrefixIndex(policy="nope")


# ---------------------------------------------------------------- recency: probes never keep objects alive


def test_lookup_storm_does_not_prevent_eviction() -> None:
    clock = Clock()
    idx = make(clock, cap=100, high_watermark=0.9, low_watermark=0.5)
    old, new = chain(1, "old"), chain(4, "new")
    put_chain(idx, old)
    clock.advance(1)
    put_chain(idx, new[:3])
    for _ in range(1000):  # a storm of probes on the oldest object
        clock.advance(0.001)
        assert idx.match_prefix(old, require_checkpoint=False).usable_blocks == 1
        assert idx.lookup([mla_key(old[0])])[0] is not None
    for i in range(3, 4):
        idx.insert(mla_key(new[i]), MLA, 60, parent=mla_key(new[i - 1]), node_id="n0")
    assert mla_key(old[0]) not in idx, "probes kept the oldest object alive"


def test_touch_true_counts_as_use() -> None:
    clock = Clock()
    idx = make(clock, cap=100, high_watermark=0.9, low_watermark=0.85)
    a, b = chain(1, "a"), chain(1, "b")
    put_chain(idx, a)
    clock.advance(1)
    put_chain(idx, b)
    clock.advance(1)
    idx.match_prefix(a, require_checkpoint=False, touch=True)
    idx.insert(b"blob", BLOB, 75, node_id="n0")
    assert mla_key(a[0]) in idx and mla_key(b[0]) not in idx


# ---------------------------------------------------------------- eviction by bytes, leaf-first


def test_watermarks_by_bytes() -> None:
    idx = make(cap=1000, high_watermark=0.9, low_watermark=0.6)
    for i in range(9):
        idx.insert(f"b{i}".encode(), BLOB, 100, node_id="n0")
    assert idx.stats().bytes == 900  # at the high watermark, not above: nothing evicted
    idx.insert(b"b9", BLOB, 50, node_id="n0")  # 950 > 900 -> drain to <= 600
    st = idx.stats()
    assert st.bytes <= 600 and st.evictions == 4 and st.evicted_bytes == 400
    assert [e.key for e in idx.drain_events()] == [b"b0", b"b1", b"b2", b"b3"]


def test_suffix_evicted_before_prefix_even_when_prefix_is_older() -> None:
    clock = Clock()
    idx = make(clock, cap=100, high_watermark=0.9, low_watermark=0.3)
    hs = chain(5)
    put_chain(idx, hs, checkpoints=(5,))
    clock.advance(10)
    idx.lookup(
        [mla_key(hs[4])], touch=True
    )  # the leaf is hot, its prefix cold: still the suffix must go first
    idx.insert(b"x", BLOB, 50, node_id="n0")
    gone = [e.key for e in idx.drain_events()]
    assert gone[0] == kda_key(hs[4]), "the checkpoint is a leaf and goes before its MLA block"
    assert gone[1:] == [mla_key(h) for h in reversed(hs)][: len(gone) - 1]
    assert_prefix_closed(idx)


def test_checkpoint_evicted_alone_keeps_mla_chain() -> None:
    clock = Clock()
    idx = make(clock, cap=100, high_watermark=0.95, low_watermark=0.9)
    hs = chain(3)
    put_chain(idx, hs[:2], ck_size=40, checkpoints=(2,))
    clock.advance(1)
    idx.lookup([mla_key(hs[0]), mla_key(hs[1])], touch=True)
    idx.insert(b"x", BLOB, 45, node_id="n0")  # 105 > 95 -> the cold checkpoint alone is enough
    assert kda_key(hs[1]) not in idx
    m = idx.match_prefix(hs)
    assert (m.usable_blocks, m.mla_run_blocks) == (0, 2)


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost"])
def test_prefix_closed_under_heavy_eviction_pressure(policy: str) -> None:
    """Randomised: after every insert (and so every eviction round) the cache is prefix-closed."""
    rng = random.Random(7)
    clock = Clock()
    idx = make(clock, cap=3_000, policy=policy, high_watermark=0.9, low_watermark=0.6)
    roots = [chain(40, f"root{r}") for r in range(6)]
    for step in range(400):
        clock.advance(rng.random())
        base = rng.choice(roots)
        n = rng.randint(1, 40)
        hs = base[:n]
        m = idx.match_prefix(hs, require_checkpoint=False, touch=rng.random() < 0.5)
        parent = mla_key(hs[m.mla_run_blocks - 1]) if m.mla_run_blocks else b""
        for i in range(m.mla_run_blocks, n):
            idx.insert(mla_key(hs[i]), MLA, rng.randint(5, 40), parent=parent, node_id="n0")
            parent = mla_key(hs[i])
            if rng.random() < 0.2 and kda_key(hs[i]) not in idx:
                idx.insert(kda_key(hs[i]), KDA, rng.randint(20, 200), node_id="n0")
            assert idx.node_usage("n0")[Tier.DRAM][0] <= 3_000
            assert_prefix_closed(idx)
        if step % 50 == 0 and len(idx):
            idx.evict()
            assert_prefix_closed(idx)
    assert idx.stats().evictions > 100


# ---------------------------------------------------------------- pins, leases, TTL


def test_leased_and_pinned_objects_survive_pressure() -> None:
    clock = Clock()
    idx = make(clock, cap=100, high_watermark=0.9, low_watermark=0.1)
    hs = chain(2)
    put_chain(idx, hs[:1])
    idx.insert(b"pinned", BLOB, 10, node_id="n0")
    lease = idx.acquire([mla_key(hs[0]), b"absent"])
    assert lease is not None and lease.keys == (mla_key(hs[0]),)
    assert idx.pin([b"pinned"], ttl_ms=60_000) == 1
    clock.advance(1)
    idx.insert(b"fill", BLOB, 75, node_id="n0")
    assert mla_key(hs[0]) in idx and b"pinned" in idx
    assert idx.stats().bytes == 95, "nothing evictable: leased, pinned and the new object stay"
    # lease deadline passes -> the read pin goes away by itself
    clock.advance(idx.lease_ms / 1000 + 0.001)
    idx.expire()
    assert idx.stats().active_leases == 0
    idx.insert(b"more", BLOB, 10, node_id="n0")
    assert mla_key(hs[0]) not in idx and b"pinned" in idx
    clock.advance(61)
    idx.insert(b"more2", BLOB, 80, node_id="n0")
    assert b"pinned" not in idx, "the soft pin expired, the object must be evictable again"


def test_release_and_slot_reuse_after_forced_removal() -> None:
    idx = make()
    idx.insert(b"a", BLOB, 10, node_id="n0")
    lease = idx.acquire([b"a"])
    assert lease is not None
    assert idx.remove(b"a")
    idx.insert(b"b", BLOB, 10, node_id="n0")  # must not reuse a's slot while the lease holds it
    assert idx.release(lease.lease_id) and not idx.release(lease.lease_id)
    info = idx.get(b"b")
    assert info is not None and info.leases == 0
    idx.insert(b"c", BLOB, 10, node_id="n0")
    assert idx.get(b"c") is not None and idx.get(b"b") is not None


def test_tail_ttl_expiry() -> None:
    clock = Clock()
    idx = make(clock)
    idx.insert(b"Treq1", TAIL, 10, ttl_ms=500, node_id="n0")
    idx.insert(b"Treq2", TAIL, 10, ttl_ms=2000, node_id="n0")
    clock.advance(0.4)
    assert idx.expire() == [] and b"Treq1" in idx
    info = idx.get(b"Treq1")
    assert info is not None and 0 < info.ttl_ms <= 100
    clock.advance(0.2)
    assert [r.key for r in idx.expire()] == [b"Treq1"]
    lease = idx.acquire([b"Treq2"])
    clock.advance(1.5)
    assert idx.expire() == [] and b"Treq2" in idx, "a tail being read outlives its TTL until released"
    assert lease is not None
    idx.release(lease.lease_id)
    clock.advance(0.1)
    assert [r.key for r in idx.expire()] == [b"Treq2"]


# ---------------------------------------------------------------- quotas, nodes, tiers


def test_quota_evicts_own_objects_first_then_refuses() -> None:
    clock = Clock()
    idx = make(clock)
    idx.set_quota("t1", 100)
    for i in range(5):
        idx.insert(f"t1-{i}".encode(), BLOB, 20, tenant="t1", node_id="n0")
        idx.insert(f"t2-{i}".encode(), BLOB, 20, tenant="t2", node_id="n0")
        clock.advance(1)
    idx.insert(b"t1-new", BLOB, 30, tenant="t1", node_id="n0")
    assert b"t1-0" not in idx and b"t1-1" not in idx and b"t1-2" in idx
    assert all(f"t2-{i}".encode() in idx for i in range(5)), "another tenant paid for t1's quota"
    assert idx.stats().bytes_per_tenant["t1"] == 90
    idx.pin([k for k in idx if k.startswith(b"t1")], ttl_ms=60_000)
    with pytest.raises(QuotaExceededError):
        idx.insert(b"t1-x", BLOB, 20, tenant="t1", node_id="n0")
    with pytest.raises(QuotaExceededError):
        idx.insert(b"t1-y", BLOB, 101, tenant="t1", node_id="n0")


def test_placement_by_free_space_and_node_loss() -> None:
    idx = PrefixIndex(clock=Clock())
    idx.add_node("a", 100)
    idx.add_node("b", 300)
    placed = [idx.insert(f"o{i}".encode(), BLOB, 50) for i in range(6)]
    assert placed.count("b") > placed.count("a") >= 1
    lost = idx.remove_node("b")
    assert {r.key for r in lost} == {f"o{i}".encode() for i, n in enumerate(placed) if n == "b"}
    assert len(idx) == placed.count("a") and idx.drain_events() == []
    with pytest.raises(CapacityError):
        idx.insert(b"huge", BLOB, 101)


def test_ssd_tier_demotes_then_drops_leaves() -> None:
    clock = Clock()
    idx = PrefixIndex(clock=clock, high_watermark=0.9, low_watermark=0.5)
    idx.add_node("n0", 100, ssd_bytes=100)
    hs = chain(4)
    put_chain(idx, hs, size=30)  # 120 > 90 on DRAM -> oldest demoted to SSD
    events = idx.drain_events()
    assert events and all(e.demoted for e in events)
    m = idx.match_prefix(hs, require_checkpoint=False)
    assert m.usable_blocks == 4, "demoted objects stay indexed"
    tiers = [info.tier for info in idx.lookup(m.mla_keys) if info]
    assert Tier.SSD in tiers and Tier.DRAM in tiers
    for i in range(6):
        clock.advance(1)
        idx.insert(f"x{i}".encode(), BLOB, 30, node_id="n0")
    used = idx.node_usage("n0")
    assert used[Tier.DRAM][0] <= 100 and used[Tier.SSD][0] <= 100
    assert_prefix_closed(idx)


def test_randomized_operations_keep_bookkeeping_exact() -> None:
    rng = random.Random(11)
    clock = Clock()
    idx = PrefixIndex(clock=clock, high_watermark=0.8, low_watermark=0.5, lease_ms=2000)
    idx.add_node("a", 2_000, ssd_bytes=1_000)
    idx.add_node("b", 1_500)
    idx.set_quota("q", 600)
    chains = [chain(30, f"r{r}") for r in range(4)]
    leases: list[int] = []
    for _ in range(3000):
        clock.advance(rng.random() * 0.05)
        op = rng.random()
        try:
            if op < 0.45:
                hs = rng.choice(chains)
                i = rng.randrange(len(hs))
                kind = rng.choice([MLA, MLA, KDA])
                key = mla_key(hs[i]) if kind == MLA else kda_key(hs[i])
                if key not in idx and not idx.is_pending(key):
                    idx.insert(
                        key,
                        kind,
                        rng.randint(5, 60),
                        parent=mla_key(hs[i - 1]) if i else b"",
                        tenant=rng.choice(["", "q", "x"]),
                        pending=rng.random() < 0.2,
                    )
            elif op < 0.55:
                idx.insert(f"T{rng.random()}".encode(), TAIL, rng.randint(5, 30), ttl_ms=rng.randint(10, 300))
            elif op < 0.62 and idx.pending_keys():
                idx.commit(rng.choice(idx.pending_keys()))
            elif op < 0.68 and len(idx):
                idx.remove(rng.choice(list(idx)))
            elif op < 0.76 and len(idx):
                keys = rng.sample(list(idx), min(3, len(idx)))
                lease = idx.acquire(keys, lease_ms=rng.randint(10, 500))
                if lease is not None:
                    leases.append(lease.lease_id)
            elif op < 0.82 and leases:
                idx.release(leases.pop(rng.randrange(len(leases))))
            elif op < 0.86 and len(idx):
                session = rng.choice(["", "s1", "s2"])
                idx.pin(rng.sample(list(idx), rng.randint(1, 4)), rng.choice([0, 100, 1000]), session)
                if rng.random() < 0.2:
                    idx.end_session(rng.choice(["", "q", "x"]), rng.choice(["s1", "s2"]))
            elif op < 0.92 and len(idx):
                idx.promote(rng.choice(list(idx)))
            elif op < 0.93:
                idx.remove_node("b")
                idx.add_node("b", 1_500)
            else:
                idx.expire()
        except (CapacityError, QuotaExceededError):
            pass  # everything pinned/leased at that moment: refusing is the right answer
        assert idx.verify() == []  # every incrementally kept count equals a recount
    st = idx.stats()
    assert st.evictions > 50 and st.demotions > 10 and st.expired > 10


def test_object_cap_evicts_leaves_ahead_of_it_in_policy_order() -> None:
    """The index's memory is per object: with ``max_objects`` the count never passes the cap, eviction
    starts at the high watermark and drains to the low one, leaf-first and oldest first (LRU here); pinned
    and leased objects stay; with nothing evictable an insert is refused instead of passing the cap."""
    clock = Clock()
    idx = PrefixIndex("lru", clock=clock, max_objects=100, high_watermark=0.9, low_watermark=0.5)
    idx.add_node("n0", 1 << 40)
    chains = [chain(5, f"cap-{i}") for i in range(60)]
    for hs in chains:
        clock.advance(1.0)
        put_chain(idx, hs)
        assert len(idx) <= 90
    assert 50 <= len(idx) <= 90 and idx.stats().evictions == 300 - len(idx)
    newest = chains[-1]
    assert idx.match_prefix(newest, require_checkpoint=False).mla_run_blocks == 5  # the newest stays whole
    assert idx.match_prefix(chains[0], require_checkpoint=False).mla_run_blocks == 0  # the oldest went
    for i in range(len(newest) - 1):  # every surviving object still has its whole prefix (leaf-first)
        if mla_key(newest[i + 1]) in idx:
            assert mla_key(newest[i]) in idx
    # everything pinned: an insert that would pass the cap is refused, the count stays at the cap
    idx.pin([k for hs in chains for k in map(mla_key, hs) if k in idx], 60_000)
    with pytest.raises(CapacityError, match="its cap"):
        for i in range(200):
            key = mla_key(chain(1, f"over-{i}")[0])
            idx.insert(key, MLA, 10, node_id="n0")
            idx.pin([key], 60_000)
    assert len(idx) == 100


def test_object_cap_out_of_range() -> None:
    with pytest.raises(ValueError, match="max_objects"):
        PrefixIndex("lru", max_objects=-1)


def test_an_emptied_index_gives_its_storage_back() -> None:
    """After its last object goes (here: its node lost), the columns, slot lists and dicts start afresh
    instead of keeping the size of their largest moment (the master then trims the freed heap)."""
    idx = PrefixIndex("lru")
    idx.add_node("n0", 1 << 40)
    for i in range(30):
        put_chain(idx, chain(200, f"big-{i}"))
    assert idx.allocated_slots >= 6000
    assert len(idx.remove_node("n0")) == 6000
    assert len(idx) == 0 and idx.allocated_slots == 1024
    idx.add_node("n0", 1 << 40)
    put_chain(idx, chain(3, "again"))  # and works as before
    assert idx.match_prefix(chain(3, "again"), require_checkpoint=False).mla_run_blocks == 3


# ---------------------------------------------------------------- pins: holders, sessions, the budget


def test_pins_are_held_per_session_and_budgeted() -> None:
    """A retention hint pins a chain for its session; the object stays pinned while any holder holds it;
    ending a session releases only its own pins; a pin past ``pin_share`` of the DRAM capacity or of the
    tenant's quota pins nothing and is counted, never raised."""
    clock = Clock()
    idx = make(clock, cap=1_000, pin_share=0.5)
    for i in range(8):
        idx.insert(f"a{i}".encode(), BLOB, 100, tenant="t", node_id="n0")
    system, conv1, conv2 = [b"a0"], [b"a1", b"a2"], [b"a3"]
    assert idx.pin(system + conv1, 60_000, session="c1") == 3
    assert idx.pin(system + conv2, 60_000, session="c2") == 2
    st = idx.stats()
    assert (st.soft_pins, st.pinned_bytes, st.pins_refused) == (4, 400, 0), "a0 counts once"
    assert idx.pin([b"a4", b"a5"], 60_000, session="c3") == 0, "500 > 0.5 x 1000: nothing pinned"
    assert idx.stats().pins_refused == 1 and not idx.get(b"a4").pinned
    assert idx.end_session("other-tenant", "c1") == 0, "a session is its tenant's"
    assert idx.end_session("t", "c1") == 3
    assert idx.get(b"a0").pinned, "c2 still holds the shared system prompt"
    assert not idx.get(b"a1").pinned and idx.stats().pinned_bytes == 200
    clock.advance(61)
    idx.expire()
    assert idx.stats().pinned_bytes == 0 and idx.stats().soft_pins == 0
    idx.set_quota("t", 600)  # the tenant's own budget: 300 bytes
    assert idx.pin([b"a6", b"a7", b"a5", b"a4"], 1_000, session="c4") == 0
    assert idx.pin([b"a6", b"a7"], 1_000, session="c4") == 2
    idx.remove(b"a6")  # a dropped object leaves the budget and its session
    assert idx.stats().pinned_bytes == 100 and idx.end_session("t", "c4") == 1
    assert idx.pin([b"a4", b"a5", b"a7"], 1_000) == 3, "an operator's pin (no session) is not budgeted"
    assert idx.pin([b"a7"], 5_000, session="c5") == 1
    clock.advance(2)
    idx.expire()  # the operator's deadline passed, the session's did not: a7 stays pinned for c5
    assert [idx.get(k).pinned for k in (b"a4", b"a7")] == [False, True] and idx.stats().pinned_bytes == 100
    assert idx.verify() == []


def test_pins_earn_their_budget_by_being_read() -> None:
    """Clients' pins keep their budget only while pinned objects are read at least as densely (blocks
    served per byte held) as the rest: pins nobody reads lose it, so new session pins are refused (the
    object stays cached, ranked by the policy), while operators' pins are never refused; with nothing
    pinned the budget is tried again. (``kvstore/index/pin_budget.py``.)"""
    clock = Clock()
    idx = make(clock, cap=100_000, pin_share=0.5)
    pinned, busy = chain(4, "pinned"), chain(4, "busy")
    put_chain(idx, pinned, checkpoints=(4,))
    put_chain(idx, busy, checkpoints=(4,))
    pin_keys = [mla_key(h) for h in pinned] + [kda_key(pinned[-1])]
    assert idx.pin(pin_keys, 600_000, session="s1") == 5
    assert idx.pin_budget.earned == 1.0
    for _ in range(60):  # every lookup reads the unpinned chain: the pins hold what nobody reads
        assert idx.match_prefix(busy, touch=True).usable_blocks == 4
    assert idx.pin_budget.earned == 0.0
    late = chain(2, "late")
    put_chain(idx, late, checkpoints=(2,))
    late_keys = [mla_key(h) for h in late] + [kda_key(late[-1])]
    assert idx.pin(late_keys, 600_000, session="s2") == 0, "no budget earned: refused, counted"
    assert idx.stats().pins_refused == 1 and late_keys[0] in idx
    assert idx.pin(late_keys, 600_000) == 3, "an operator's pin is never budgeted"
    idx.pin(late_keys, 0)
    for _ in range(150):  # now the pinned chain is what writers read: pins pay (the sums forget slowly)
        assert idx.match_prefix(pinned, touch=True).usable_blocks == 4
    assert idx.pin_budget.earned == 1.0
    assert idx.pin(late_keys, 600_000, session="s2") == 3
    assert idx.end_session("", "s1") == 5 and idx.end_session("", "s2") == 3
    idx.pin_budget.earned = 0.0
    idx.match_prefix(busy, touch=True)  # nothing pinned: no evidence, the budget is tried again
    assert idx.pin_budget.earned > 0.0
    assert idx.verify() == []


def test_a_resume_read_is_touched_and_leased_but_teaches_the_index_nothing() -> None:
    """Decode's read of the chain prefill just wrote (``resume``, as the master is asked) keeps its
    objects warm like any fetch, but it is no writer's lookup: no ticket for what it lacks, no shadow-LRU or
    admission sample, and blocks it is served through a pin do not count for the pin budget (a fresh pin
    would be credited with a read on every hinted request). A writer's read of the same chain is all of
    those."""
    clock = Clock()
    idx = make(clock, cap=100_000, policy="hybrid", pin_share=0.5, admission=AdmissionConfig())
    fresh, busy = chain(6, "fresh"), chain(4, "busy")
    put_chain(idx, fresh[:4], checkpoints=(4,))
    put_chain(idx, busy, checkpoints=(4,))
    assert idx.pin([mla_key(h) for h in fresh[:4]] + [kda_key(fresh[3])], 600_000, session="s") == 5
    policy, admission = idx.policy, idx.admission
    assert admission is not None

    def learned() -> tuple:
        m, g = policy.model, policy.guard
        return (m.observed, dict(m.tickets.items()), g.ours, g.shadow, g.lead, g.keys(), admission.tickets())

    for _ in range(60):
        clock.advance(1.0)
        assert idx.match_prefix(busy, touch=True).usable_blocks == 4
        before = learned()
        m = idx.match_prefix(fresh, require_checkpoint=False, touch=True, resume=True)
        assert m.mla_run_blocks == 4 and learned() == before
        assert idx.get(mla_key(fresh[3])).last_use == clock()  # touched: used now
    assert idx.pin_budget.earned == 0.0, "only decode read the pinned chain: its pin earned nothing"
    assert idx.pin_budget._recent[0] == 0.0  # no block counted as served through a pin
    before = learned()
    idx.match_prefix(fresh, touch=True)  # a writer's lookup of the same chain: every hook hears it
    after = learned()
    assert fresh[4] in after[1] and fresh[4] not in before[1] and after[0] > before[0]
    assert idx.pin_budget._recent[0] > 0.0
    assert idx.verify() == []


def test_pure_mla_pins_earn_their_budget_and_a_fixed_budget_never_moves() -> None:
    """A pure-MLA hit has no checkpoint: the block that makes it usable (the run's deepest) is what a pin
    holds, so reads of a pinned pure-MLA chain count for the pins. With ``pin_budget_step=0`` the budget is
    the whole ``pin_share``, whatever is read."""
    for step in (0.02, 0.0):
        idx = make(Clock(), cap=100_000, pin_share=0.5, pin_budget_step=step)
        pinned, other = chain(4, "mla-pinned"), chain(4, "mla-other")
        put_chain(idx, pinned)
        put_chain(idx, other)
        assert idx.pin([mla_key(h) for h in pinned], 600_000, session="s") == 4
        for _ in range(60):
            assert idx.match_prefix(pinned, require_checkpoint=False, touch=True).usable_blocks == 4
        assert idx.pin_budget.earned == 1.0, "the pinned chain is what is read: pins keep their budget"
        for _ in range(200):
            idx.match_prefix(other, require_checkpoint=False, touch=True)
        # now the rest is what is read: an earning budget falls, a fixed one stays
        assert idx.stats().pin_budget_earned == (1.0 if step == 0 else 0.0), step


def test_a_put_of_a_committed_block_refreshes_it() -> None:
    """A writer that puts a present block again used it: ``insert_chain`` touches it (EXISTS), so LRU
    evicts the block nobody put since, not the one just re-sent."""
    clock = Clock()
    idx = make(clock, cap=30, policy="lru", high_watermark=1.0, low_watermark=1.0)
    old, other, new = chain(1, "old"), chain(1, "other"), chain(1, "new")
    idx.insert_chain(old, [10], [True], node_id="n0")
    clock.t += 1
    idx.insert_chain(other, [10], [True], node_id="n0")
    clock.t += 1
    assert idx.insert_chain(old, [10], [True], node_id="n0") == [-PUT_EXISTS]
    clock.t += 1
    idx.insert_chain(new + chain(1, "more"), [10, 10], [True, True], node_id="n0")
    assert mla_key(old[0]) in idx and mla_key(other[0]) not in idx


def test_insert_chain_answers_what_a_writer_counts_as_outcomes_and_raises_the_rest() -> None:
    """The simulator's bulk put, column-wise: per object its slot or the outcome ``insert`` would give,
    with EXISTS, NOT_ADMITTED and NO_ROOM as answers (not exceptions); a pending key raises as ``insert``
    does, after the objects before it were put; a malformed chain raises before anything is put."""
    idx = make(Clock(), cap=100)
    hs = chain(3, "bulk")
    m = [mla_key(h) for h in hs]
    idx.insert(m[0], MLA, 10, node_id="n0")
    out = idx.insert_chain(hs, [10, 10, 500], [True] * 3, node_id="n0")
    assert out[0] == -PUT_EXISTS and out[2] == -PUT_NO_ROOM, "500 bytes fit no pool of 100"
    assert m[1] in idx and m[2] not in idx and out[1] in idx.committed_slots()
    assert idx.get(m[1]).parent == m[0], "a block's parent is the block before it"
    out = idx.insert_chain(hs[:2], [10, 10], [True, True], [(2, 7, True)], node_id="n0")
    assert out[:2] == [-PUT_EXISTS, -PUT_EXISTS] and out[2] >= 0
    assert idx.match_prefix(hs).usable_blocks == 2, "the checkpoint closes block 2"
    refusing = make(
        Clock(), cap=100, policy="depth", admission=AdmissionConfig(initial_rate=0.0, min_rate=0.0)
    )
    other = chain(2, "refused")
    refusing.match_prefix(other, touch=True)  # a new chain sampled at rate 0: refused
    assert refusing.insert_chain(other[:1], [10], [True], node_id="n0") == [-PUT_NOT_ADMITTED]
    assert refusing.insert_chain(other[:1], [10], [False], node_id="n0")[0] >= 0, "retained"
    pending = chain(2, "x")
    idx.insert(mla_key(pending[1]), MLA, 5, node_id="n0", pending=True)
    with pytest.raises(DuplicateKeyError):
        idx.insert_chain(pending, [5, 5], [True, True], node_id="n0")
    assert mla_key(pending[0]) in idx, "what came before the raise was put"
    before = len(idx)
    for bad in (
        ([hs[0], b"short"], [5, 5], [True, True], ()),
        ([hs[0]], [0], [True], ()),
        ([hs[0]], [5, 5], [True], ()),
        ([hs[0]], [5], [True], [(2, 5, True)]),
    ):
        with pytest.raises(BadObjectError):
            idx.insert_chain(*bad, node_id="n0")
    assert len(idx) == before, "a malformed chain puts nothing"
    assert idx.verify() == []
