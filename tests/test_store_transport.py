"""Data-plane transports (tcp, shm, ucx) against a real standalone storage node process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import time
import uuid

import numpy as np
import pytest
import xxhash
from kvpool.kvstore.errors import (
    BadRequestError,
    ChecksumMismatchError,
    CorruptObjectError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreUnavailableError,
    TransportTimeoutError,
    TransportUnavailableError,
    UnauthenticatedError,
)
from kvpool.kvstore.protocol.data_frame import HEADER_SIZE, decode_header
from kvpool.kvstore.transport.base import Deadlines
from kvpool.kvstore.transport.selector import TransportSelector, has_rdma_device
from kvpool.proto import common_pb2, node_pb2
from store_helpers import NodeProc, damage_pool_byte, location, start_node

TRANSPORTS = ["tcp", "shm", "ucx"]
FAST = Deadlines(connect_s=2.0, base_s=1.5, floor_rate=100e6)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    proc = start_node(tmp_path_factory.mktemp("node"), None, "96MiB", "tcp,shm,ucx", "--frame-timeout", "1")
    yield proc
    assert proc.stop() == 0, proc.stderr()


def meta_for(data: bytes, key: bytes | None = None) -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(
        key=key or b"B" + uuid.uuid4().bytes,
        kind=common_pb2.BLOB,
        size=len(data),
        checksum=xxhash.xxh3_64_intdigest(data),
    )


_LOOP = asyncio.new_event_loop()  # one loop for the module: ucxx binds its progress task to a loop


def run(coro):
    return _LOOP.run_until_complete(coro)


async def _with(choice: str, body):
    sel = TransportSelector(choice, FAST)
    try:
        return await body(sel)
    finally:
        await sel.close()


@pytest.mark.parametrize("choice", TRANSPORTS)
def test_roundtrip_sizes_and_buffers(node, choice):
    """1 KB … 16 MB random objects come back bit-exact into bytearray, numpy and torch buffers."""
    import torch

    rng = np.random.default_rng(1)
    sizes = [1024, 64 * 1024 + 3, 1 << 20, 16 << 20]

    async def body(sel):
        t = sel.for_node(node.endpoint)
        assert t.name == choice
        for size in sizes:
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            meta = meta_for(data)
            await t.put(node.endpoint, "p-" + meta.key.hex(), meta, data)
            out = bytearray(size)
            assert await t.get_into(location(node, meta), out) == size
            assert out == data
            arr = np.zeros(size + 100, np.uint8)
            assert await t.get_into(location(node, meta), arr) == size
            assert arr[:size].tobytes() == data
            if size % 4 == 0:
                ten = torch.zeros(size // 4, dtype=torch.float32)
                assert await t.get_into(location(node, meta), ten) == size
                assert ten.numpy().tobytes() == data

    run(_with(choice, body))


@pytest.mark.parametrize("choice", TRANSPORTS)
def test_batch_and_duplicates(node, choice):
    """Batches return per-item results; concurrent duplicate puts of one key all succeed as no-ops."""
    rng = np.random.default_rng(2)

    async def body(sel):
        t = sel.for_node(node.endpoint)
        blobs = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 300_000, 12)]
        metas = [meta_for(b) for b in blobs]
        bad_blob = os.urandom(5000)
        bad = meta_for(bad_blob)
        bad.checksum ^= 1
        items = [(f"p{i}", m, b) for i, (m, b) in enumerate(zip(metas, blobs, strict=True))]
        res = await t.batch_put(node.endpoint, [*items[:6], ("bad", bad, bad_blob), *items[6:]])
        assert res[:6] == [None] * 6 and res[7:] == [None] * (len(blobs) - 6)  # one bad item fails alone
        assert isinstance(res[6], ChecksumMismatchError)
        missing = meta_for(b"x" * 10)
        outs = [bytearray(m.size) for m in metas] + [bytearray(10)]
        got = await t.batch_get_into(
            [(location(node, m), o) for m, o in zip([*metas, missing], outs, strict=True)]
        )
        assert got[:-1] == [m.size for m in metas]
        assert isinstance(got[-1], ObjectNotFoundError)
        assert all(bytes(o) == b for o, b in zip(outs[:-1], blobs, strict=True))
        dup = rng.integers(0, 256, 500_000, dtype=np.uint8).tobytes()
        dmeta = meta_for(dup)
        await asyncio.gather(*(t.put(node.endpoint, f"d{i}", dmeta, dup) for i in range(6)))
        out = bytearray(len(dup))
        assert await t.get_into(location(node, dmeta), out) == len(dup) and out == dup

    run(_with(choice, body))


@pytest.mark.parametrize("choice", TRANSPORTS)
def test_bad_input_typed_errors_node_keeps_serving(node, choice):
    async def body(sel):
        t = sel.for_node(node.endpoint)
        with pytest.raises(ObjectNotFoundError):
            await t.get_into(location(node, meta_for(b"nope")), bytearray(4))
        data = os.urandom(70_000)
        bad = meta_for(data)
        bad.checksum ^= 1
        with pytest.raises(ChecksumMismatchError):
            await t.put(node.endpoint, "bad", bad, data)
        with pytest.raises(ObjectNotFoundError):  # the rejected put left nothing behind
            await t.get_into(location(node, bad), bytearray(len(data)))
        big = meta_for(b"")
        big.size = 200 << 20  # over the node's 96 MiB pool: refused before any byte moves (shm, ucx)
        if choice != "tcp":
            with pytest.raises(ObjectTooLargeError):
                await t.put(node.endpoint, "big", big, memoryview(bytearray(big.size)))
        good = meta_for(data)
        await t.put(node.endpoint, "good", good, data)
        out = bytearray(len(data))
        assert await t.get_into(location(node, good), out) == len(data) and out == data
        if choice != "shm":  # a node refuses to send into a buffer too small for the object
            understated = common_pb2.ObjectMeta()
            understated.CopyFrom(good)
            understated.size = 10  # passes the reader's own size check: the node must refuse
            short = common_pb2.ObjectLocation(meta=understated, node=node.endpoint)
            with pytest.raises(BadRequestError):
                await t.get_into(short, bytearray(10))

    run(_with(choice, body))


def test_tcp_oversized_put_is_refused(node):
    async def body(sel):
        t = sel.for_node(node.endpoint)
        size = 100 << 20
        big = common_pb2.ObjectMeta(key=b"Bbig", size=size, checksum=1)
        with pytest.raises(ObjectTooLargeError):
            await t.put(node.endpoint, "big", big, memoryview(bytearray(size)))

    run(_with("tcp", body))


def _raw(node):
    s = socket.create_connection(("127.0.0.1", node.ready["tcp_port"]), timeout=5)
    return s


def _recv_n(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise AssertionError("closed without an error frame")
        buf += chunk
    return buf


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:  # the node closed with our unread garbage still queued
        return True


def _read_error(s: socket.socket) -> int:
    frame, key_len, aux_len = decode_header(_recv_n(s, HEADER_SIZE))
    _recv_n(s, key_len + aux_len)
    return frame.status


def test_garbage_and_truncated_frames_on_tcp(node):
    """Garbage: error frame + close; a frame cut short: error frame after the deadline; others unaffected."""
    s = _raw(node)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 40)
    assert _read_error(s) == 7  # ProtocolError
    assert _closed(s)
    s = _raw(node)
    s.sendall(b"KVP1\x02")  # header cut short, connection left open
    t0 = time.monotonic()
    assert _read_error(s) == 9  # TransportTimeoutError
    assert time.monotonic() - t0 < 3
    s = _raw(node)  # a put whose payload stops half-way, then the peer vanishes
    from kvpool.kvstore.protocol.data_frame import OP_PUT, Frame, encode

    meta = meta_for(b"z" * 1000)
    s.sendall(
        encode(
            Frame(
                OP_PUT,
                key=meta.key,
                payload_len=1000,
                checksum=meta.checksum,
                aux=node_pb2.PutHeader(put_id="t", meta=meta).SerializeToString(),
            )
        )
        + b"z" * 10
    )
    s.close()
    s = _raw(node)
    s.sendall(struct.pack("<4sB", b"KVP1", 99) + b"\0" * (HEADER_SIZE - 5))  # unknown op
    assert _read_error(s) == 7

    async def body(sel):
        t = sel.for_node(node.endpoint)
        with pytest.raises(ObjectNotFoundError):
            await t.get_into(location(node, meta), bytearray(1000))  # the truncated put left nothing
        data = os.urandom(5000)
        m = meta_for(data)
        await t.put(node.endpoint, "after", m, data)
        out = bytearray(5000)
        await t.get_into(location(node, m), out)
        assert out == data

    run(_with("tcp", body))


@pytest.mark.parametrize("choice", TRANSPORTS)
def test_corrupted_pool_bytes_are_detected(node, choice):
    async def body(sel):
        t = sel.for_node(node.endpoint)
        data = os.urandom(100_000)
        meta = meta_for(data)
        await t.put(node.endpoint, "c", meta, data)
        await damage_pool_byte(node.endpoint, meta.key, 500, 0xFF)
        with pytest.raises(CorruptObjectError):
            await t.get_into(location(node, meta), bytearray(len(data)))
        other = os.urandom(1000)  # the node keeps serving
        m2 = meta_for(other)
        await t.put(node.endpoint, "c2", m2, other)
        out = bytearray(1000)
        await t.get_into(location(node, m2), out)
        assert out == other

    run(_with(choice, body))


def test_explicit_choice_never_falls_back(node):
    remote = common_pb2.NodeEndpoint()
    remote.CopyFrom(node.endpoint)
    remote.host_id = "elsewhere/0"
    with pytest.raises(TransportUnavailableError):
        TransportSelector("shm").for_node(remote)
    no_ucx = common_pb2.NodeEndpoint()
    no_ucx.CopyFrom(node.endpoint)
    no_ucx.ucx_port = 0
    with pytest.raises(TransportUnavailableError):
        TransportSelector("ucx").for_node(no_ucx)
    assert TransportSelector("auto").for_node(node.endpoint).name == "shm"
    assert TransportSelector("auto").for_node(no_ucx).name == "shm"


def test_auto_prefers_ucx_only_where_rdma_exists(node, tmp_path):
    """A remote node with both listeners: ucx when the machine has a verbs device, tcp (logged) when not."""
    remote = common_pb2.NodeEndpoint()
    remote.CopyFrom(node.endpoint)
    remote.host_id = "elsewhere/0"
    with_rdma = TransportSelector("auto")
    with_rdma.rdma = True
    assert with_rdma.for_node(remote).name == "ucx"
    without = TransportSelector("auto")
    without.rdma = False
    assert without.for_node(remote).name == "tcp"
    assert not has_rdma_device(tmp_path / "absent")
    (tmp_path / "ib" / "mlx5_0").mkdir(parents=True)
    assert has_rdma_device(tmp_path / "ib")


@pytest.mark.parametrize("choice", ["tcp", "ucx"])
def test_stalled_or_dead_node_gives_typed_error_quickly(tmp_path, choice):
    """A frozen node (SIGSTOP) → TransportTimeoutError within the deadline; a killed one → unavailable."""
    proc = start_node(tmp_path, None, "32MiB", "tcp,ucx")
    try:

        async def body(sel):
            t = sel.for_node(proc.endpoint)
            data = os.urandom(4 << 20)
            meta = meta_for(data)
            await t.put(proc.endpoint, "s", meta, data)
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(TransportTimeoutError):
                await t.get_into(location(proc, meta), bytearray(len(data)))
            assert time.monotonic() - t0 < FAST.for_size(len(data)) + 1.5
            os.kill(proc.pid, signal.SIGKILL)
            os.kill(proc.pid, signal.SIGCONT)
            proc.popen.wait(5)
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                await t.get_into(location(proc, meta), bytearray(len(data)))
            assert time.monotonic() - t0 < 3

        run(_with(choice, body))
    finally:
        proc.kill()


def test_garbage_on_ucx_gets_an_error_reply(node):
    """A ucx control message that is not a frame: the node answers ProtocolError and keeps serving."""
    from kvpool.kvstore.protocol.data_frame import CONTROL_SIZE, decode_control
    from kvpool.kvstore.transport.ucx import load_ucxx

    async def body(sel):
        ucxx = load_ucxx()
        ep = await asyncio.wait_for(ucxx.create_endpoint("127.0.0.1", node.ready["ucx_port"]), 5)
        try:
            await asyncio.wait_for(ep.send(np.frombuffer(os.urandom(CONTROL_SIZE), np.uint8)), 5)
            reply = np.empty(CONTROL_SIZE, np.uint8)
            await asyncio.wait_for(ep.recv(reply), 5)
            assert decode_control(reply).status == 7  # ProtocolError
        finally:
            ep.abort()
        t = sel.for_node(node.endpoint)
        data = os.urandom(20_000)
        meta = meta_for(data)
        await t.put(node.endpoint, "u", meta, data)
        out = bytearray(len(data))
        await t.get_into(location(node, meta), out)
        assert out == data

    run(_with("ucx", body))


def test_shm_control_frames_bad_input(node, tmp_path):
    """LOCATE with a payload is garbage (closed); shm control on a node without shm is refused, typed."""
    from kvpool.kvstore.protocol.data_frame import OP_LOCATE, OP_SEAL, Frame, encode

    s = _raw(node)
    s.sendall(encode(Frame(OP_LOCATE, key=b"Bx", payload_len=10)))
    assert _read_error(s) == 7 and _closed(s)
    s = _raw(node)
    s.sendall(encode(Frame(OP_SEAL, aux=b"no-such-put")))
    assert _read_error(s) == 1  # ObjectNotFoundError, connection stays usable
    s.sendall(encode(Frame(OP_LOCATE, key=b"Bmissing")))
    assert _read_error(s) == 1
    plain = start_node(tmp_path, None, "8MiB", "tcp")
    try:
        s = _raw(plain)
        s.sendall(encode(Frame(OP_LOCATE, key=b"Bx")))
        assert _read_error(s) == 10  # TransportUnavailableError
    finally:
        plain.stop()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.parametrize("choice", ["tcp", "ucx"])
def test_pooled_connection_to_a_restarted_node_is_replaced(tmp_path, choice):
    """A node restarted on the same ports: the pooled connection is stale, the next op still works."""
    grpc_port, tcp_port, ucx_port = _free_ports(3)
    ports = ("--port", str(grpc_port), "--tcp-port", str(tcp_port), "--ucx-port", str(ucx_port))
    proc = start_node(tmp_path, None, "8MiB", "tcp,ucx", *ports)

    async def body(sel):
        nonlocal proc
        t = sel.for_node(proc.endpoint)
        data = os.urandom(50_000)
        meta = meta_for(data)
        await t.put(proc.endpoint, "a", meta, data)
        assert proc.stop() == 0
        proc = start_node(tmp_path, None, "8MiB", "tcp,ucx", *ports)
        await t.put(proc.endpoint, "b", meta, data)  # on the pooled (stale) connection first
        out = bytearray(len(data))
        await t.get_into(location(proc, meta), out)
        assert out == data

    try:
        run(_with(choice, body))
    finally:
        proc.stop()


@pytest.mark.parametrize("choice", ["tcp", "ucx"])
def test_a_node_with_a_cluster_secret_serves_only_clients_that_hold_it(tmp_path, choice):
    """tcp and ucx start with the 56-byte hello; a client without the secret writes nothing and is told so
    (UnauthenticatedError naming where it reads its secret) within its deadline, a client with it is served
    as usual."""
    from kvpool.runtime import cluster_auth
    from kvpool.runtime.spawn import spawn

    key = os.urandom(32).hex()
    argv = ["node", "--no-master", "--capacity", "16MiB", "--transport", "tcp,ucx", "--no-prefault"]
    env = {cluster_auth.ENV_VALUE: key}
    proc = node_proc = spawn(
        "node", ["kvpool.kvstore.cli", *argv], tmp_path, 60, child_type=NodeProc, env=env
    )
    data = os.urandom(50_000)
    meta = meta_for(data)

    async def stranger(sel):
        with pytest.raises(UnauthenticatedError) as err:
            await sel.for_node(node_proc.endpoint).put(node_proc.endpoint, "x", meta, data)
        assert "no cluster secret" in str(err.value) and cluster_auth.ENV_VALUE in str(err.value)

    async def member(sel):
        t = sel.for_node(node_proc.endpoint)
        await t.put(node_proc.endpoint, "y", meta, data)
        out = bytearray(len(data))
        await t.get_into(location(node_proc, meta), out)
        assert out == data

    try:
        cluster_auth.configure(None)
        t0 = time.monotonic()
        run(_with(choice, stranger))
        assert time.monotonic() - t0 < FAST.for_size(len(data)) + 2
        cluster_auth.configure(key.encode())
        run(_with(choice, member))
    finally:
        cluster_auth.configure(None)
        proc.kill()
    assert "rejected unauthenticated" in proc.log_path.read_text()
