"""Puts that declare their checksum at commit (issue #18): the writer hashes the bytes on the way (the shm
transport while it copies them into the node's pool, one pass), so the master takes the checksum in
PutCommit and the node takes it in SEAL. Nothing is visible before the commit, and a commit without the
checksum it owes is refused with the put left pending."""

from __future__ import annotations

import os

import pytest
import xxhash
from kvpool.kvstore.errors import BadRequestError, InvalidRequest
from kvpool.kvstore.master.config import MasterConfig
from kvpool.kvstore.master.core import MasterCore
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.node.pool import SharedPool
from kvpool.kvstore.transport.base import copy_hashing
from kvpool.proto import common_pb2, master_pb2


def _core() -> MasterCore:
    core = MasterCore(MasterConfig())
    core.register_node(
        master_pb2.RegisterNodeRequest(
            node=common_pb2.NodeEndpoint(node_id="n", host="127.0.0.1", grpc_port=9),
            dram_capacity_bytes=1 << 20,
        )
    )
    return core


def test_the_master_takes_the_checksum_at_commit_and_shows_nothing_before() -> None:
    core = _core()
    meta = common_pb2.ObjectMeta(key=b"Bk", kind=common_pb2.BLOB, size=10)
    with pytest.raises(InvalidRequest):  # a checksum at start and at commit: one or the other
        core.put_start(
            master_pb2.PutStartRequest(
                meta=common_pb2.ObjectMeta(key=b"Bk", size=10, checksum=5, kind=common_pb2.BLOB),
                checksum_at_commit=True,
            )
        )
    start = core.put_start(master_pb2.PutStartRequest(meta=meta, checksum_at_commit=True))
    assert start.status == master_pb2.PutStartReply.STARTED
    assert list(core.lookup(master_pb2.LookupRequest(keys=[b"Bk"])).missing) == [b"Bk"]
    with pytest.raises(InvalidRequest):  # the checksum it owes: refused, and the put stays pending
        core.put_commit(master_pb2.PutCommitRequest(put_id=start.put_id))
    core.put_commit(master_pb2.PutCommitRequest(put_id=start.put_id, checksum=0xABC))
    found = core.lookup(master_pb2.LookupRequest(keys=[b"Bk"])).found
    assert [f.meta.checksum for f in found] == [0xABC]


def test_a_batch_commit_carries_one_checksum_per_put() -> None:
    core = _core()
    metas = [common_pb2.ObjectMeta(key=b"B%d" % i, kind=common_pb2.BLOB, size=10) for i in range(3)]
    starts = core.put_start_batch(
        master_pb2.PutStartBatchRequest(
            items=[master_pb2.PutStartRequest(meta=m, checksum_at_commit=True) for m in metas]
        )
    ).items
    ids = [s.put_id for s in starts]
    with pytest.raises(InvalidRequest):
        core.put_commit_batch(master_pb2.PutCommitBatchRequest(put_ids=ids, checksums=[1, 2]))
    reply = core.put_commit_batch(master_pb2.PutCommitBatchRequest(put_ids=ids, checksums=[11, 12, 13]))
    assert all(not e.code for e in reply.errors)
    found = core.lookup(master_pb2.LookupRequest(keys=[m.key for m in metas])).found
    assert sorted(f.meta.checksum for f in found) == [11, 12, 13]


def test_copy_hashing_copies_and_hashes_what_landed_in_one_pass() -> None:
    src = memoryview(os.urandom(3 << 20 | 123))
    dst = memoryview(bytearray(len(src)))
    assert copy_hashing(dst, src) == xxhash.xxh3_64_intdigest(src) and dst == src


def test_a_node_reservation_without_checksum_takes_the_one_seal_declares() -> None:
    pool = SharedPool(1 << 20)
    try:
        store = ObjectStore(pool)
        meta = common_pb2.ObjectMeta(key=b"Bx", kind=common_pb2.BLOB, size=64)
        store.reserve("p1", meta, ttl_s=30)
        with pytest.raises(BadRequestError):  # SEAL without the checksum the reservation left open
            store.seal("p1", abort=False)
        assert "p1" in store.pending  # nothing published, still sealable
        store.seal("p1", abort=False, checksum=77)
        assert store.objects[b"Bx"].meta.checksum == 77 and store.counters["puts_checksum_at_seal"] == 1
        again = common_pb2.ObjectMeta(key=b"By", kind=common_pb2.BLOB, size=64, checksum=1)
        store.reserve("p2", again, ttl_s=30)  # a declared checksum is verified against the bytes as before
        with pytest.raises(Exception, match="hashes to"):
            store.seal("p2", abort=False)
    finally:
        pool.close()
