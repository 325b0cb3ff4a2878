"""Client library against a real cluster (master + storage node processes), for every transport."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading

import numpy as np
import pytest
from kvpool.kvstore.client.async_client import AsyncStoreClient, LocatedPrefix, PutItem
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import CapacityExceededError, CorruptObjectError, ObjectNotFoundError, StoreError
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.proto import common_pb2, master_pb2
from store_helpers import damage_pool_byte, start_master, start_node

TRANSPORTS = ["tcp", "shm", "ucx"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster")
    master = start_master(logs, "--heartbeat-ms", "200", "--node-timeout-ms", "1500")
    node = start_node(logs, master.address, "128MiB")
    yield master, node
    assert node.stop() == 0, node.stderr()
    master.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def client(transport, cluster):
    with StoreClient(cluster[0].address, transport) as c:
        yield c


def rkey() -> bytes:
    return b"B" + os.urandom(16)


def test_integrity_1k_to_16m(client, transport):
    rng = np.random.default_rng(7)
    sizes = (1000, 1024, 333_333, 1 << 20, 4 << 20, 16 << 20)
    for size in sizes:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        key = rkey()
        assert client.put(key, data) is True
        assert client.get(key) == data
        out = np.empty(size, np.uint8)
        assert client.get_into(key, out) == size
        assert out.tobytes() == data
    metrics = client.metrics()
    assert metrics[f"bytes_out.{transport}"] >= sum(sizes)
    assert metrics[f"bytes_in.{transport}"] >= 2 * sum(sizes)


def test_missing_is_not_empty(client):
    key = rkey()
    assert client.exists(key) is False
    with pytest.raises(ObjectNotFoundError):
        client.get(key)
    with pytest.raises(ObjectNotFoundError):
        client.get_into(key, bytearray(10))
    assert client.metrics()["failures.get"] >= 2


def test_concurrent_duplicate_puts_are_noop_successes(client):
    data = os.urandom(2 << 20)
    key = rkey()
    results: list = []

    def worker() -> None:
        results.append(client.put(key, data))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) >= 1 and len(results) == 6
    assert client.get(key) == data


def test_concurrent_duplicates_async(cluster):
    """Many coroutines racing on one key through one async client: all succeed, one object stored."""

    async def main() -> None:
        async with AsyncStoreClient(cluster[0].address, "tcp") as c:
            data = os.urandom(1 << 20)
            key = rkey()
            results = await asyncio.gather(*(c.put(key, data) for _ in range(8)))
            assert results.count(True) >= 1
            assert await c.get(key) == data

    asyncio.run(main())


def test_batches_per_key_results(client):
    items = [PutItem(rkey(), os.urandom(n)) for n in (10, 70_000, 1 << 20, 5)]
    assert client.batch_put(items) == [None] * 4
    assert client.batch_put(items) == [None] * 4  # duplicates: success no-ops
    missing = rkey()
    got = client.batch_get([items[0].key, missing, items[2].key])
    assert got[0] == items[0].data and got[2] == items[2].data
    assert isinstance(got[1], ObjectNotFoundError)
    assert client.batch_exists([items[1].key, missing]) == [True, False]


def test_oversized_object_is_refused(client):
    with pytest.raises(CapacityExceededError):
        client.put(rkey(), bytearray(200 << 20))
    key = rkey()
    client.put(key, b"still serving")
    assert client.get(key) == b"still serving"


def test_corrupted_pool_bytes_give_checksum_error(client, cluster):
    node = cluster[1]
    data = os.urandom(50_000)
    key = rkey()
    client.put(key, data)
    asyncio.run(damage_pool_byte(node.endpoint, key, 7, 0x55))
    with pytest.raises(CorruptObjectError):
        client.get(key)
    assert client.put(key, data) is False  # a plain re-put is a duplicate no-op: still corrupt
    with pytest.raises(CorruptObjectError):
        client.get(key)
    assert client.put(key, data, replace_if_corrupt=True) is True  # the recomputing reader repairs it
    assert client.get(key) == data
    key2 = rkey()
    client.put(key2, data)
    assert client.get(key2) == data


def test_match_prefix_fetch_and_release(client):
    hashes = [hashlib.sha256(os.urandom(8)).digest() for _ in range(4)]
    blocks = [os.urandom(30_000 + i) for i in range(4)]
    parent = b""
    for h, blob in zip(hashes, blocks, strict=True):
        client.put(mla_key(h), blob, kind=common_pb2.MLA_BLOCK, parent=parent)
        parent = mla_key(h)
    ckpt = os.urandom(100_000)
    client.put(kda_key(hashes[1]), ckpt, kind=common_pb2.KDA_CHECKPOINT)
    probe = client.match_prefix(hashes)
    assert (probe.usable_blocks, probe.mla_run_blocks, probe.lease_id) == (2, 4, "")
    assert client.match_prefix(hashes, require_checkpoint=False).usable_blocks == 4
    m = client.match_prefix(hashes, acquire=True)
    try:
        locs = [*m.mla, m.checkpoint]
        outs = [bytearray(loc.meta.size) for loc in locs]
        assert client.fetch_into(locs, outs) == [len(b) for b in (*blocks[:2], ckpt)]
        assert [bytes(o) for o in outs] == [*blocks[:2], ckpt]
    finally:
        client.release(m.lease_id)


def test_remove_and_pin(client):
    key = rkey()
    client.put(key, b"abc")
    assert client.pin([key], 10_000).pinned == 1
    assert client.remove(key) == 1
    assert not client.exists(key)
    with pytest.raises(ObjectNotFoundError):
        client.get(key)


def test_a_located_prefix_with_missing_columns_is_a_store_error_not_a_crash() -> None:
    """The master answers locations column-wise; a reply whose columns do not cover the usable objects
    (another version, a broken peer) must surface as a StoreError (a miss), never an IndexError."""

    hs = [bytes([i]) * 32 for i in range(3)]
    ep = common_pb2.NodeEndpoint(node_id="n0", host="127.0.0.1", grpc_port=1)
    good = master_pb2.MatchPrefixReply(
        usable_blocks=2, mla_run_blocks=3, nodes=[ep], node=[0, 0, 0], size=[1, 2, 3], checksum=[7, 8, 9],
        tier=[common_pb2.DRAM] * 3,
    )  # fmt: skip
    located = LocatedPrefix.of(good, hs, require_checkpoint=True)
    assert [loc.meta.key for loc in located.mla] == [b"M" + hs[0], b"M" + hs[1]]
    assert located.checkpoint is not None and located.checkpoint.meta.key == b"K" + hs[1]
    assert [loc.meta.checksum for loc in located.mla] == [7, 8] and located.checkpoint.node.node_id == "n0"
    short = master_pb2.MatchPrefixReply()
    short.CopyFrom(good)
    del short.size[-1]
    with pytest.raises(StoreError, match="located"):
        LocatedPrefix.of(short, hs, require_checkpoint=True)
    bad_node = master_pb2.MatchPrefixReply()
    bad_node.CopyFrom(good)
    bad_node.node[0] = 5
    with pytest.raises(StoreError):
        LocatedPrefix.of(bad_node, hs, require_checkpoint=True)
    none = LocatedPrefix.of(master_pb2.MatchPrefixReply(mla_run_blocks=1), hs, require_checkpoint=True)
    assert none.usable_blocks == 0 and none.mla == [] and none.checkpoint is None
