"""Streamed tcp GETs: the node hashes as it sends and reports its verdict in a trailer frame.

The node no longer verifies a whole object before its first byte leaves; damage it finds while streaming must
still reach the reader as ``CorruptObjectError`` (never bytes taken as good), be counted on the node, and
leave the connection aligned for the next request. The reader's own end-to-end check stays independent.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import grpc
import pytest
import xxhash
from kvpool.kvstore.errors import CorruptObjectError
from kvpool.kvstore.protocol.data_frame import HEADER_SIZE, OP_GET, RESPONSE, Frame, decode_header, encode
from kvpool.kvstore.transport.base import FLAG_TRAILER, Deadlines
from kvpool.kvstore.transport.tcp import TcpTransport
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from store_helpers import damage_pool_byte, location, start_node

FAST = Deadlines(connect_s=2.0, base_s=1.5, floor_rate=100e6)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = start_node(tmp_path_factory.mktemp("node"), None, "64MiB", "tcp,shm")
    yield proc
    assert proc.stop() == 0, proc.stderr()


def meta_for(data: bytes) -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(
        key=b"B" + uuid.uuid4().bytes,
        kind=common_pb2.BLOB,
        size=len(data),
        checksum=xxhash.xxh3_64_intdigest(data),
    )


def put(node, data: bytes) -> common_pb2.ObjectMeta:
    meta = meta_for(data)

    async def body() -> None:
        t = TcpTransport(FAST)
        try:
            await t.put(node.endpoint, "p", meta, data)
        finally:
            await t.close()

    asyncio.run(body())
    return meta


def flip_byte(node, key: bytes, at: int) -> None:
    """Damage the node's copy in place through its shm segment (what a stray writer or bad DIMM does)."""
    asyncio.run(damage_pool_byte(node.endpoint, key, at))


def reads_corrupt(node) -> int:
    with grpc.insecure_channel(node.grpc_target) as ch:
        info = node_pb2_grpc.StorageNodeStub(ch).Info(node_pb2.NodeInfoRequest(), timeout=5)
    return info.counters.get("reads_corrupt", 0)


def idle_sockets(t: TcpTransport) -> list[socket.socket]:
    """The transport's pooled connections waiting for their next request (a connection an error left out of
    frame sync is closed instead of pooled)."""
    return [sock for idle in t._idle.values() for sock in idle]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, f"connection closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


def raw_get(sock: socket.socket, key: bytes, capacity: int, rid: int) -> tuple[Frame, bytes, Frame]:
    """GET on a raw socket: the response header, the payload and the trailer (with its aux)."""
    sock.sendall(encode(Frame(OP_GET, key=key, request_id=rid, payload_len=capacity)))
    head, key_len, aux_len = decode_header(recv_exact(sock, HEADER_SIZE))
    assert key_len + aux_len == 0
    payload = recv_exact(sock, head.payload_len)
    trailer, key_len, aux_len = decode_header(recv_exact(sock, HEADER_SIZE))
    trailer.aux = recv_exact(sock, key_len + aux_len)[key_len:] if key_len + aux_len else b""
    return head, payload, trailer


@pytest.mark.parametrize("size", [1000, 3 << 20])  # one send, and several chunks hashed as they leave
def test_trailer_reports_the_nodes_verdict_and_keeps_the_stream_aligned(node, size):
    good = os.urandom(size)
    bad = os.urandom(size)
    m_good, m_bad = put(node, good), put(node, bad)
    flip_byte(node, m_bad.key, size - 1)  # in the last chunk: found only after most bytes are on the wire
    before = reads_corrupt(node)
    with socket.create_connection(("127.0.0.1", node.endpoint.tcp_port), timeout=10) as sock:
        head, payload, trailer = raw_get(sock, m_good.key, size, 7)
        assert head.flags & FLAG_TRAILER and head.op == OP_GET | RESPONSE and head.payload_len == size
        assert payload == good
        assert (trailer.op, trailer.status, trailer.request_id) == (OP_GET | RESPONSE, 0, 7)
        assert trailer.checksum == m_good.checksum

        head, payload, trailer = raw_get(sock, m_bad.key, size, 8)
        assert head.flags & FLAG_TRAILER and len(payload) == size
        assert trailer.status == CorruptObjectError.code and trailer.request_id == 8
        assert b"failed its checksum on the node" in trailer.aux
        assert trailer.checksum != m_bad.checksum  # the node's digest of what it sent

        head, payload, trailer = raw_get(sock, m_good.key, size, 9)  # same connection, still in sync
        assert payload == good and trailer.status == 0
    assert reads_corrupt(node) == before + 1


def test_transport_raises_the_nodes_corrupt_verdict_and_reuses_the_connection(node):
    data = os.urandom(2 << 20)
    meta = put(node, data)
    other = os.urandom(5000)
    m_other = put(node, other)
    flip_byte(node, meta.key, 12345)

    async def body() -> None:
        t = TcpTransport(FAST)
        try:
            with pytest.raises(CorruptObjectError, match="on the node"):
                await t.get_into(location(node, meta), bytearray(len(data)))
            assert len(idle_sockets(t)) == 1  # an error trailer keeps the connection
            out = bytearray(5000)
            assert await t.get_into(location(node, m_other), out) == 5000
            assert out == other
            got = await t.batch_get_into(
                [(location(node, meta), bytearray(len(data))), (location(node, m_other), bytearray(5000))]
            )
            assert isinstance(got[0], CorruptObjectError) and got[1] == 5000
        finally:
            await t.close()

    asyncio.run(body())


def test_reader_checks_end_to_end_even_when_the_node_is_satisfied(node):
    """The node's trailer says OK (its copy is intact) but the reader expects other bytes: the reader's own
    digest of what landed decides, so a wrong or stale location is a CorruptObjectError, never data."""
    data = os.urandom(1 << 20)
    meta = put(node, data)
    stale = common_pb2.ObjectMeta()
    stale.CopyFrom(meta)
    stale.checksum ^= 1

    async def body() -> None:
        t = TcpTransport(FAST)
        try:
            with pytest.raises(CorruptObjectError, match="after transfer"):
                await t.get_into(
                    common_pb2.ObjectLocation(meta=stale, node=node.endpoint), bytearray(1 << 20)
                )
            got = await t.batch_get_into(
                [(common_pb2.ObjectLocation(meta=stale, node=node.endpoint), bytearray(1 << 20))]
            )
            assert isinstance(got[0], CorruptObjectError)
            out = bytearray(1 << 20)
            assert await t.get_into(location(node, meta), out) == 1 << 20 and out == data
        finally:
            await t.close()

    asyncio.run(body())


def test_large_get_restores_the_receive_watermark_of_the_pooled_connection(node):
    """A large GET raises SO_RCVLOWAT while its payload streams in; the pooled connection must wake for a
    48-byte header again afterwards, or the next small GET on it would wait for its whole deadline."""
    big = os.urandom(3 << 20)
    small = os.urandom(5000)
    m_big, m_small = put(node, big), put(node, small)

    async def body() -> None:
        t = TcpTransport(FAST)
        try:
            out = bytearray(len(big))
            assert await t.get_into(location(node, m_big), out) == len(big) and out == big
            (sock,) = idle_sockets(t)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
            start = asyncio.get_running_loop().time()
            out = bytearray(5000)
            assert await t.get_into(location(node, m_small), out) == 5000 and out == small
            assert asyncio.get_running_loop().time() - start < 0.5
        finally:
            await t.close()

    asyncio.run(body())
