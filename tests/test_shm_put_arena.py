"""Same-host puts through an arena (issue #18): the writer holds pool space on the node, copies each object
into it with no round trip first, and the SEAL that publishes the object (sent together with the master's
PutCommit) names where it lies. Unit tests of the node's arena table, then a real master + node."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from kvpool.kvstore.client.async_client import AsyncStoreClient
from kvpool.kvstore.errors import BadRequestError, ObjectNotFoundError, StoreError
from kvpool.kvstore.node.arenas import ArenaTable
from kvpool.kvstore.node.pool import ExtentAllocator
from kvpool.kvstore.protocol.data_frame import FLAG_ABORT, FLAG_ARENA, OP_SEAL, Frame
from kvpool.kvstore.transport.shm import ShmTransport
from kvpool.proto import node_pb2, node_pb2_grpc
from store_helpers import start_master, start_node

MB = 1 << 20


def test_an_arena_hands_out_object_extents_that_are_freed_on_their_own() -> None:
    alloc = ExtentAllocator(64 * MB)
    table = ArenaTable(alloc)
    arena = table.open("a", 8 * MB, ttl_s=30)  # 1/8 of the pool: the cap
    assert arena.size == 8 * MB and alloc.used_bytes == 8 * MB
    first = table.carve("a", arena.offset, 1000)
    skipped = arena.offset + 1024  # a slot the writer filled and never sealed
    third = table.carve("a", arena.offset + 2048, 3 * MB)
    assert (first.offset, third.offset) == (arena.offset, arena.offset + 2048)
    with pytest.raises(BadRequestError):  # overlaps the object carved before
        table.carve("a", arena.offset + 2048, 64)
    with pytest.raises(BadRequestError):  # outside the arena
        table.carve("a", arena.offset + 8 * MB, 64)
    with pytest.raises(BadRequestError):  # not aligned
        table.carve("a", skipped + 8, 64)
    with pytest.raises(ObjectNotFoundError):
        table.carve("nope", arena.offset, 64)
    assert table.close("a") == 8 * MB - 1024 - 3 * MB  # the unsealed slot comes back with the rest
    assert alloc.used_bytes == 1024 + 3 * MB  # the two objects stay
    alloc.free(first)
    alloc.free(third)
    assert alloc.used_bytes == 0 and alloc.free_extents == 1 and alloc.largest_free == 64 * MB


def test_the_reaper_closes_arenas_whose_writer_went_away() -> None:
    alloc = ExtentAllocator(64 * MB)
    table = ArenaTable(alloc)
    table.open("gone", MB, ttl_s=5)
    table.open("alive", MB, ttl_s=60)
    assert table.reap(now=table.arenas["gone"].deadline - 1) == 0
    assert table.reap(now=table.arenas["gone"].deadline + 1) == 1
    assert list(table.arenas) == ["alive"] and alloc.used_bytes == MB


def test_arena_puts_are_counted_as_shm_bytes_and_held_arenas_as_a_gauge() -> None:
    from kvpool.kvstore.node.metrics import NodeCollector, TransportBytes, TransportTap
    from kvpool.kvstore.node.object_store import ObjectStore
    from kvpool.kvstore.node.pool import SharedPool
    from kvpool.proto import common_pb2

    pool = SharedPool(64 * MB)
    try:
        store, counts = ObjectStore(pool), TransportBytes()
        tap = TransportTap(store, "tcp", counts)  # shm control frames arrive over the tcp server
        arena = tap.open_arena("w", 8 * MB, epoch=0, ttl_s=30)
        meta = common_pb2.ObjectMeta(key=b"Ba", kind=common_pb2.BLOB, size=1000, checksum=42)
        assert tap.seal_in_arena("w", arena.offset, meta)
        assert counts.bytes == {("shm", "in"): 1000}
        families = {f.name: f for f in NodeCollector(store, counts, lambda: "n").collect()}
        assert families["kvpool_node_arena_bytes"].samples[0].value == 8 * MB - 1024
    finally:
        pool.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("arena")
    master = start_master(logs)
    node = start_node(logs, master.address, "256MiB", "tcp,shm")
    yield master, node
    assert node.stop() == 0, node.stderr()
    master.stop()


def _info(node) -> node_pb2.NodeInfoReply:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(node.grpc_target) as channel:
        return node_pb2_grpc.StorageNodeStub(channel).Info(node_pb2.NodeInfoRequest(), timeout=5)


def test_consecutive_shm_puts_share_one_arena_and_read_back_exactly(cluster) -> None:
    master, node = cluster
    start = _info(node)
    before = start.counters
    blobs = [os.urandom(MB + 77 * i) for i in range(8)]
    seen_metrics: dict[str, float] = {}

    async def main() -> list[bytes]:
        async with AsyncStoreClient(master.address, transport="shm") as client:
            for i, blob in enumerate(blobs):
                assert await client.put(b"arena/%d" % i, blob)
            seen_metrics.update(client.metrics())
            return [bytes(await client.get(b"arena/%d" % i)) for i in range(len(blobs))]

    assert asyncio.run(main()) == blobs
    assert seen_metrics["shm.arenas_opened"] == 1 and seen_metrics["shm.arena_puts"] == len(blobs) - 1
    after = _info(node)
    # the first put has no node to guess yet; every later one copies into the one arena
    assert after.counters["puts_arena"] - before.get("puts_arena", 0) == len(blobs) - 1
    assert after.counters["arenas_opened"] - before.get("arenas_opened", 0) == 1
    # the client closed its arena on exit: the pool holds exactly the objects again
    grown = after.dram_used_bytes - start.dram_used_bytes
    assert grown == sum(-(-len(b) // 64) * 64 for b in blobs)


def test_a_seal_refused_after_the_master_committed_is_withdrawn(cluster) -> None:
    """The node lost the arena between the copy and the SEAL (here: closed by a real frame, as its reaper
    would at the deadline). The SEAL fails while the master's PutCommit succeeded at the same moment: the
    client withdraws the entry, so nobody is sent to a copy that does not exist; the next put works."""
    master, _node = cluster
    blob = os.urandom(2 * MB)

    async def main() -> None:
        async with AsyncStoreClient(master.address, transport="shm") as client:
            assert await client.put(b"arena/warm", blob)  # makes the node this client's guess
            shm = client.transports.for_node(client._last_put_node)
            assert isinstance(shm, ShmTransport)
            real_seal = shm.arena.seal

            async def seal_after_losing_the_arena(node_ep, token, abort=False):  # type: ignore[no-untyped-def]
                lease = shm.arena._slots[token].lease
                close = Frame(OP_SEAL, aux=lease.token.encode(), flags=FLAG_ARENA | FLAG_ABORT)
                await shm._control.control(node_ep, [close])
                return await real_seal(node_ep, token, abort)

            shm.arena.seal = seal_after_losing_the_arena  # type: ignore[method-assign]
            with pytest.raises(StoreError):
                await client.put(b"arena/lost", blob)
            shm.arena.seal = real_seal  # type: ignore[method-assign]
            found = await client.lookup([b"arena/lost"])
            assert not found.found, "the index kept an object the node never published"
            assert client.metrics()["put.seal_withdrawn"] == 1
            assert await client.put(b"arena/lost", blob)  # a fresh arena; the put goes through
            assert bytes(await client.get(b"arena/lost")) == blob

    asyncio.run(main())


WRITER = textwrap.dedent(
    """
    import os, sys, time
    from kvpool.kvstore.client.sync_client import StoreClient
    c = StoreClient(sys.argv[1], "shm")
    for i in range(3):
        c.put(b"arena-dying-%d" % i, os.urandom(1 << 20))
    print("holding", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_writers_arena_is_reaped_at_its_deadline(tmp_path) -> None:
    """A writer killed while it holds an arena leaves nothing behind: its sealed objects stay readable and
    the node's reaper gives the arena's bytes back at the deadline (``--reservation-ttl``)."""
    master = start_master(tmp_path)
    node = start_node(tmp_path, master.address, "128MiB", "tcp,shm", "--reservation-ttl", "2")
    p = subprocess.Popen([sys.executable, "-c", WRITER, master.address], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "holding"
        objects = 3 * MB
        held = _info(node)
        assert held.counters["arenas_opened"] == 1 and held.dram_used_bytes > objects  # the arena's rest
        p.kill()
        p.wait(timeout=10)
        deadline = time.monotonic() + 2 + 1 + 10  # ttl, reaper period (ttl / 2), slack for a loaded box
        while (now := _info(node)).dram_used_bytes != objects:
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        assert now.counters["arenas_reaped"] == 1

        async def read_back() -> list[int]:
            async with AsyncStoreClient(master.address, transport="shm") as client:
                return [len(await client.get(b"arena-dying-%d" % i)) for i in range(3)]

        assert asyncio.run(read_back()) == [MB] * 3
    finally:
        if p.poll() is None:
            p.kill()
        assert node.stop() == 0, node.stderr()
        master.stop()
