"""Puts that declare their checksum at commit (issue #18): the writer hashes the bytes on the way (the shm
transport while it copies them into the node's pool, one pass), so the master takes the checksum in
PutCommit and the node takes it in SEAL. Nothing is visible before the commit, and a commit without the
checksum it owes is refused with the put left pending."""

from __future__ import annotations

import os

import pytest
import xxhash
from kvpool.kvstore.errors import BadRequestError
from kvpool.kvstore.master.core import MasterConfig, MasterCore
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.node.pool import SharedPool
from kvpool.kvstore.protocol.master_wire import put_start_batch_request
from kvpool.kvstore.transport.base import Payload
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
    with pytest.raises(BadRequestError):  # a checksum at start and at commit: one or the other
        core.put_start(
            master_pb2.PutStartRequest(
                meta=common_pb2.ObjectMeta(key=b"Bk", size=10, checksum=5, kind=common_pb2.BLOB),
                checksum_at_commit=True,
            )
        )
    start = core.put_start(master_pb2.PutStartRequest(meta=meta, checksum_at_commit=True))
    assert start.status == master_pb2.PutStartReply.STARTED
    assert list(core.lookup(master_pb2.LookupRequest(keys=[b"Bk"])).missing) == [b"Bk"]
    with pytest.raises(BadRequestError):  # the checksum it owes: refused, and the put stays pending
        core.put_commit(master_pb2.PutCommitRequest(put_id=start.put_id))
    core.put_commit(master_pb2.PutCommitRequest(put_id=start.put_id, checksum=0xABC))
    found = core.lookup(master_pb2.LookupRequest(keys=[b"Bk"])).found
    assert [f.meta.checksum for f in found] == [0xABC]


def test_a_batch_commit_carries_one_checksum_per_put() -> None:
    core = _core()
    metas = [common_pb2.ObjectMeta(key=b"B%d" % i, kind=common_pb2.BLOB, size=10) for i in range(3)]
    ids = core.put_start_batch(put_start_batch_request(metas, checksum_at_commit=True)).put_ids
    with pytest.raises(BadRequestError):
        core.put_commit_batch(master_pb2.PutCommitBatchRequest(put_ids=ids, checksums=[1, 2]))
    reply = core.put_commit_batch(master_pb2.PutCommitBatchRequest(put_ids=ids, checksums=[11, 12, 13]))
    assert not reply.errors
    found = core.lookup(master_pb2.LookupRequest(keys=[m.key for m in metas])).found
    assert sorted(f.meta.checksum for f in found) == [11, 12, 13]


def test_copy_hashing_into_copies_and_hashes_what_landed_in_one_pass() -> None:
    src = memoryview(os.urandom(3 << 20 | 123))
    dst = memoryview(bytearray(len(src)))
    assert Payload([src]).copy_hashing_into(dst) == xxhash.xxh3_64_intdigest(src) and dst == src


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


def test_a_tcp_put_may_declare_its_checksum_in_a_trailer_and_the_node_still_checks_it(tmp_path) -> None:
    """The streaming writer hashes each chunk as it sends it and declares the digest after the payload; the
    node hashes what landed, so a wrong trailer is refused (nothing stored) and a right one is stored."""
    import socket

    from kvpool.kvstore.errors import ChecksumMismatchError
    from kvpool.kvstore.protocol.data_frame import HEADER_SIZE, OP_PUT, Frame, decode_header, encode
    from kvpool.kvstore.transport.base import FLAG_TRAILER
    from kvpool.proto import node_pb2
    from store_helpers import start_node

    node = start_node(tmp_path, None, "16MiB", "tcp")
    payload = os.urandom(3 << 20)
    right = xxhash.xxh3_64_intdigest(payload)

    def put(key: bytes, trailer: int, flags: int = FLAG_TRAILER) -> Frame:
        meta = common_pb2.ObjectMeta(key=key, kind=common_pb2.BLOB, size=len(payload))
        head = Frame(OP_PUT, key=key, flags=flags, request_id=1, payload_len=len(payload),
                     aux=node_pb2.PutHeader(put_id="p", meta=meta).SerializeToString())  # fmt: skip
        with socket.create_connection((node.ready["host"], node.ready["tcp_port"]), timeout=10) as s:
            s.sendall(
                encode(head)
                + payload
                + (encode(Frame(OP_PUT, request_id=1, checksum=trailer)) if flags else b"")
            )
            reply = b""
            while len(reply) < HEADER_SIZE:
                reply += s.recv(HEADER_SIZE - len(reply))
            return decode_header(reply)[0]

    try:
        assert put(b"Bwrong", right ^ 1).status == ChecksumMismatchError.code
        assert put(b"Bnone", 0, flags=0).status == BadRequestError.code  # no checksum anywhere
        assert put(b"Bright", right).status == 0
        from kvpool.kvstore.transport.tcp import TcpTransport

        async def read_back() -> bytes:
            t = TcpTransport()
            try:
                out = bytearray(len(payload))
                meta = common_pb2.ObjectMeta(
                    key=b"Bright", kind=common_pb2.BLOB, size=len(payload), checksum=right
                )
                await t.get_into(common_pb2.ObjectLocation(meta=meta, node=node.endpoint), out)
                return bytes(out)
            finally:
                await t.close()

        import asyncio

        assert asyncio.run(read_back()) == payload
    finally:
        node.kill()
