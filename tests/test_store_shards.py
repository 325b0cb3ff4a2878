"""Master shards through real processes (docs/design/sharding.md): three master shards, two storage nodes
registered with all of them, clients routing with the same function the masters check.

What is proven: every chain lives whole on the shard its route names (and only there); a node keeps each
shard's objects apart (inventories, orders, puts); parties with different shard parameters get one clear
error naming both; SIGKILL of one shard's master costs only that shard's chains (a fast typed error, i.e. a
miss), the others keep hitting. With HA (two shards of two masters on one etcd member): a client with a stale
shard set is told and follows, and a shard's standby takes over and rebuilds its index from the node."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.chains import chain
from harness.master_proc import wait_until
from harness.store_procs import READY_TIMEOUT_S, start_master, start_node
from kvpool.kvstore.client.async_client import AsyncStoreClient, PutItem
from kvpool.kvstore.errors import (
    ObjectExistsError,
    ShardSetError,
    StoreError,
    StoreUnavailableError,
    WrongShardError,
)
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.node.object_store import ObjectStore, checksum_of
from kvpool.kvstore.node.pool import SharedPool
from kvpool.kvstore.protocol.master_wire import call_blocking
from kvpool.kvstore.shards import ShardSet
from kvpool.proto import common_pb2, master_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime import cluster_auth
from kvpool.runtime.spawn import Child, LaunchError, spawn, start, wait_ready

from kvpool.launch import ha_cluster
from kvpool.launch.service_argv import master_argv

SHARDS = ShardSet(3)
BLOCKS = 4
CHAINS = 24


class Fleet:
    def __init__(self, base: Path) -> None:
        self.masters = [
            start_master(base / f"m{i}", "--shards", "3", "--shard", str(i), "--heartbeat-ms", "200")
            for i in range(SHARDS.count)
        ]
        self.spec = ";".join(m.address for m in self.masters)
        self.nodes = [
            start_node(base / f"n{i}", self.spec, "64MiB", "tcp,shm", prefault=False) for i in range(2)
        ]

    def stop(self) -> None:
        for proc in [*self.nodes, *self.masters]:
            if proc.alive():
                proc.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("shards"))
    yield f
    f.stop()


def _items(hashes: list[bytes]) -> list[PutItem]:
    route = SHARDS.route_of_chain(hashes)
    items = [
        PutItem(
            mla_key(h),
            bytes([i]) * 1024,
            common_pb2.MLA_BLOCK,
            parent=mla_key(hashes[i - 1]) if i else b"",
            route=route,
        )
        for i, h in enumerate(hashes)
    ]
    items.append(PutItem(kda_key(hashes[-1]), b"k" * 512, common_pb2.KDA_CHECKPOINT, route=route))
    return items


def _chains(seed: str) -> list[list[bytes]]:
    return [chain(BLOCKS, f"{seed}-{i}") for i in range(CHAINS)]


async def _put_all(client: AsyncStoreClient, chains: list[list[bytes]]) -> None:
    for hashes in chains:
        assert await client.batch_put(_items(hashes)) == [None] * (BLOCKS + 1)


def test_every_chain_lives_whole_on_its_shard(fleet: Fleet) -> None:
    chains = _chains("whole")

    async def run() -> list[master_pb2.StatsReply]:
        async with AsyncStoreClient(fleet.spec, "tcp") as c:
            await _put_all(c, chains)
            for hashes in chains:
                m = await c.match_prefix(hashes, acquire=True)
                assert m.usable_blocks == BLOCKS and m.checkpoint.meta.key == kda_key(hashes[-1])
                # its lease is released at the shard that granted it
                await c.release(m.lease_id)
                # the head of a chain routed by the whole chain's route finds the same objects
                head = await c.match_prefix(
                    hashes[:1], route=SHARDS.route_of_chain(hashes), require_checkpoint=False
                )
                assert head.mla_run_blocks == 1
            return [await c.stats(shard) for shard in range(SHARDS.count)]

    stats = asyncio.run(run())
    expected = [0] * SHARDS.count
    for hashes in chains:
        expected[SHARDS.shard_of_chain(hashes)] += BLOCKS + 1
    assert [s.objects for s in stats] == expected and all(expected), expected
    assert all(s.active_leases == 0 for s in stats)
    # each node offered every shard an equal slice of its pool
    assert {s.capacity_bytes for s in stats} == {2 * (64 << 20) // 3}


def test_nodes_keep_each_shards_objects_apart(fleet: Fleet) -> None:
    chains = _chains("apart")
    asyncio.run(_put_all_with(fleet.spec, chains))
    owner = {mla_key(h): SHARDS.shard_of_chain(hs) for hs in chains for h in hs}

    async def inventory(target: str) -> list[common_pb2.ObjectMeta]:
        async with cluster_auth.aio_channel(target) as ch:
            stub = node_pb2_grpc.StorageNodeStub(ch)
            return [m async for m in stub.Inventory(node_pb2.InventoryRequest())]

    async def order_other_shard(target: str, key: bytes, shard: int) -> node_pb2.KeysReply:
        async with cluster_auth.aio_channel(target) as ch:
            return await node_pb2_grpc.StorageNodeStub(ch).Delete(
                node_pb2.KeysRequest(keys=[key], shard=shard)
            )

    seen = 0
    for node in fleet.nodes:
        for meta in asyncio.run(inventory(node.grpc_target)):
            if meta.key in owner:
                assert meta.shard == owner[meta.key]
                seen += 1
    assert seen == len(owner)
    # a Delete from a shard that did not place the object leaves it alone (reported missing)
    key = next(iter(owner))
    other = (owner[key] + 1) % SHARDS.count
    for node in fleet.nodes:
        reply = asyncio.run(order_other_shard(node.grpc_target, key, other))
        assert reply.done == 0
    m = asyncio.run(_match(fleet.spec, next(hs for hs in chains if mla_key(hs[0]) == key)))
    assert m.usable_blocks == BLOCKS


async def _put_all_with(spec: str, chains: list[list[bytes]]) -> None:
    async with AsyncStoreClient(spec, "tcp") as c:
        await _put_all(c, chains)


async def _match(spec: str, hashes: list[bytes], **kw: object) -> master_pb2.MatchPrefixReply:
    async with AsyncStoreClient(spec, "tcp", **kw) as c:  # type: ignore[arg-type]
        return await c.match_prefix(hashes)


def test_two_shards_holding_one_key_share_its_bytes() -> None:
    """Keys are content hashes: a block put by two shards (a short chain routed by its own last block, then
    extended and routed by its second) is one copy owned by both. Each shard's orders act on its ownership
    only; the bytes go with the last owner; a different object under the key is still refused."""
    store = ObjectStore(SharedPool(1 << 20, stamp_slots=16))
    try:

        def put(shard: int, data: bytes = b"abcd") -> None:
            pending = store.begin_put(
                f"p{shard}", common_pb2.ObjectMeta(key=b"Bx", size=len(data), shard=shard)
            )
            if pending is None:
                return  # the bytes are here already: now held for this shard too
            store.pool.view(pending.extent)[: len(data)] = data
            pending.meta.checksum = checksum_of(data)
            store.finish_put(pending)

        put(1)
        put(2)
        assert store.objects[b"Bx"].owners == {1, 2} and store.counters["puts_shared_between_shards"] == 1
        assert [m.key for m in store.inventory(1)] == [m.key for m in store.inventory(2)] == [b"Bx"]
        assert store.inventory(0) == []
        assert store.delete([b"Bx"], shard=0) == (0, [b"Bx"])  # not shard 0's: nothing happens
        assert store.delete([b"Bx"], shard=1) == (1, [])
        assert b"Bx" in store.objects and store.inventory(1) == []  # shard 2 still holds it
        with pytest.raises(ObjectExistsError, match="different object"):
            store.begin_put("p3", common_pb2.ObjectMeta(key=b"Bx", size=5, shard=3))
        assert store.delete([b"Bx"], shard=2) == (1, []) and b"Bx" not in store.objects
    finally:
        store.pool.close()


def test_parties_with_other_shard_parameters_get_one_clear_error(fleet: Fleet, tmp_path: Path) -> None:
    hashes = chain(BLOCKS, "params")
    with pytest.raises(ShardSetError, match="has 3 shards at depth 2, the caller has 3 shards at depth 1"):
        asyncio.run(_match(fleet.spec, hashes, shard_depth=1))
    # a client that knows only two of the three shards: named by the master it reaches
    stale = ";".join(m.address for m in fleet.masters[:2])
    with pytest.raises(ShardSetError, match="has 3 shards at depth 2, the caller has 2 shards at depth 2"):
        asyncio.run(_match(stale, hashes))
    # a master asked for a route it does not own (a caller routing by hand) refuses it
    wrong = (SHARDS.shard_of_chain(hashes) + 1) % SHARDS.count

    async def misrouted() -> None:
        async with AsyncStoreClient(fleet.spec, "tcp") as c:
            await c.link(wrong).match_prefix(master_pb2.MatchPrefixRequest(block_hashes=hashes))

    with pytest.raises(
        WrongShardError, match=f"belongs to shard {SHARDS.shard_of_chain(hashes)} of 3 shards"
    ):
        asyncio.run(misrouted())
    # a master whose shard is out of range never starts
    with pytest.raises(LaunchError, match="shard 3 is not one of 3 shards at depth 2"):
        spawn("master", master_argv(extra=("--shards", "3", "--shard", "3")), tmp_path, READY_TIMEOUT_S)


def test_a_node_joining_late_is_used_by_every_shard(fleet: Fleet, tmp_path: Path) -> None:
    late = start_node(tmp_path, fleet.spec, "64MiB", "tcp,shm", prefault=False)
    fleet.nodes.append(late)

    async def run() -> set[int]:
        async with AsyncStoreClient(fleet.spec, "tcp") as c:
            deadline = time.monotonic() + 10
            while [(await c.stats(s)).nodes for s in range(SHARDS.count)] != [3] * SHARDS.count:
                assert time.monotonic() < deadline, "a shard never saw the late node"
                await asyncio.sleep(0.05)
            await _put_all(c, _chains("late"))  # the emptiest node takes new objects first
        async with cluster_auth.aio_channel(late.grpc_target) as ch:
            stub = node_pb2_grpc.StorageNodeStub(ch)
            return {m.shard async for m in stub.Inventory(node_pb2.InventoryRequest())}

    assert asyncio.run(run()) == set(range(SHARDS.count))


def test_a_node_starts_while_a_shard_is_down_and_one_with_other_parameters_does_not(tmp_path: Path) -> None:
    """A dead shard never keeps a node from the others: it is ready within --shard-register-wait-s and the
    live shard uses it. A node whose shard parameters differ from the masters' exits with both named."""
    live = start_master(tmp_path / "live", "--shards", "2", "--shard", "0")
    dead_port = ha_cluster.free_port()  # nobody listens there
    node = None
    try:
        spec = f"{live.address};127.0.0.1:{dead_port}"
        node = start_node(
            tmp_path / "n", spec, "16MiB", "tcp", "--shard-register-wait-s", "1", prefault=False
        )

        async def nodes() -> int:
            async with AsyncStoreClient(spec, "tcp") as c:
                return (await c.stats(0)).nodes

        assert asyncio.run(nodes()) == 1
        with pytest.raises(
            LaunchError, match=r"master shard 0 has 2 shards at depth 2, node .* has 2 shards at depth 3"
        ):
            start_node(tmp_path / "n2", spec, "16MiB", "tcp", "--shard-depth", "3", prefault=False)
    finally:
        if node is not None:
            node.stop()
        live.stop()


