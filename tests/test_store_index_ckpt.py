"""match_prefix's checkpoint bit (the CKPT flag of the MLA slot) agrees with a reference built from
lookup/get, and a block key's tag is its kind (one kind field): nothing else may use a block key."""

from __future__ import annotations

import random

import pytest
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import BadObjectError, CapacityError, ObjectKind, QuotaExceededError
from kvpool.kvstore.keys import HASH_BYTES, kda_key, mla_key

from tests.harness.chains import chain
from tests.harness.clock import Clock

MLA, KDA, TAIL, BLOB = ObjectKind.MLA, ObjectKind.KDA, ObjectKind.TAIL, ObjectKind.BLOB


def reference(idx: PrefixIndex, hashes: list[bytes], require_checkpoint: bool) -> tuple:
    """The joint prefix rule straight from lookup (committed objects only), one block at a time."""
    keys: list[bytes] = []
    checkpoints: list[int] = []
    for h in hashes:
        if idx.lookup([mla_key(h)])[0] is None:
            break
        keys.append(mla_key(h))
        if idx.lookup([kda_key(h)])[0] is not None:
            assert idx.get(kda_key(h)) is not None and idx.get(kda_key(h)).committed
            checkpoints.append(len(keys))
    run = len(keys)
    if require_checkpoint:
        usable = checkpoints[-1] if checkpoints else 0
        ck = kda_key(hashes[usable - 1]) if usable else None
    else:
        usable, ck = run, None
    return usable, run, tuple(checkpoints), tuple(keys[:usable]), ck


def check_matches(idx: PrefixIndex, clock: Clock, queries: list[list[bytes]], rng: random.Random) -> None:
    for hashes in queries:
        for req in (True, False):
            m = idx.match_prefix(hashes, require_checkpoint=req)
            got = (m.usable_blocks, m.mla_run_blocks, m.checkpoint_blocks, m.mla_keys, m.checkpoint_key)
            assert got == reference(idx, hashes, req)
            assert all(type(c) is int for c in m.checkpoint_blocks)
    # touch marks exactly the usable MLA blocks and the closing checkpoint
    hashes = rng.choice(queries)
    req = rng.random() < 0.7
    clock.advance(0.001)  # a time no earlier use shares
    m = idx.match_prefix(hashes, require_checkpoint=req, touch=True)
    touched = {k for k in idx if (info := idx.get(k)) is not None and info.last_use == clock.t}
    assert touched == {*m.mla_keys, *([m.checkpoint_key] if m.checkpoint_key else [])}


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_fast_match_equals_reference_under_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    policy = "lru" if seed % 2 else "lfu"
    idx = PrefixIndex(policy, clock=clock, high_watermark=0.8, low_watermark=0.5, lease_ms=2000)
    idx.add_node("a", 600, ssd_bytes=300 if seed % 3 else 0)
    idx.add_node("b", 500)
    idx.set_quota("q", 500)
    base = chain(24, f"s{seed}")
    # chains sharing a prefix, so one block set serves several queries
    chains = [base, base[:10] + chain(14, f"f{seed}"), chain(20, f"o{seed}")]
    queries = [*chains, base[:5], [*base, b"\x00" * HASH_BYTES], []]
    leases: list[int] = []
    for _ in range(1500):
        clock.t += rng.random() * 0.05
        op = rng.random()
        try:
            if op < 0.5:
                hs = rng.choice(chains)
                i = int(len(hs) * rng.random() ** 2)  # early blocks more often: long usable prefixes
                kind = rng.choice([MLA, MLA, KDA, KDA, BLOB])
                tagged = kda_key(hs[i]) if kind != MLA else mla_key(hs[i])
                if kind == BLOB or rng.random() < 0.05:  # a blob may not use a block key of either tag
                    with pytest.raises(BadObjectError):
                        idx.insert(tagged, BLOB, 10)
                    tagged, kind = b"B" + tagged[1:], BLOB  # it takes its own key (and its bytes count)
                if tagged not in idx and not idx.is_pending(tagged):
                    idx.insert(
                        tagged,
                        kind,
                        rng.randint(5, 50),
                        parent=mla_key(hs[i - 1]) if i and kind == MLA else b"",
                        tenant=rng.choice(["", "q", "x"]),
                        pending=rng.random() < 0.25,
                        ttl_ms=rng.choice([0] * 7 + [rng.randint(20, 400)]),
                    )
            elif op < 0.6 and idx.pending_keys():
                idx.commit(rng.choice(idx.pending_keys()))
            elif op < 0.67 and (len(idx) or idx.pending_keys()):
                idx.remove(rng.choice(list(idx) + idx.pending_keys()))
            elif op < 0.72 and len(idx):
                lease = idx.acquire(rng.sample(list(idx), min(3, len(idx))), lease_ms=rng.randint(10, 300))
                if lease is not None:
                    leases.append(lease.lease_id)
            elif op < 0.76 and leases:
                idx.release(leases.pop(rng.randrange(len(leases))))
            elif op < 0.8 and len(idx):
                idx.pin(rng.sample(list(idx), 1), ttl_ms=rng.choice([0, 100]))
            elif op < 0.85 and len(idx):
                idx.promote(rng.choice(list(idx)))
            elif op < 0.87:
                idx.remove_node("b")
                idx.add_node("b", 500)
            elif op < 0.9:
                idx.insert(f"T{rng.random()}".encode(), TAIL, rng.randint(5, 30), ttl_ms=rng.randint(10, 200))
            elif op < 0.95:
                idx.expire()
            else:
                idx.evict()
        except (CapacityError, QuotaExceededError):
            pass
        assert idx.verify() == []  # the checkpoint bits included
        check_matches(idx, clock, queries, rng)
    st = idx.stats()
    assert st.evictions > 0 and st.expired > 0  # the run did exercise pressure and TTLs


