"""``KvpoolHiCacheStorage`` against SGLang's own ``HiCacheFile``: both built by SGLang's
``StorageBackendFactory`` from one ``HiCacheStorageConfig``, fed the same CPU host pools, keyed by SGLang's
own page hashes (``get_storage_hash_str``); every answer compared. The store is real: a kvpool master and
storage node as processes (``tests/harness``)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult
from sglang.srt.mem_cache.utils import get_storage_hash_str

from tests.sglang_hicache.host_pools import CpuMambaHostPool, CpuMLAHostPool

PAGE = 64


def page_keys(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * PAGE,), generator=g).tolist()
    return get_storage_hash_str(tokens, None, page_size=PAGE)


def filled(pool: CpuMLAHostPool, pages: int, seed: int = 0) -> list[torch.Tensor]:
    for i in range(pages):
        pool.fill(i * PAGE, seed * 1000 + i)
    return [pool.page(i * PAGE) for i in range(pages)]


def indices(pages: range | list[int], page_size: int = PAGE) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])


def remove_page(backend, key: str) -> None:
    """Take one page out of a backend's storage, as eviction would."""
    if type(backend).__name__ == "HiCacheFile":
        os.remove(os.path.join(backend.file_path, f"{backend._get_suffixed_key(key)}.bin"))
    else:
        assert backend.store.remove([backend.keys.object_key(key)[0]]) == 1


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_generic_round_trip(backends, layout):
    src = CpuMLAHostPool(layout=layout)
    want = filled(src, 5)
    keys = page_keys(5)
    for backend in backends(src):
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set(keys, [src.get_data_page(i * PAGE) for i in range(5)]) is True
        assert backend.batch_exists(keys) == 5 and backend.exists(keys[3])
        dst = CpuMLAHostPool(layout=layout)
        got = backend.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
        assert all(g is not None for g in got)
        for i, page in enumerate(got):
            dst.set_from_flat_data_page((4 - i) * PAGE, page)  # elsewhere in the pool
            assert torch.equal(dst.page((4 - i) * PAGE), want[i])
        assert backend.get("0" * 64, dst.get_dummy_flat_data_page()) is None


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_zero_copy_v1_round_trip(backends, layout):
    """kvpool's v1 path moves pages between the pool and the store directly; HiCacheFile has no v1 path (it
    returns None: SGLang runs it on the generic path), so the same pages go through its generic path, and
    both fill the reader's pool identically. A page written by either kvpool path is read by the other."""
    src = CpuMLAHostPool(layout=layout)
    want = filled(src, 6, seed=1)
    keys = page_keys(6, seed=1)
    kv, file = backends(src)
    assert kv.batch_set_v1(keys[:4], indices(range(4))) == [True] * 4
    assert file.batch_set_v1(keys[:4], indices(range(4))) is None
    assert file.batch_set(keys[:4], [src.get_data_page(i * PAGE) for i in range(4)])
    assert kv.batch_set(keys[4:], [src.get_data_page(i * PAGE) for i in range(4, 6)])  # generic -> v1 read
    dst = src  # v1 reads land in the registered host pool, in pages 7-12 (empty so far)
    assert kv.batch_get_v1(keys, indices([7, 8, 9, 10, 11, 12])) == [True] * 6
    via_file = CpuMLAHostPool(layout=layout)
    pages = file.batch_get(keys[:4], [via_file.get_dummy_flat_data_page() for _ in range(4)])
    for i in range(4):
        via_file.set_from_flat_data_page((7 + i) * PAGE, pages[i])
        assert torch.equal(dst.page((7 + i) * PAGE), via_file.page((7 + i) * PAGE))
    for i in range(6):
        assert torch.equal(dst.page((7 + i) * PAGE), want[i])
    # and v1 -> generic
    got = kv.batch_get(keys[:2], [dst.get_dummy_flat_data_page() for _ in range(2)])
    assert torch.equal(got[1], want[1].flatten())


def test_batch_exists_is_the_leading_run(backends):
    src = CpuMLAHostPool()
    filled(src, 5, seed=2)
    keys = page_keys(5, seed=2)
    for backend in backends(src):
        assert backend.batch_set(keys, [src.get_data_page(i * PAGE) for i in range(5)])
        remove_page(backend, keys[2])
        assert backend.batch_exists(keys) == 2
        assert backend.batch_exists(keys[3:]) == 2
        assert not backend.exists(keys[2])
        dst = CpuMLAHostPool()
        got = backend.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
        assert [g is not None for g in got] == [True, True, False, True, True]