def test_a_dead_shard_costs_only_its_chains(fleet: Fleet) -> None:
    """Last in the module: SIGKILL of shard 1's master. Its chains fail fast with a typed error (the worker's
    miss); the other shards' chains still hit; nothing waits past its deadline."""
    chains = _chains("dead")
    asyncio.run(_put_all_with(fleet.spec, chains))
    fleet.masters[1].kill()

    async def run() -> tuple[int, int, float]:
        hits = misses = 0
        slowest = 0.0
        async with AsyncStoreClient(fleet.spec, "tcp", rpc_timeout_s=2.0) as c:
            for hashes in chains:
                t0 = time.monotonic()
                try:
                    m = await c.match_prefix(hashes)
                except StoreUnavailableError:
                    assert SHARDS.shard_of_chain(hashes) == 1
                    misses += 1
                else:
                    assert SHARDS.shard_of_chain(hashes) != 1 and m.usable_blocks == BLOCKS
                    hits += 1
                slowest = max(slowest, time.monotonic() - t0)
        return hits, misses, slowest

    hits, misses, slowest = asyncio.run(run())
    assert misses == sum(SHARDS.shard_of_chain(h) == 1 for h in chains) > 0 and hits == CHAINS - misses > 0
    assert slowest < 2.5
    assert all(n.alive() for n in fleet.nodes)


