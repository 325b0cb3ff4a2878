"""Bulk adoption (a node's inventory in one RegisterNode): the index it builds equals the put path's, it is
sized once, and the memory the load freed goes back to the OS (kvstore/master/core.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import random
import subprocess
import sys

import pytest
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.master.core import (
    BULK_ADOPTION_OBJECTS,
    TRIM_SWEEPS_AFTER_BULK,
    MasterConfig,
    MasterCore,
)
from kvpool.proto import common_pb2, master_pb2

from tests.harness.clock import Clock

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
CHAIN = 40
CKPT_EVERY = 8


def inventory(objects: int) -> list[common_pb2.ObjectMeta]:
    """Chains of MLA blocks (parent links) with a checkpoint every few blocks, varied sizes, checksums,
    tenants and tiers, in chain order: what a node holding complete prefixes reports."""
    metas: list[common_pb2.ObjectMeta] = []
    i = 0
    while len(metas) < objects:
        parent = b""
        for depth in range(CHAIN):
            h = hashlib.sha256(i.to_bytes(8, "little")).digest()
            i += 1
            tenant = f"t{i % 3}" if i % 5 else ""
            tier = common_pb2.SSD if i % 7 == 0 else common_pb2.DRAM
            key = mla_key(h)
            metas.append(
                common_pb2.ObjectMeta(
                    key=key, kind=common_pb2.MLA_BLOCK, size=1000 + i % 17, checksum=i * 7919,
                    tenant=tenant, parent=parent, tier=tier,
                )
            )  # fmt: skip
            parent = key
            if (depth + 1) % CKPT_EVERY == 0:
                metas.append(
                    common_pb2.ObjectMeta(
                        key=kda_key(h), kind=common_pb2.KDA_CHECKPOINT, size=32_000, checksum=i,
                        tenant=tenant, tier=tier,
                    )
                )  # fmt: skip
    return metas[:objects]


def new_core(clock: Clock) -> MasterCore:
    return MasterCore(MasterConfig(node_timeout_ms=3_600_000, heartbeat_ms=1000), clock=clock)


def register(core: MasterCore, node_id: str, metas: list[common_pb2.ObjectMeta]) -> int:
    reply = core.register_node(
        master_pb2.RegisterNodeRequest(
            node=common_pb2.NodeEndpoint(node_id=node_id, host="127.0.0.1", grpc_port=9),
            dram_capacity_bytes=1 << 40,
            ssd_capacity_bytes=1 << 40,
            inventory=metas,
        )
    )
    return reply.adopted_objects


def put_all(core: MasterCore, metas: list[common_pb2.ObjectMeta]) -> None:
    for meta in metas:
        reply = core.put_start(master_pb2.PutStartRequest(meta=meta))
        assert reply.status == master_pb2.PutStartReply.STARTED
        core.put_commit(master_pb2.PutCommitRequest(put_id=reply.put_id))


def state(core: MasterCore, metas: list[common_pb2.ObjectMeta], with_depth: bool = True) -> dict:
    """Everything the index holds per key, independent of where it keeps it."""
    out = {}
    for meta in metas:
        info = core.index.get(meta.key)
        assert info is not None
        out[meta.key] = info if with_depth else dataclasses.replace(info, depth=0)
    return out


def chains_of(metas: list[common_pb2.ObjectMeta]) -> list[list[bytes]]:
    hashes = [m.key[1:] for m in metas if m.kind == common_pb2.MLA_BLOCK]
    return [hashes[i : i + CHAIN] for i in range(0, len(hashes), CHAIN)]


def test_bulk_adoption_builds_the_same_index_as_puts() -> None:
    metas = inventory(BULK_ADOPTION_OBJECTS + 500)
    clock = Clock(100.0)
    adopted, written = new_core(clock), new_core(clock)
    assert register(adopted, "n0", metas) == len(metas)
    register(written, "n0", [])
    put_all(written, metas)
    assert state(adopted, metas) == state(written, metas)
    for chain in chains_of(metas):
        assert adopted.index.match_prefix(chain) == written.index.match_prefix(chain)
    a, w = adopted.index.stats(), written.index.stats()
    assert (a.objects, a.bytes, a.bytes_per_tier, a.bytes_per_tenant) == (
        w.objects, w.bytes, w.bytes_per_tier, w.bytes_per_tenant,
    )  # fmt: skip


def test_shuffled_inventory_links_the_same_dependencies() -> None:
    """Inventories come in any order: children before parents are orphans until the parent arrives."""
    metas = inventory(BULK_ADOPTION_OBJECTS + 100)
    shuffled = metas[:]
    random.Random(7).shuffle(shuffled)
    clock = Clock(100.0)
    adopted, written = new_core(clock), new_core(clock)
    assert register(adopted, "n0", shuffled) == len(metas)
    register(written, "n0", [])
    put_all(written, metas)
    # depth is 0 ("unknown") for a block adopted before its parent; everything else must agree
    assert state(adopted, metas, with_depth=False) == state(written, metas, with_depth=False)
    assert adopted.index.stats().orphans == 0
    for chain in chains_of(metas):
        assert adopted.index.match_prefix(chain) == written.index.match_prefix(chain)


def test_bulk_adoption_sizes_the_index_once_and_puts_grow_it_after() -> None:
    metas = inventory(BULK_ADOPTION_OBJECTS * 2)
    core = new_core(Clock(100.0))
    assert register(core, "n0", metas) == len(metas)
    idx = core.index
    assert idx.allocated_slots == len(metas)  # no growth slack
    extra = inventory(len(metas) + 10)[len(metas) :]
    put_all(core, extra)  # past the reserved room: one-by-one growth again
    assert idx.allocated_slots > len(metas) + 10
    assert all(idx.get(m.key) is not None for m in metas + extra)
    # the node restarts with the same inventory: the emptied index starts afresh, sized for it alone
    assert register(core, "n0", metas) == len(metas)
    assert idx.allocated_slots == len(metas) and len(idx) == len(metas)
    assert state(core, metas) == state(core, metas)  # every key readable at its slot


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_sweeps_after_a_bulk_adoption_trim_the_heap_and_small_ones_do_not() -> None:
    core = new_core(Clock(100.0))
    register(core, "small", inventory(10))
    for _ in range(TRIM_SWEEPS_AFTER_BULK + 2):
        core.sweep()
    assert core.counters.get("heap_trims", 0) == 0
    register(core, "big", inventory(BULK_ADOPTION_OBJECTS))
    assert core.counters.get("heap_trims", 0) == 0  # not while the request is alive
    for _ in range(TRIM_SWEEPS_AFTER_BULK + 2):
        core.sweep()
    assert core.counters["heap_trims"] == TRIM_SWEEPS_AFTER_BULK


# A fresh process frees 32 MB of 2 MB blocks (after one 8 MB block was freed, which makes glibc serve
# such blocks from the heap); prints RSS with the blocks held, after free, after release_free_heap.
_HEAP_SCRIPT = r"""
import ctypes, sys
from kvpool.kvstore.master.process_heap import fix_mmap_threshold, release_free_heap

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