def test_mla_rank1_reads_rank0_pages(backends):
    """MLA KV is replicated across TP ranks: rank 0 writes each page once, rank 1 reads it."""
    src = CpuMLAHostPool()
    want = filled(src, 3, seed=3)
    keys = page_keys(3, seed=3)
    rank0 = backends(src, tp_rank=0, tp_size=2)
    reader = CpuMLAHostPool()
    rank1 = backends(reader, tp_rank=1, tp_size=2)
    for w, r in zip(rank0, rank1, strict=True):
        assert w.batch_set(keys, [src.get_data_page(i * PAGE) for i in range(3)])
        assert r.batch_exists(keys) == 3
    assert rank1[0].batch_get_v1(keys, indices([5, 6, 7])) == [True] * 3
    for i in range(3):
        assert torch.equal(reader.page((5 + i) * PAGE), want[i])
    pages = rank1[1].batch_get(keys, [reader.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(p, w.flatten()) for p, w in zip(pages, want, strict=True))
    # kvpool's rank 1 never writes replicated pages (SGLang's controller skips them too)
    other = page_keys(2, seed=33)
    assert rank1[0].batch_set_v1(other, indices([0, 1])) == [True, True]
    assert rank0[0].batch_exists(other) == 0
    assert rank1[0].counters()["skipped_not_writer"] == 2


def test_mha_pages_are_per_rank(backends):
    """Without MLA every TP rank holds its own heads: rank 1 sees none of rank 0's pages (both backends)."""
    src = CpuMLAHostPool()
    filled(src, 2, seed=4)
    keys = page_keys(2, seed=4)
    rank0 = backends(src, tp_rank=0, tp_size=2, is_mla_model=False)
    rank1 = backends(CpuMLAHostPool(), tp_rank=1, tp_size=2, is_mla_model=False)
    for w, r in zip(rank0, rank1, strict=True):
        assert w.batch_set(keys, [src.get_data_page(i * PAGE) for i in range(2)])
        assert (w.batch_exists(keys), r.batch_exists(keys)) == (2, 0)


def kda_transfer(keys, slots=None):
    return PoolTransfer(
        name=PoolName.MAMBA,
        keys=keys,
        host_indices=None if slots is None else torch.tensor(slots, dtype=torch.int64),
        hit_policy=PoolHitPolicy.TRAILING_PAGES,
    )


def test_trailing_pages_hit_when_kda_state_is_only_at_the_last_page(backends):
    """Kimi's KDA state (SGLang's Mamba pool) stored only at page 3: a 4-page prefix is restorable, no
    shorter one is; the state comes back bit for bit. Identical answers from both backends."""
    src = CpuMLAHostPool()
    filled(src, 4, seed=5)
    state = CpuMambaHostPool()
    state.fill(2, seed=55)
    keys = page_keys(4, seed=5)
    results = []
    for backend in backends(src, side_pools={PoolName.MAMBA: state}, tp_rank=0, tp_size=2):
        assert backend.batch_set_v2([kda_transfer(keys[3:], [2])]) == {PoolName.MAMBA: [True]}
        assert backend.batch_set(keys, [src.get_data_page(i * PAGE) for i in range(4)])
        full = backend.batch_exists_v2(keys, [kda_transfer(keys[3:])])
        short = backend.batch_exists_v2(keys[:3], [kda_transfer(keys[2:3])])
        results.append((full, short))
        assert full == PoolTransferResult(4, {PoolName.KV: 4, PoolName.MAMBA: 4}, [4])
        assert short.kv_hit_pages == 0 and short.restorable_prefix_pages == []
        fresh = CpuMambaHostPool()
        backend.register_mem_host_pool_v2(fresh, PoolName.MAMBA)
        assert backend.batch_get_v2([kda_transfer(keys[3:], [5])]) == {PoolName.MAMBA: [True]}
        assert torch.equal(fresh.page(5), state.page(2))
        assert backend.batch_get_v2([kda_transfer(keys[2:3], [6])]) == {PoolName.MAMBA: [False]}
    assert results[0] == results[1]


def test_kda_state_is_per_rank_beside_replicated_mla(backends):
    """The KDA state is TP-sharded even where MLA KV is replicated: rank 1 reads rank 0's KV pages but
    not its state, so it has no restorable prefix until it stored its own (both backends)."""
    src = CpuMLAHostPool()
    filled(src, 2, seed=6)
    state = CpuMambaHostPool()
    state.fill(0, seed=66)
    keys = page_keys(2, seed=6)
    rank0 = backends(src, side_pools={PoolName.MAMBA: state}, tp_rank=0, tp_size=2)
    rank1 = backends(CpuMLAHostPool(), side_pools={PoolName.MAMBA: state}, tp_rank=1, tp_size=2)
    answers = []
    for w, r in zip(rank0, rank1, strict=True):
        assert w.batch_set(keys, [src.get_data_page(i * PAGE) for i in range(2)])
        assert w.batch_set_v2([kda_transfer(keys[1:], [0])]) == {PoolName.MAMBA: [True]}
        before = r.batch_exists_v2(keys, [kda_transfer(keys[1:])])
        assert r.batch_set_v2([kda_transfer(keys[1:], [0])]) == {PoolName.MAMBA: [True]}
        after = r.batch_exists_v2(keys, [kda_transfer(keys[1:])])
        answers.append((before, after))
        assert (before.kv_hit_pages, after.kv_hit_pages) == (0, 2)
    assert answers[0] == answers[1]


def test_all_pages_side_pool(backends):
    """A side pool under ``all_pages`` (a DSA indexer) cuts the hit at its first missing page."""
    src, indexer = CpuMLAHostPool(), CpuMLAHostPool(dim=132, layers=2)
    filled(src, 4, seed=7)
    filled(indexer, 4, seed=8)
    keys = page_keys(4, seed=7)

    def idx(ks, pages=None):
        host = None if pages is None else indices(pages)
        return PoolTransfer(
            name=PoolName.INDEXER, keys=ks, host_indices=host, hit_policy=PoolHitPolicy.ALL_PAGES
        )

    answers = []
    for backend in backends(src, side_pools={PoolName.INDEXER: indexer}):
        assert backend.batch_set(keys, [src.get_data_page(i * PAGE) for i in range(4)])
        ok = backend.batch_set_v2([idx(keys[:2], [0, 1]), idx(keys[3:], [3])])
        assert ok == {PoolName.INDEXER: [True]} or ok[PoolName.INDEXER] == [True]
        answers.append(backend.batch_exists_v2(keys, [idx(keys)]))
    assert answers[0] == answers[1] == PoolTransferResult(2, {PoolName.KV: 4, PoolName.INDEXER: 2}, [1, 2])


def test_another_salt_reads_nothing(backends):
    src = CpuMLAHostPool()
    filled(src, 3, seed=9)
    keys = page_keys(3, seed=9)
    mine = backends(src, salt="tenant-a")[0]
    theirs = backends(src, salt="tenant-b")[0]
    assert mine.batch_set_v1(keys, indices(range(3))) == [True] * 3
    assert mine.batch_exists(keys) == 3
    assert theirs.batch_exists(keys) == 0
    assert theirs.batch_get_v1(keys, indices([4, 5, 6])) == [False] * 3
    assert theirs.get(keys[0], src.get_dummy_flat_data_page()) is None


def test_killed_storage_node_gives_misses(store_dir, file_dir):
    """A storage node killed under live backends: no call raises, and no page is ever wrong. Over tcp (a
    node on another host) reads and writes miss at once; over shm a reader may still copy a page out of the
    dead node's pool, verified against its stamp and checksum, until the master drops the node (its
    heartbeat timeout) and every page is a miss. Then the master dies too: still misses, not exceptions."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from tests.harness.store_procs import start_master, start_node
    from tests.sglang_hicache.conftest import storage_config

    # a master that drops a silent node within ~1.5 s instead of 5 (the default)
    master = start_master(
        store_dir / "killed", "--heartbeat-ms", "300", "--node-timeout-ms", "1500", "--sweep-ms", "300"
    )
    node = start_node(store_dir / "killed", master.address, "64MiB", "tcp,shm", prefault=False)
    made = []
    try:
        src = CpuMLAHostPool()
        want = filled(src, 3, seed=10)
        keys = page_keys(3, seed=10)
        for transport in ("tcp", "shm"):
            cfg = storage_config(
                master.address, file_dir, "killed", deadline_s=2, extra={"transport": transport}
            )
            made.append(StorageBackendFactory.create_backend("dynamic", cfg, src))
            made[-1].register_mem_pool_host(src)
        tcp, shm = made
        assert shm.batch_set_v1(keys, indices(range(3))) == [True] * 3
        assert tcp.batch_exists(keys) == 3
        node.kill()
        t0 = time.monotonic()
        assert tcp.batch_get_v1(keys, indices([4, 5, 6])) == [False] * 3
        assert tcp.get(keys[0], src.get_dummy_flat_data_page()) is None
        assert tcp.batch_set_v1(page_keys(2, seed=11), indices([0, 1])) == [False, False]
        assert shm.batch_set(page_keys(1, seed=12), [src.get_data_page(0)]) is False
        assert time.monotonic() - t0 < 4 * 2 + 5
        got = shm.batch_get_v1(keys, indices([7, 8, 9]))  # the dead node's pool is still mapped here
        assert all(not ok or torch.equal(src.page((7 + i) * PAGE), want[i]) for i, ok in enumerate(got))
        deadline = time.monotonic() + 15
        while shm.batch_exists(keys) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert shm.batch_exists(keys) == 0 and tcp.batch_exists(keys) == 0
        assert shm.batch_get_v1(keys, indices([4, 5, 6])) == [False] * 3
        for backend in made:
            c = backend.counters()
            assert c.get("read_errors", 0) + c.get("store_errors", 0) + c.get("read_misses", 0) >= 1
            assert c.get("write_errors", 0) + c.get("store_errors", 0) >= 1
        master.kill()
        t0 = time.monotonic()
        assert shm.batch_exists(keys) == 0 and shm.batch_get_v1(keys, indices([4, 5, 6])) == [False] * 3
        assert shm.batch_set_v1(keys, indices(range(3))) == [False] * 3
        assert time.monotonic() - t0 < 3 * 2 + 5
    finally:
        for backend in made:
            backend.close()
        for p in (node, master):
            if p.alive():
                p.stop()
