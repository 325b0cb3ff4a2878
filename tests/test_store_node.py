"""Storage node process: control plane, SSD tier, capacity, shutdown, CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvpool.kvstore.errors import CapacityExceededError, ObjectNotFoundError
from kvpool.kvstore.transport.selector import TransportSelector
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from store_helpers import location, start_node


def meta_for(data: bytes) -> common_pb2.ObjectMeta:
    return common_pb2.ObjectMeta(
        key=b"B" + os.urandom(16),
        kind=common_pb2.BLOB,
        size=len(data),
        checksum=xxhash.xxh3_64_intdigest(data),
    )


def put_all(node, choice: str, blobs: list[bytes]) -> list[common_pb2.ObjectMeta]:
    async def main() -> list[common_pb2.ObjectMeta]:
        sel = TransportSelector(choice)
        try:
            t = sel.for_node(node.endpoint)
            metas = [meta_for(b) for b in blobs]
            for m, b in zip(metas, blobs, strict=True):
                await t.put(node.endpoint, "p", m, b)
            return metas
        finally:
            await sel.close()

    return asyncio.run(main())


def get_one(node, choice: str, meta: common_pb2.ObjectMeta) -> bytes:
    async def main() -> bytes:
        sel = TransportSelector(choice)
        try:
            out = bytearray(meta.size)
            await sel.for_node(node.endpoint).get_into(location(node, meta), out)
            return bytes(out)
        finally:
            await sel.close()

    return asyncio.run(main())


def stub(node) -> tuple[grpc.Channel, node_pb2_grpc.StorageNodeStub]:
    ch = grpc.insecure_channel(node.grpc_target)
    return ch, node_pb2_grpc.StorageNodeStub(ch)


def test_control_plane_health_info_inventory_delete(tmp_path):
    node = start_node(tmp_path, None, "16MiB", "tcp,shm")
    try:
        assert node.ready["ucx_port"] == 0 and node.ready["shm_name"]
        ch, s = stub(node)
        with ch:
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            blobs = [os.urandom(n) for n in (100, 5000, 1 << 20)]
            metas = put_all(node, "tcp", blobs)
            info = s.Info(node_pb2.NodeInfoRequest(), timeout=5)
            assert info.objects == 3 and info.dram_capacity_bytes == 16 << 20
            assert info.dram_used_bytes >= sum(len(b) for b in blobs) and info.counters["puts"] == 3
            assert info.node.tcp_port == node.ready["tcp_port"]
            inv = {m.key: m for m in s.Inventory(node_pb2.InventoryRequest(), timeout=5)}
            assert set(inv) == {m.key for m in metas} and all(m.tier == common_pb2.DRAM for m in inv.values())
            reply = s.Delete(node_pb2.KeysRequest(keys=[metas[0].key, b"Bnope"]), timeout=5)
            assert reply.done == 1 and list(reply.missing) == [b"Bnope"]
            with pytest.raises(ObjectNotFoundError):
                get_one(node, "tcp", metas[0])
            assert get_one(node, "shm", metas[2]) == blobs[2]
            with pytest.raises(grpc.RpcError) as err:  # bad input: typed status, node keeps serving
                s.Delete(node_pb2.KeysRequest(keys=[b"k"] * 100_001), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert s.Info(node_pb2.NodeInfoRequest(), timeout=5).objects == 2
    finally:
        assert node.stop() == 0, node.stderr()


def test_capacity_limit_is_a_typed_error(tmp_path):
    node = start_node(tmp_path, None, "4MiB", "tcp,shm")
    try:
        put_all(node, "tcp", [os.urandom(1 << 20) for _ in range(3)])
        for choice in ("tcp", "shm"):
            with pytest.raises(CapacityExceededError):
                put_all(node, choice, [os.urandom(2 << 20)])
        put_all(node, "tcp", [os.urandom(512 << 10)])  # what fits still goes in
    finally:
        node.stop()


def test_sigterm_unlinks_the_pool(tmp_path):
    node = start_node(tmp_path, None, "8MiB", "tcp,shm,ucx", prefault=True)
    seg = Path("/dev/shm") / node.ready["shm_name"]
    assert seg.stat().st_blocks * 512 >= 8 << 20  # prefaulted: every page is backed
    assert seg.exists()
    assert node.stop() == 0, node.stderr()
    assert not seg.exists()


def test_ssd_tier_demote_promote_and_readopt_after_restart(tmp_path):
    ssd = tmp_path / "ssd"
    extra = ("--ssd-path", str(ssd), "--ssd-capacity", "32MiB")
    node = start_node(tmp_path, None, "8MiB", "tcp,shm", *extra)
    try:
        blobs = [os.urandom(n) for n in (3 << 20, 2 << 20, 1000)]
        metas = put_all(node, "tcp", blobs)
        ch, s = stub(node)
        with ch:
            keys = [m.key for m in metas]
            assert s.Demote(node_pb2.KeysRequest(keys=keys), timeout=10).done == 3
            info = s.Info(node_pb2.NodeInfoRequest(), timeout=5)
            assert info.dram_used_bytes == 0 and info.ssd_used_bytes == sum(len(b) for b in blobs)
            assert {m.tier for m in s.Inventory(node_pb2.InventoryRequest(), timeout=5)} == {common_pb2.SSD}
            assert get_one(node, "tcp", metas[0]) == blobs[0]  # a read promotes when DRAM has room
            info = s.Info(node_pb2.NodeInfoRequest(), timeout=5)
            assert info.dram_used_bytes >= len(blobs[0]) and info.ssd_used_bytes == len(blobs[1]) + 1000
            assert s.Promote(node_pb2.KeysRequest(keys=[keys[2]]), timeout=5).done == 1
            assert s.Demote(node_pb2.KeysRequest(keys=keys), timeout=10).done == 3
    finally:
        assert node.stop() == 0, node.stderr()
    assert len(list(ssd.glob("*.bin"))) == 3
    node = start_node(tmp_path, None, "8MiB", "tcp,shm", *extra)  # restart: the SSD tier is adopted
    try:
        ch, s = stub(node)
        with ch:
            inv = list(s.Inventory(node_pb2.InventoryRequest(), timeout=5))
            assert {m.key for m in inv} == {m.key for m in metas} and {m.tier for m in inv} == {
                common_pb2.SSD
            }
        assert get_one(node, "shm", metas[1]) == blobs[1]  # LOCATE promotes for the shm path
        assert get_one(node, "tcp", metas[2]) == blobs[2]
        assert get_one(node, "tcp", metas[0]) == blobs[0]
    finally:
        node.stop()


def _cli(*args: str, module: str = "kvpool.kvstore.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)


def test_cli_store_group():
    out = _cli("store", "node", "--help", module="kvpool")  # the real `kvpool` entry point
    assert out.returncode == 0 and "--capacity" in out.stdout and "--ssd-path" in out.stdout
    bad = _cli("node", "--no-master", "--capacity", "lots")  # the store-only entry (no torch import)
    assert bad.returncode == 2 and "not a size" in bad.stderr
    assert _cli("master", "--help").returncode == 0
