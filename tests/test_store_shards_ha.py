"""Master shards with HA (docs/design/sharding.md §4, ha.md): one etcd member, two shards of two masters
each (HA groups ``<group>-shard0`` and ``<group>-shard1``), one storage node, a client given
``a0,b0;a1,b1``. SIGKILL of shard 1's leader: its standby is elected within the lease, rebuilds the shard's
index from the node's inventory (the node's link follows it), and shard 1's chains hit again; shard 0
never stops hitting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.chains import chain
from harness.store_procs import start_node
from kvpool.kvstore.client.async_client import AsyncStoreClient
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.shards import ShardSet
from kvpool.runtime.spawn import Child, spawn, start, wait_ready
from test_store_shards import BLOCKS, _put_all

from kvpool.launch import ha_cluster
from kvpool.launch.service_argv import master_argv

SHARDS = ShardSet(2)
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
            for s in range(SHARDS.count)
        ]
        self.addresses = [[f"127.0.0.1:{m.ready['port']}" for m in group] for group in self.groups]
        for group in self.addresses:
            ha_cluster.wait_for_leader(group, 30.0)
        self.spec = ";".join(",".join(group) for group in self.addresses)
        self.children.append(start_node(base, self.spec, "64MiB", "tcp,shm", prefault=False))

    def _started(self, child: Child) -> Child:
        self.children.append(child)
        return child

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
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HaFleet]:
    f = HaFleet(tmp_path_factory.mktemp("shards-ha"))
    yield f
    f.stop()


def test_a_client_with_a_stale_shard_set_is_told_and_follows(fleet: HaFleet) -> None:
    """A client that knows only shard 0 (its config predates the second shard) puts and finds every chain:
    the master that does not own a route says so, the client asks Describe for the fleet's shard set and
    leaders (kept from etcd) and follows."""
    chains = [chain(BLOCKS, f"stale-{i}") for i in range(8)]
    assert {SHARDS.shard_of_chain(h) for h in chains} == {0, 1}

    async def run() -> tuple[list[int], ShardSet, float]:
        async with AsyncStoreClient(",".join(fleet.addresses[0]), "tcp") as c:
            await _put_all(c, chains)
            got = [(await c.match_prefix(h)).usable_blocks for h in chains]
            return got, c.shards, c.metrics()["shard_set_followed"]

    got, followed, times = asyncio.run(run())
    assert got == [BLOCKS] * len(chains) and followed == SHARDS and times == 1


def test_a_shards_standby_takes_over_and_its_chains_hit_again(fleet: HaFleet) -> None:
    chains = [chain(BLOCKS, f"ha-{i}") for i in range(16)]
    on = {s: [h for h in chains if SHARDS.shard_of_chain(h) == s] for s in range(SHARDS.count)}
    assert all(on.values())

    async def usable(c: AsyncStoreClient, hashes: list[bytes]) -> int:
        try:
            return (await c.match_prefix(hashes)).usable_blocks
        except StoreError:
            return 0

    async def run() -> float:
        async with AsyncStoreClient(fleet.spec, "tcp", rpc_timeout_s=1.0) as c:
            await _put_all(c, chains)
            assert [await usable(c, h) for h in chains] == [BLOCKS] * len(chains)
            held = (await c.stats(1)).objects
            old = fleet.leader(1)
            old.kill()
            t0 = time.monotonic()
            while not all([await usable(c, h) == BLOCKS for h in on[1]]):
                assert time.monotonic() - t0 < TAKEOVER_S, "shard 1's chains did not come back"
                # shard 0 is untouched meanwhile
                assert [await usable(c, h) for h in on[0]] == [BLOCKS] * len(on[0])
                await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            new = fleet.leader(1)
            assert new is not old
            stats = await c.stats(1)
            assert stats.objects == held >= (BLOCKS + 1) * len(on[1])  # rebuilt from the node's inventory
            return took

    took = asyncio.run(run())
    assert took < TAKEOVER_S
