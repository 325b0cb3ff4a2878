"""The vLLM connector's worker paths without vLLM, against a real store (master + node processes): the
background saver and the in-place loader move paged KV blocks bit for bit, a bad object fails exactly its
blocks and every later one, a full save queue drops and counts, and shutdown keeps its deadline while the
store is silent. (The connector itself, inside real vLLM engines, is tested in ``tests/vllm_connector``.)"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from kvpool.integrations.vllm import plan as planmod
from kvpool.integrations.vllm.chunks import GroupLayout
from kvpool.integrations.vllm.loader import Loader
from kvpool.integrations.vllm.metrics import ConnectorStats
from kvpool.integrations.vllm.paged import PagedKV
from kvpool.integrations.vllm.saver import Saver
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.keys import mla_key
from kvpool.proto import common_pb2

from tests.harness.store_procs import start_master, start_node

FP = b"f" * 32
GROUPS = [GroupLayout(("l0", "l1"), 64, True, "spec")]
BLOCKS = 32


def paged(fill: str) -> PagedKV:
    make = torch.randn if fill == "random" else torch.zeros
    return PagedKV({name: make(BLOCKS, 2, 64, 32) for name in GROUPS[0].layer_names}, BLOCKS)


def chain(n: int, tag: int) -> list[planmod.Transfer]:
    """n chunk objects, chunk k in block k."""
    hashes = [bytes([tag, k]) * 16 for k in range(n)]
    return [
        planmod.Transfer(
            mla_key(h), common_pb2.MLA_BLOCK, mla_key(hashes[k - 1]) if k else b"", k, (0,), ((k,),)
        )
        for k, h in enumerate(hashes)
    ]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("connector-paths")
    master = start_master(d)
    node = start_node(d, master.address, "64MiB", "tcp,shm", prefault=False)
    yield master, node
    for p in (node, master):
        if p.alive():
            p.stop()


def load_into(client: StoreClient, dst: PagedKV, transfers: list[planmod.Transfer], stats: ConnectorStats):
    """Locate the chain with one match_prefix, then load it to blocks 16+k; the blocks left to recompute."""
    located = client.match_prefix([t.key[1:] for t in transfers], require_checkpoint=False)
    plan = planmod.LoadPlan(
        "r",
        tuple(
            planmod.Transfer(
                t.key,
                t.kind,
                b"",
                t.chunk_index,
                (0,),
                ((16 + t.chunk_index,),),
                location=loc.SerializeToString(),
            )
            for t, loc in zip(transfers, located.mla, strict=False)
        ),
        0,
    )
    loader = Loader(client, dst, FP, GROUPS, stats)
    loader.start(plan)
    return loader.finish("r")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_saves_and_in_place_loads_move_blocks_bit_for_bit(store, transport) -> None:
    master, _ = store
    src, dst, stats = paged("random"), paged("zeros"), ConnectorStats()
    transfers = chain(6, tag=ord(transport[0]))
    with StoreClient(master.address, transport, deadline_s=5) as client:
        saver = Saver(client, src, FP, GROUPS, stats, max_bytes=64 << 20)
        for i in range(3):  # three steps, two objects each: the later ones reuse the first ones' copies
            saver.submit(transfers[2 * i : 2 * i + 2])
        assert saver.close(5.0) and stats.saved_objects == 6 and stats.saves_dropped == 0
        assert load_into(client, dst, transfers, stats) == set()
    for name in GROUPS[0].layer_names:
        assert torch.equal(dst.tensors[name][0][0][16:22], src.tensors[name][0][0][0:6])
    assert stats.loaded_objects == 6


def test_a_bad_object_fails_its_blocks_and_every_later_one(store) -> None:
    master, _ = store
    src, dst, stats = paged("random"), paged("zeros"), ConnectorStats()
    transfers = chain(5, tag=7)
    with StoreClient(master.address, "shm", deadline_s=5) as client:
        saver = Saver(client, src, FP, GROUPS, stats, max_bytes=64 << 20)
        saver.submit(transfers[:2] + transfers[3:])
        assert saver.close(5.0)
        bad = bytearray(client.get(transfers[1].key))  # one bit of object 2's payload, under object 3's key
        bad[-1] ^= 1
        assert client.put(transfers[2].key, bytes(bad), kind=common_pb2.MLA_BLOCK, parent=transfers[1].key)
        assert load_into(client, dst, transfers, stats) == {18, 19, 20}  # objects 3-5: blocks 16+2..16+4
    assert torch.equal(dst.tensors["l0"][0][0][17], src.tensors["l0"][0][0][1])  # objects 1-2 stay loaded
    assert stats.load_errors == 3


def test_a_full_queue_drops_and_a_silent_store_costs_shutdown_only_its_deadline(store) -> None:
    master, node = store
    src, stats = paged("random"), ConnectorStats()
    transfers = chain(8, tag=9)
    with StoreClient(master.address, "tcp", deadline_s=1.0) as client:
        one_object = sum(p.nbytes for p in src.parts([GROUPS[0].layer_names], [(0,)]))
        saver = Saver(client, src, FP, GROUPS, stats, max_bytes=3 * one_object)
        for p in (master, node):
            os.kill(p.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            for tr in transfers:  # the sender is stuck on the first put: the queue fills, later steps drop
                saver.submit([tr])
            assert time.monotonic() - t0 < 0.5  # a step never waits for the store
            assert stats.saves_dropped >= len(transfers) - 3
            t0 = time.monotonic()
            assert not saver.close(0.5)  # gives up on what is left
            assert time.monotonic() - t0 < 1.0
        finally:
            for p in (master, node):
                os.kill(p.pid, signal.SIGCONT)