# ---- with HA: one etcd member, two shards of two masters each (HA groups <group>-shard0/1), one node
HA_SHARDS = ShardSet(2)
TAKEOVER_S = 10.0  # lease 2 s + campaign period + the node's re-registration, with a 2-core margin


class HaFleet:
    def __init__(self, base: Path) -> None:
        self.children: list[Child] = []
        etcd = ha_cluster.start_etcd(
            lambda name, role, argv, i: self._started(start(name, argv, base / f"{name}.log")),
            wait_ready,
            base,
            ["127.0.0.1"],
            30.0,
        )
        flags = ha_cluster.master_flags(etcd)
        self.groups: list[list[Child]] = [
            [
                self._spawn(
                    f"m{s}-{i}",
                    master_argv(
                        heartbeat_ms=200,
                        node_timeout_ms=1500,
                        extra=("--shards", "2", "--shard", str(s), *flags),
                    ),
                    base,
                )
                for i in range(2)
            ]
            for s in range(HA_SHARDS.count)
        ]
        self.addresses = [[f"127.0.0.1:{m.ready['port']}" for m in group] for group in self.groups]
        for group in self.addresses:
            ha_cluster.wait_for_leader(group, 30.0)
        wait_until(self._shard_maps_known, 30.0, interval_s=0.1)
        self.spec = ";".join(",".join(group) for group in self.addresses)
        self.children.append(start_node(base, self.spec, "64MiB", "tcp,shm", prefault=False))

    def _started(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def _shard_maps_known(self) -> bool:
        """Whether every shard's leader's Describe names all the shards' leaders (a master reads them from
        etcd once per lease period, after the elections): what a client with a stale shard set follows."""
        leaders = [ha_cluster.leader_of(group) for group in self.addresses]
        try:
            maps = [
                call_blocking(a, "Describe", master_pb2.DescribeRequest(), 1.0).shard_masters
                for a in leaders
                if a
            ]
        except StoreError:
            return False
        return len(maps) == len(leaders) and all(len(m.split(";")) == HA_SHARDS.count for m in maps)

    def _spawn(self, name: str, argv: list[str], base: Path) -> Child:
        return self._started(spawn(name, argv, base, 30.0))

    def leader(self, shard: int) -> Child:
        address = ha_cluster.leader_of(self.addresses[shard])
        return next(m for m in self.groups[shard] if f"127.0.0.1:{m.ready['port']}" == address)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.alive():
                child.stop()


@pytest.fixture(scope="module")
def ha_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HaFleet]:
    f = HaFleet(tmp_path_factory.mktemp("shards-ha"))
    yield f
    f.stop()


