"""cache/store_io against the in-process MemoryStore: exact round trip, every fallback path counted."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvpool.cache.hashing import hash_blocks, root_hash
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.model.loader import load_model
from kvpool.worker.store_io import DeferredCalls, fetch_prefix
from kvpool.worker.store_push import block_items, checkpoint_items, push_groups

from tests.harness.memory_store import MemoryStore

B = 64


@pytest.fixture(scope="module")
def setup():
    model = load_model("tiny")
    schema = model.cache_schema(B)
    tokens = [(i * 37) % 1000 + 3 for i in range(4 * B)]
    hashes = hash_blocks(tokens, B, root_hash(model.fingerprint(), "t"))
    result = model.prefill(tokens, boundaries=[B, 2 * B, 3 * B, 4 * B])
    return model, schema, tokens, hashes, result


def _stored(setup, checkpoints=(1, 2, 3)):
    _, schema, _, hashes, result = setup
    store = MemoryStore()

    async def fill():
        await push_groups(store, [block_items(schema, hashes, result.mla, 0, 4, "t")])
        await push_groups(
            store, [checkpoint_items(schema, hashes, [result.checkpoints[c * B] for c in checkpoints], "t")]
        )

    asyncio.run(fill())
    return store


def _fetch(store, schema, hashes, tenant="t", **kw):
    """fetch_prefix, then wait for its deferred lease release (so a test can check the leases)."""

    async def go():
        deferred = DeferredCalls()
        got = await fetch_prefix(store, schema, hashes, tenant, deferred, **kw)
        await deferred.drain()
        return got

    return asyncio.run(go())


def _same(prefix, result):
    n = prefix.n_tokens
    ref = result.prefix(n)
    for i, rows in ref.mla.items():
        assert torch.equal(prefix.mla[i], rows)
    for i, st in ref.kda.layers.items():
        assert torch.equal(prefix.kda.layers[i].recurrent, st.recurrent)
        assert torch.equal(prefix.kda.layers[i].conv, st.conv)


def test_round_trip_is_bit_exact_and_releases_lease(setup):
    _, schema, _, hashes, result = setup
    store = _stored(setup)
    prefix, st = _fetch(store, schema, hashes, "t")
    assert prefix is not None and prefix.n_tokens == 3 * B
    assert (st.matched_blocks, st.mla_run_blocks, st.used_blocks, st.fallbacks) == (3, 4, 3, 0)
    assert st.lost_to_checkpoint(B) == B
    assert not store.leases
    _same(prefix, result)


def test_corrupt_checkpoint_falls_back_to_earlier_one(setup):
    _, schema, _, hashes, result = setup
    store = _stored(setup)
    store.corrupt(kda_key(hashes[2]))
    prefix, st = _fetch(store, schema, hashes, "t")
    assert prefix.n_tokens == 2 * B and st.corrupt == 1 and st.fallbacks == 1
    assert st.recomputed_tokens(B) == B and st.bad_keys == [kda_key(hashes[2])]
    _same(prefix, result)


def test_missing_mla_block_bounds_the_prefix(setup):
    _, schema, _, hashes, result = setup
    store = _stored(setup)
    store.drop(mla_key(hashes[1]))
    prefix, st = _fetch(store, schema, hashes, "t")
    assert prefix.n_tokens == B and st.missing == 1 and st.fallbacks == 1
    _same(prefix, result)
    store.drop(mla_key(hashes[0]))
    prefix, st = _fetch(store, schema, hashes, "t")
    assert prefix is None and st.used_blocks == 0 and not store.leases


def test_unreachable_and_slow_store_serve_without_cache(setup):
    _, schema, _, hashes, _ = setup
    store = _stored(setup)
    store.unreachable = True
    prefix, st = _fetch(store, schema, hashes, "t")
    assert prefix is None and "StoreUnavailableError" in st.error
    store.unreachable = False
    store.delay_s = 1.0
    prefix, st = _fetch(store, schema, hashes, "t", timeout_s=0.1)
    assert prefix is None and st.late >= 1 and not store.leases


def test_other_tenant_misses(setup):
    _, schema, tokens, _, _ = setup
    store = _stored(setup)
    other = hash_blocks(tokens, B, root_hash(schema.fingerprint, "u"))
    prefix, st = _fetch(store, schema, other, "u")
    assert prefix is None and st.matched_blocks == 0


def test_a_put_refused_for_admission_is_counted_not_failed_and_the_prefix_stops_there(setup):
    _, schema, _, hashes, result = setup
    store = MemoryStore()
    store.refuse = {mla_key(hashes[2]), kda_key(hashes[2])}

    async def fill():
        (blocks,) = await push_groups(store, [block_items(schema, hashes, result.mla, 0, 4, "t")])
        (cks,) = await push_groups(
            store, [checkpoint_items(schema, hashes, [result.checkpoints[c * B] for c in (2, 3)], "t")]
        )
        return blocks, cks

    blocks, cks = asyncio.run(fill())
    assert (blocks.objects, blocks.not_admitted, blocks.failed) == (3, 1, 0)
    assert (cks.objects, cks.not_admitted, cks.failed) == (1, 1, 0) and not cks.errors
    prefix, st = _fetch(store, schema, hashes, "t")
    assert st.mla_run_blocks == 2 and prefix is not None and prefix.n_tokens == 2 * B
    _same(prefix, result)