if sys.argv[1] == "fixed":
    assert fix_mmap_threshold(1 << 20)
big = libc.malloc(8 << 20)
ctypes.memset(big, 1, 8 << 20)
libc.free(big)
blocks = [libc.malloc(2 << 20) for _ in range(17)]  # the 17th stays: the freed ones are not the heap top
for b in blocks:
    ctypes.memset(b, 1, 2 << 20)
held = rss()
for b in blocks[:16]:
    libc.free(b)
freed = rss()
assert release_free_heap()
print(held, freed, rss())
"""


def _heap_run(mode: str) -> tuple[int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_SCRIPT, mode], capture_output=True, text=True, timeout=60, check=True
    )
    held, freed, trimmed = (int(x) for x in out.stdout.split())
    return held, freed, trimmed


@pytest.mark.skipif(not GLIBC, reason="mallopt/malloc_trim are glibc's")
def test_freed_heap_stays_resident_until_trimmed() -> None:
    held, freed, trimmed = _heap_run("dynamic")
    assert held - freed < 8 << 20  # glibc kept the freed blocks' pages
    assert freed - trimmed > 24 << 20  # release_free_heap gave them back


@pytest.mark.skipif(not GLIBC, reason="mallopt/malloc_trim are glibc's")
def test_fixed_mmap_threshold_returns_big_blocks_on_free() -> None:
    held, freed, _ = _heap_run("fixed")
    assert held - freed > 24 << 20
