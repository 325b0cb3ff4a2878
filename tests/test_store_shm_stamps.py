"""shm reads without a round trip: generation stamps in the node's segment, against real node processes.

A same-host reader that has seen an object (LOCATE, or its own put) copies it again with no control frame,
and never returns bytes of an object the node deleted, demoted or reused the extent of.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid

import grpc
import numpy as np
import pytest
import xxhash
from kvpool.kvstore.errors import ObjectNotFoundError, StaleReadError
from kvpool.kvstore.node.pool import SharedPool
from kvpool.kvstore.protocol.data_frame import OP_GET, Frame, encode
from kvpool.kvstore.protocol.shm_segment import StampReader, default_slots
from kvpool.kvstore.transport.base import Deadlines
from kvpool.kvstore.transport.selector import TransportSelector
from kvpool.kvstore.transport.shm import ShmTransport
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from store_helpers import location, start_node

FAST = Deadlines(connect_s=2.0, base_s=1.5, floor_rate=100e6)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = tmp_path_factory.mktemp("stamps")
    proc = start_node(d, None, "96MiB", "tcp,shm", "--ssd-path", str(d / "ssd"), "--ssd-capacity", "64MiB")
    yield proc
    assert proc.stop() == 0, proc.stderr()


@pytest.fixture(scope="module")
def stub(node):
    with grpc.insecure_channel(node.grpc_target) as channel:
        yield node_pb2_grpc.StorageNodeStub(channel)


def meta_for(data: bytes, key: bytes | None = None) -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(
        key=key or b"S" + uuid.uuid4().bytes,
        kind=common_pb2.BLOB,
        size=len(data),
        checksum=xxhash.xxh3_64_intdigest(data),
    )


def counter(stub, name: str) -> int:
    return stub.Info(node_pb2.NodeInfoRequest(), timeout=5).counters.get(name, 0)


def keys(*ks: bytes) -> node_pb2.KeysRequest:
    return node_pb2.KeysRequest(keys=list(ks))


def run_with_shm(body):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        sel = TransportSelector("shm", FAST)
        try:
            return await body(sel)
        finally:
            await sel.close()

    return asyncio.run(main())


def shm_of(sel: TransportSelector, node) -> ShmTransport:  # type: ignore[no-untyped-def]
    t = sel.for_node(node.endpoint)
    assert isinstance(t, ShmTransport)
    return t


def hint_of(t: ShmTransport, node, key: bytes):  # type: ignore[no-untyped-def]
    return t.hints.get((node.endpoint.node_id, key))


def test_stamp_table_hands_out_unique_generations_and_bounded_slots():
    pool = SharedPool(1 << 20, stamp_slots=3)
    try:
        reader = StampReader.open(pool.buf)
        assert reader is not None and reader.slots == 3
        assert pool.allocator.capacity == 1 << 20  # accounting sees only the allocator's range
        got = [pool.stamps.stamp(i * 64, 10, 99) for i in range(3)]
        assert pool.stamps.stamp(999, 1, 1) == (0, 0) and pool.stamps.exhausted == 1  # full: no fast path
        assert [reader.generation(s) for s, _g in got] == [g for _s, g in got]
        assert reader.fields(got[1][0]) == (64, 10, 99)
        pool.stamps.clear(*got[1])
        assert reader.generation(got[1][0]) == 0
        slot, gen = pool.stamps.stamp(128, 10, 98)
        assert slot == got[1][0] and gen > max(g for _s, g in got)  # slot reused, generation never
        assert pool.stamps.stamp(256, 1, 1) == (0, 0) and pool.stamps.exhausted == 2  # the one freed is taken
        assert reader.generation(3) == 0  # unknown slot reads as empty
        reader.close()
    finally:
        pool.close()
    assert default_slots(1 << 30) == (1 << 30) // 4096 + 1024


def test_second_get_sends_no_control_frame(node, stub):
    """After an own put or one LOCATE, gets (single and batched) are served from the stamp: no LOCATE."""
    rng = np.random.default_rng(7)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (4 << 20, 1000, 64 << 10)]
    metas = [meta_for(b) for b in blobs]

    async def body(sel):
        t = shm_of(sel, node)
        for i, (m, b) in enumerate(zip(metas, blobs, strict=True)):
            await t.put(node.endpoint, f"p{i}", m, b)
        before = counter(stub, "locates")
        for m, b in zip(metas, blobs, strict=True):
            out = np.zeros(len(b), np.uint8)
            assert await t.get_into(location(node, m), out) == len(b)
            assert out.tobytes() == b
        outs = [bytearray(len(b)) for b in blobs]
        got = await t.batch_get_into([(location(node, m), o) for m, o in zip(metas, outs, strict=True)])
        assert got == [len(b) for b in blobs] and [bytes(o) for o in outs] == blobs
        assert counter(stub, "locates") == before and t.locates == 0 and t.fast_hits == 6

        # a reader that did not put it: the first get LOCATEs, the second does not
        other = TransportSelector("shm", FAST)
        try:
            t2 = shm_of(other, node)
            out = bytearray(len(blobs[0]))
            await t2.get_into(location(node, metas[0]), out)
            assert counter(stub, "locates") == before + 1 and t2.fast_hits == 0
            out[:] = bytes(len(out))
            await t2.get_into(location(node, metas[0]), out)
            assert counter(stub, "locates") == before + 1 and t2.fast_hits == 1 and bytes(out) == blobs[0]
        finally:
            await other.close()

    run_with_shm(body)


def test_delete_invalidates_at_once(node, stub):
    data = os.urandom(256 << 10)
    meta = meta_for(data)

    async def body(sel):
        t = shm_of(sel, node)
        await t.put(node.endpoint, "d", meta, data)
        out = bytearray(len(data))
        assert t.read_cached(node.endpoint, meta.key, meta.checksum, meta.size, out) == len(data)
        assert stub.Delete(keys(meta.key), timeout=5).done == 1
        stale = t.fast_stale
        assert t.read_cached(node.endpoint, meta.key, meta.checksum, meta.size, out) is None
        assert t.fast_stale == stale + 1 and hint_of(t, node, meta.key) is None  # hint dropped
        with pytest.raises(ObjectNotFoundError):
            await t.get_into(location(node, meta), out)

    run_with_shm(body)


def test_delete_during_a_tcp_send_still_invalidates_at_once(node, stub):
    """A tcp reader that stalls mid-send keeps the extent allocated (its free is deferred), but the stamp
    must be cleared when the Delete is acknowledged, not when that reader leaves."""
    data = os.urandom(32 << 20)  # far more than the loopback socket buffers: the node's send blocks
    meta = meta_for(data)

    async def body(sel):
        t = shm_of(sel, node)
        await t.put(node.endpoint, "t", meta, data)
        out = bytearray(len(data))
        assert t.read_cached(node.endpoint, meta.key, meta.checksum, meta.size, out) == len(data)
        slow = socket.create_connection((node.endpoint.host, node.endpoint.tcp_port), timeout=5)
        try:
            slow.sendall(encode(Frame(OP_GET, key=meta.key, payload_len=len(data))))
            assert slow.recv(1 << 16)  # the send started: the node now holds a reader reference
            assert stub.Delete(keys(meta.key), timeout=5).done == 1
            assert t.read_cached(node.endpoint, meta.key, meta.checksum, meta.size, out) is None
        finally:
            slow.close()

    run_with_shm(body)


def test_reused_extent_never_serves_the_old_key(node, stub):
    """Delete A, then B — same bytes, so the same checksum, different key — lands in A's extent: the
    checksum alone would accept the copy; the changed stamp is what refuses it."""
    data = os.urandom(128 << 10)
    a, b = meta_for(data), meta_for(data)

    async def body(sel):
        t = shm_of(sel, node)
        await t.put(node.endpoint, "a", a, data)
        old = hint_of(t, node, a.key)
        assert old is not None and old.generation > 0
        stub.Delete(keys(a.key), timeout=5)
        other = TransportSelector("shm", FAST)  # another process would do the same: put without our hint
        try:
            t2 = shm_of(other, node)
            await t2.put(node.endpoint, "b", b, data)
            new = hint_of(t2, node, b.key)
            assert new is not None
            assert (new.offset, new.slot) == (old.offset, old.slot)  # the very same extent and slot
            assert new.generation > old.generation
        finally:
            await other.close()
        out = bytearray(len(data))
        assert t.read_cached(node.endpoint, a.key, a.checksum, a.size, out) is None
        with pytest.raises(ObjectNotFoundError):
            await t.get_into(location(node, a), out)
        stub.Delete(keys(b.key), timeout=5)

    run_with_shm(body)


def test_concurrent_delete_and_reuse_during_copies(node, stub):
    """A thread copies a 16 MB object in a loop while the node deletes it, reuses its extent for other
    bytes and re-puts it: every successful copy is exactly the object, and no copy that started after a
    delete was acknowledged (and before the re-put) succeeds."""
    size = 16 << 20
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    filler = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    meta = meta_for(data)
    # seq even: A readable; odd: A deleted and not yet re-put (a hit then is a stale read)
    state = {"seq": 0, "stop": False}
    outcomes = {"hits": 0, "misses": 0, "wrong": 0, "stale": 0}

    async def body(sel):
        t = shm_of(sel, node)
        await t.put(node.endpoint, "c0", meta, data)

        def reader() -> None:
            out = np.empty(size, np.uint8)
            while not state["stop"]:
                seq = state["seq"]
                n = t.read_cached(node.endpoint, meta.key, meta.checksum, size, out)
                after = state["seq"]
                if n is None:
                    outcomes["misses"] += 1
                    continue
                outcomes["hits"] += 1
                if out.tobytes() != data:
                    outcomes["wrong"] += 1
                if seq % 2 == 1 and after == seq:
                    outcomes["stale"] += 1

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            for cycle in range(12):
                await asyncio.sleep(0.01)  # let some copies run against the live object
                await asyncio.to_thread(stub.Delete, keys(meta.key), timeout=5)
                state["seq"] += 1  # odd: deleted
                m2 = meta_for(filler)
                await t.put(node.endpoint, f"f{cycle}", m2, filler)  # most likely A's old extent
                await asyncio.sleep(0.005)
                await asyncio.to_thread(stub.Delete, keys(m2.key), timeout=5)
                state["seq"] += 1  # even: A is about to be readable again (its put refreshes the hint)
                await t.put(node.endpoint, f"c{cycle + 1}", meta, data)
        finally:
            state["stop"] = True
            th.join(30)

    run_with_shm(body)
    assert outcomes["wrong"] == 0 and outcomes["stale"] == 0, outcomes
    assert outcomes["hits"] > 0 and outcomes["misses"] > 0, outcomes


@pytest.mark.parametrize("how", ["locate", "promote"])
def test_demote_invalidates_and_promote_gives_a_new_generation(node, stub, how):
    data = os.urandom(300_000)
    meta = meta_for(data)

    async def body(sel):
        t = shm_of(sel, node)
        await t.put(node.endpoint, "m", meta, data)
        first = hint_of(t, node, meta.key)
        assert first is not None and first.generation > 0
        assert stub.Demote(keys(meta.key), timeout=10).done == 1
        out = bytearray(len(data))
        assert t.read_cached(node.endpoint, meta.key, meta.checksum, meta.size, out) is None
        if how == "promote":
            assert stub.Promote(keys(meta.key), timeout=10).done == 1
            assert t.read_cached(node.endpoint, meta.key, meta.checksum, meta.size, out) is None
        before = counter(stub, "locates")
        await t.get_into(location(node, meta), out)  # LOCATE (promoting from SSD if still there)
        assert bytes(out) == data and counter(stub, "locates") == before + 1
        second = hint_of(t, node, meta.key)
        assert second is not None and second.generation > first.generation
        out[:] = bytes(len(out))
        assert t.read_cached(node.endpoint, meta.key, meta.checksum, meta.size, out) == len(data)
        assert bytes(out) == data
        stub.Delete(keys(meta.key), timeout=5)

    run_with_shm(body)


def test_slots_exhausted_objects_still_readable(tmp_path):
    """With 2 stamp slots, the other objects carry none and are read via LOCATE; a freed slot is given to
    an unstamped object at its next LOCATE."""
    proc = start_node(tmp_path, None, "16MiB", "tcp,shm", "--stamp-slots", "2")
    try:
        with grpc.insecure_channel(proc.grpc_target) as channel:
            stub = node_pb2_grpc.StorageNodeStub(channel)
            blobs = [os.urandom(10_000 + i) for i in range(4)]
            metas = [meta_for(b) for b in blobs]

            async def body(sel):
                t = shm_of(sel, proc)
                for i, (m, b) in enumerate(zip(metas, blobs, strict=True)):
                    await t.put(proc.endpoint, f"x{i}", m, b)
                assert [hint_of(t, proc, m.key) is not None for m in metas] == [True, True, False, False]
                assert counter(stub, "stamps_exhausted") == 2
                for _ in range(2):  # unstamped: every get is a LOCATE, and correct
                    for m, b in zip(metas, blobs, strict=True):
                        out = bytearray(len(b))
                        assert await t.get_into(location(proc, m), out) == len(b) and bytes(out) == b
                assert t.locates == 4 and t.fast_hits == 4
                stub.Delete(keys(metas[0].key), timeout=5)  # frees a slot ...
                out = bytearray(len(blobs[2]))
                await t.get_into(location(proc, metas[2]), out)  # ... which this LOCATE hands out
                assert hint_of(t, proc, metas[2].key) is not None
                assert t.read_cached(proc.endpoint, metas[2].key, metas[2].checksum, metas[2].size, out)

            run_with_shm(body)
    finally:
        assert proc.stop() == 0, proc.stderr()


def test_stopped_node_stamps_are_not_trusted(tmp_path):
    """A node's segment outlives it in a reader's mapping; a stopped node clears its stamps and its
    segment is unlinked, so remembered extents are refused."""
    proc = start_node(tmp_path, None, "16MiB", "tcp,shm")
    data = os.urandom(50_000)
    meta = meta_for(data)

    async def body(sel):
        t = shm_of(sel, proc)
        await t.put(proc.endpoint, "s", meta, data)
        out = bytearray(len(data))
        assert t.read_cached(proc.endpoint, meta.key, meta.checksum, meta.size, out) == len(data)
        assert proc.stop() == 0, proc.stderr()
        assert t.read_cached(proc.endpoint, meta.key, meta.checksum, meta.size, out) is None

    try:
        run_with_shm(body)
    finally:
        proc.stop()


def test_cpus_without_x86_ordering_never_trust_stamps(node, stub, monkeypatch):
    """Where the stamp protocol is not sound (weaker memory ordering than x86), readers ignore their hints:
    every get asks the node (LOCATE) and still returns the right bytes."""
    from kvpool.kvstore.protocol import shm_segment

    monkeypatch.setattr(shm_segment, "READS_TRUSTED", False)
    data = os.urandom(300_000)
    m = meta_for(data)

    async def body(sel):  # type: ignore[no-untyped-def]
        t = shm_of(sel, node)
        await t.put(node.endpoint, "untrusted", m, data)
        before = counter(stub, "locates")
        out = bytearray(len(data))
        assert t.read_cached(node.endpoint, m.key, m.checksum, m.size, out) is None
        for _ in range(2):
            assert await t.get_into(location(node, m), out) == len(data) and bytes(out) == data
        assert counter(stub, "locates") == before + 2 and t.fast_hits == 0

    run_with_shm(body)


def test_read_in_place_visits_the_pool_and_refuses_an_object_that_changed_under_the_visit(node, stub):
    """``read_in_place`` hands the visitor the object where it lies (first after one pipelined LOCATE, then
    from the hint); the visitor's own error is that item's result; an object deleted while it was visited
    is a ``StaleReadError``, whatever the visitor thought of its bytes. Over tcp the same call visits the
    receive buffer."""
    blobs = [os.urandom(n) for n in (1 << 20, 4096)]
    metas = [meta_for(b) for b in blobs]

    async def body(sel):
        await shm_of(sel, node).batch_put(
            node.endpoint, [(f"r{i}", m, b) for i, (m, b) in enumerate(zip(metas, blobs, strict=True))]
        )
        locs = [location(node, m) for m in metas]
        other = TransportSelector("shm", FAST)  # a reader without hints
        try:
            t = shm_of(other, node)
            seen: dict[int, bytes] = {}
            assert await t.read_in_place(locs, lambda i, v: seen.__setitem__(i, bytes(v))) == [None, None]
            assert seen == {0: blobs[0], 1: blobs[1]} and t.locates == 2 and t.fast_hits == 0

            def refuse_second(i: int, v: memoryview) -> None:
                if i == 1:
                    raise ValueError("not what I expected")

            got = await t.read_in_place(locs, refuse_second)
            assert got[0] is None and isinstance(got[1], ValueError) and t.locates == 2  # from the hints

            def delete_meanwhile(i: int, v: memoryview) -> None:
                assert stub.Delete(keys(metas[i].key), timeout=5).done == 1

            # from a hint: the stamp changed, so the transport asks the node again, which no longer has it
            got = await t.read_in_place(locs[1:], lambda i, v: delete_meanwhile(1, v))
            assert isinstance(got[0], ObjectNotFoundError)
        finally:
            await other.close()
        fresh = TransportSelector("shm", FAST)  # after a LOCATE: the stamp's second look fails the read
        try:
            got = await shm_of(fresh, node).read_in_place(locs[:1], delete_meanwhile)
            assert isinstance(got[0], StaleReadError)
        finally:
            await fresh.close()
        await shm_of(sel, node).put(node.endpoint, "r-again", metas[1], blobs[1])  # deleted above: again
        locs = [location(node, metas[1])]
        tcp = TransportSelector("tcp", FAST)
        try:
            seen.clear()
            got = await tcp.for_node(node.endpoint).read_in_place(
                locs, lambda i, v: seen.__setitem__(i, bytes(v))
            )
            assert got == [None] and seen == {0: blobs[1]}
        finally:
            await tcp.close()

    run_with_shm(body)