def test_checkpoint_bit_edge_cases() -> None:
    clock = Clock()
    idx = PrefixIndex(clock=clock)
    idx.add_node("n", 1 << 20)
    hs = chain(4, "e")

    def usable() -> int:
        m = idx.match_prefix(hs)
        assert (m.usable_blocks, m.mla_run_blocks, m.checkpoint_blocks, m.mla_keys, m.checkpoint_key) == (
            reference(idx, hs, True)
        )
        return m.usable_blocks

    idx.insert(kda_key(hs[1]), KDA, 10)  # checkpoint before its MLA block
    assert usable() == 0
    for i in range(2):
        idx.insert(mla_key(hs[i]), MLA, 10, parent=mla_key(hs[i - 1]) if i else b"", pending=i == 1)
    assert usable() == 0  # block 1 still pending
    idx.commit(mla_key(hs[1]))
    assert usable() == 2
    idx.remove(kda_key(hs[1]))  # checkpoint gone, MLA stays
    assert usable() == 0 and idx.match_prefix(hs).mla_run_blocks == 2
    idx.insert(kda_key(hs[1]), KDA, 10, pending=True)
    assert usable() == 0
    idx.commit(kda_key(hs[1]))
    assert usable() == 2
    idx.remove(mla_key(hs[1]))  # MLA gone, checkpoint stays (orphan)
    assert usable() == 0
    idx.insert(mla_key(hs[1]), MLA, 10, parent=mla_key(hs[0]))  # back: re-linked, checkpoint counts again
    assert usable() == 2
    idx.insert(kda_key(hs[0]), KDA, 10, ttl_ms=100)
    idx.remove(kda_key(hs[1]))
    assert usable() == 1
    clock.t += 1
    idx.expire()
    assert usable() == 0
    idx.remove_node("n")
    idx.add_node("n", 1 << 20)
    assert usable() == 0 and len(idx) == 0
    for key in (kda_key(hs[2]), mla_key(hs[2])):  # one kind per key tag: no blob under a block key
        with pytest.raises(BadObjectError):
            idx.insert(key, BLOB, 10)
    with pytest.raises(BadObjectError):
        idx.insert(mla_key(hs[2]), KDA, 10)
    idx.insert(kda_key(hs[2]), KDA, 10)  # the checkpoint before its block: it waits as an orphan
    idx.insert(mla_key(hs[0]), MLA, 10)
    idx.insert(mla_key(hs[1]), MLA, 10, parent=mla_key(hs[0]))
    assert usable() == 0
    idx.insert(mla_key(hs[2]), MLA, 10, parent=mla_key(hs[1]))  # adopts the waiting checkpoint
    assert usable() == 3
    with pytest.raises(BadObjectError):
        idx.match_prefix([b"short"])