def test_a_client_with_a_stale_shard_set_is_told_and_follows(ha_fleet: HaFleet) -> None:
    """A client that knows only shard 0 (its config predates the second shard) puts and finds every chain:
    the master that does not own a route says so, the client asks Describe for the fleet's shard set and
    leaders (kept from etcd) and follows."""
    chains = [chain(BLOCKS, f"stale-{i}") for i in range(8)]
    assert {HA_SHARDS.shard_of_chain(h) for h in chains} == {0, 1}

    async def run() -> tuple[list[int], ShardSet, float]:
        async with AsyncStoreClient(",".join(ha_fleet.addresses[0]), "tcp") as c:
            await _put_all(c, chains)
            got = [(await c.match_prefix(h)).usable_blocks for h in chains]
            return got, c.shards, c.metrics()["shard_set_followed"]

    got, followed, times = asyncio.run(run())
    assert got == [BLOCKS] * len(chains) and followed == HA_SHARDS and times == 1


def test_a_shards_standby_takes_over_and_its_chains_hit_again(ha_fleet: HaFleet) -> None:
    chains = [chain(BLOCKS, f"ha-{i}") for i in range(16)]
    on = {s: [h for h in chains if HA_SHARDS.shard_of_chain(h) == s] for s in range(HA_SHARDS.count)}
    assert all(on.values())

    async def usable(c: AsyncStoreClient, hashes: list[bytes]) -> int:
        try:
            return (await c.match_prefix(hashes)).usable_blocks
        except StoreError:
            return 0

    async def run() -> float:
        async with AsyncStoreClient(ha_fleet.spec, "tcp", rpc_timeout_s=1.0) as c:
            await _put_all(c, chains)
            assert [await usable(c, h) for h in chains] == [BLOCKS] * len(chains)
            held = (await c.stats(1)).objects
            old = ha_fleet.leader(1)
            old.kill()
            t0 = time.monotonic()
            while not all([await usable(c, h) == BLOCKS for h in on[1]]):
                assert time.monotonic() - t0 < TAKEOVER_S, "shard 1's chains did not come back"
                # shard 0 is untouched meanwhile
                assert [await usable(c, h) for h in on[0]] == [BLOCKS] * len(on[0])
                await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            new = ha_fleet.leader(1)
            assert new is not old
            stats = await c.stats(1)
            assert stats.objects == held >= (BLOCKS + 1) * len(on[1])  # rebuilt from the node's inventory
            return took

    took = asyncio.run(run())
    assert took < TAKEOVER_S
