"""The store's fast paths keep the slow paths' semantics: same answers, same pins, same errors."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from kvpool.kvstore.client.records import LocationColumns
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import ObjectNotFoundError
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.master.core import MasterCore
from kvpool.proto import common_pb2, master_pb2
from store_helpers import start_master, start_node


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def _chain(n: int) -> list[bytes]:
    out, prev = [], b"perf"
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


def _register(core: MasterCore, node_id: str, inventory: list[common_pb2.ObjectMeta]) -> None:
    ep = common_pb2.NodeEndpoint(node_id=node_id, host="127.0.0.1", grpc_port=9, tcp_port=10, shm_name="s")
    core.register_node(
        master_pb2.RegisterNodeRequest(node=ep, dram_capacity_bytes=1 << 30, inventory=inventory)
    )


def _core_with_chain(n: int) -> tuple[MasterCore, list[bytes]]:
    core = MasterCore(clock=Clock())
    hs = _chain(n)
    inv: dict[str, list[common_pb2.ObjectMeta]] = {"a": [], "b": []}
    parent = b""
    for i, h in enumerate(hs):
        meta = common_pb2.ObjectMeta(
            key=mla_key(h),
            kind=common_pb2.MLA_BLOCK,
            size=100 + i,
            checksum=1000 + i,
            parent=parent,
            tenant="t1" if i % 3 == 0 else "",
            ttl_ms=60_000 if i % 5 == 0 else 0,
        )
        inv["a" if i % 2 else "b"].append(meta)
        parent = meta.key
    ck = common_pb2.ObjectMeta(key=kda_key(hs[-1]), kind=common_pb2.KDA_CHECKPOINT, size=7, checksum=9)
    inv["a"].append(ck)
    for node_id, metas in inv.items():
        _register(core, node_id, metas)
    return core, hs


def test_compact_match_prefix_carries_the_same_locations() -> None:
    core, hs = _core_with_chain(40)
    req = master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=True)
    full = core.match_prefix(req)
    req.compact = True
    compact = core.match_prefix(req)
    assert not compact.mla and not compact.HasField("checkpoint")
    assert (
        (compact.usable_blocks, compact.mla_run_blocks)
        == (full.usable_blocks, full.mla_run_blocks)
        == (40, 40)
    )
    assert list(compact.checkpoint_blocks) == list(full.checkpoint_blocks)
    assert compact.usable_blocks_on_ssd == full.usable_blocks_on_ssd
    cols = LocationColumns.of_match(compact, hs)
    assert len(cols) == 41 and len(cols.nodes) == 2
    assert cols.locations(0, 40) == list(full.mla)
    assert cols.location(40) == full.checkpoint
    assert int(cols.size.sum()) == sum(loc.meta.size for loc in full.mla) + full.checkpoint.meta.size


def test_compact_match_prefix_acquire_pins_like_the_full_one() -> None:
    core, hs = _core_with_chain(10)
    reply = core.match_prefix(
        master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=True, acquire=True, compact=True)
    )
    assert reply.lease_id and reply.table.rows == 11
    assert core.stats(master_pb2.StatsRequest()).active_leases == 1
    core.release(master_pb2.ReleaseRequest(lease_id=reply.lease_id))
    assert core.stats(master_pb2.StatsRequest()).active_leases == 0


def test_compact_match_prefix_of_nothing_is_empty() -> None:
    core, _hs = _core_with_chain(3)
    reply = core.match_prefix(master_pb2.MatchPrefixRequest(block_hashes=[b"\x01" * 32], compact=True))
    assert reply.usable_blocks == 0 and reply.table.rows == 0
    assert len(LocationColumns.of_match(reply, [b"\x01" * 32])) == 0


# --- direct gets (a key whose node the client knows is read without asking the master) ------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("perf-cluster")
    master = start_master(logs, "--heartbeat-ms", "200", "--node-timeout-ms", "1500")
    node = start_node(logs, master.address, "64MiB", "tcp,shm")
    yield master, node
    node.stop()
    master.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_direct_get_answers_like_lookup_then_fetch(cluster, transport) -> None:
    master, _node = cluster
    key = f"perf/{transport}/{os.urandom(4).hex()}".encode()
    first, second = os.urandom(300_000), os.urandom(200_000)
    with StoreClient(master.address, transport) as a, StoreClient(master.address, transport) as b:
        assert a.put(key, first) is True  # a now knows where the key lives
        assert a.get(key) == first
        assert a.metrics().get("get.direct", 0) >= 1
        # removed by someone else: Remove answers only after the node dropped the key, so a's remembered
        # location must not resurrect it, not even for a moment
        assert b.remove([key]) == 1
        with pytest.raises(ObjectNotFoundError):
            a.get(key)
        with pytest.raises(ObjectNotFoundError):
            a.get_into(key, bytearray(len(first)))
        # replaced by someone else with other bytes: a gets the new object, never the old one
        assert a.put(key, first) is True
        assert b.remove([key]) == 1
        assert b.put(key, second) is True
        out = bytearray(len(second))
        assert a.get_into(key, out) == len(second) and out == second
        assert a.get(key) == second
        assert a.metrics().get("get.direct_fallback", 0) >= 1


def test_direct_reads_are_reported_to_the_eviction_policy(cluster) -> None:
    """Reads that never reached the master still count as uses: the client reports them in batches."""
    master, _node = cluster
    keys = [f"perf/touch/{i}/{os.urandom(4).hex()}".encode() for i in range(3)]
    with StoreClient(master.address, "tcp") as c:
        for k in keys:
            c.put(k, os.urandom(1000))
        before = c.stats().counters.get("touch_reports", 0)
        for _ in range(2):
            for k in keys:
                c.get(k)
        assert c.metrics().get("get.direct", 0) >= 6
        deadline = time.monotonic() + 5
        while c.stats().counters.get("touch_reports", 0) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats().counters.get("touch_reports", 0) > before


def test_speculative_shm_reservation_is_aborted_when_the_put_is_a_duplicate(cluster) -> None:
    import grpc
    from kvpool.proto import node_pb2, node_pb2_grpc

    master, node = cluster
    data = os.urandom(100_000)
    key = f"perf/dup/{os.urandom(4).hex()}".encode()

    def dram_used() -> int:
        with grpc.insecure_channel(node.grpc_target) as ch:
            reply = node_pb2_grpc.StorageNodeStub(ch).Info(node_pb2.NodeInfoRequest(), timeout=5)
        return reply.dram_used_bytes

    with StoreClient(master.address, "shm") as c:
        assert c.put(key + b"/first", data) is True  # the client now knows a node to reserve on
        assert c.put(key, data) is True
        assert c.metrics().get("put.overlapped", 0) >= 1
        used = dram_used()
        assert c.put(key, data) is False  # EXISTS at the master: nothing stays reserved
        assert dram_used() == used
        assert c.get(key) == data
