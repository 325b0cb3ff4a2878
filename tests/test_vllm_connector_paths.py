"""The vLLM connector's worker paths without vLLM, against a real store (master + node processes): the
background saver and the in-place loader move paged KV blocks bit for bit, a bad object fails exactly its
blocks and every later one, a full save queue drops and counts, and shutdown keeps its deadline while the
store is silent. (The connector itself, inside real vLLM engines, is tested in ``tests/vllm_connector``.)"""

from __future__ import annotations

import os
import signal
import threading
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
    assert not dst.tensors["l0"][0][0][18].any()  # checked before it is copied: the bad object wrote nothing
    assert stats.load_errors == 3


def test_a_short_object_is_a_miss_that_writes_nothing(store) -> None:
    master, _ = store
    src, dst, stats = paged("random"), paged("zeros"), ConnectorStats()
    transfers = chain(3, tag=11)
    with StoreClient(master.address, "shm", deadline_s=5) as client:
        saver = Saver(client, src, FP, GROUPS, stats, max_bytes=64 << 20)
        saver.submit(transfers[:1])
        assert saver.close(5.0)
        whole = client.get(transfers[0].key)
        short = whole[: len(whole) - 4096]  # a mapped object that ends early (header intact)
        assert client.put(transfers[1].key, short, kind=common_pb2.MLA_BLOCK, parent=transfers[0].key)
        assert client.put(transfers[2].key, whole, kind=common_pb2.MLA_BLOCK, parent=transfers[1].key)
        assert load_into(client, dst, transfers, stats) == {17, 18}  # the short one and the one after it
    assert torch.equal(dst.tensors["l1"][0][0][16], src.tensors["l1"][0][0][0])
    assert not dst.tensors["l0"][0][0][17].any() and not dst.tensors["l1"][0][0][17].any()  # nothing of it


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits (NaN payloads compare equal, as the bytes they are)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Any bit pattern, NaNs and infinities included: a copy must move bits, never values."""
    t = torch.empty(shape, dtype=dtype)
    _bits(t).copy_(torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int64).to(_bits(t).dtype))
    return t


@pytest.mark.parametrize("layout", ["cpu", "flash", "state"])
@pytest.mark.parametrize(("ids", "skip"), [((5, 6, 7, 8), 0), ((9, 3, 4, 12), 0), ((2, 3, 10, 11), 1)])
def test_one_copy_per_object_equals_the_per_layer_copy_bit_for_bit(layout, ids, skip) -> None:
    """An object saved from blocks 0-3 of one engine lands in blocks ``ids`` of another (leaving the first
    ``skip`` alone) exactly as a copy block by block, layer by layer would put it: CPU layout [blocks, ...],
    flash layout [2, blocks, ...], and state layers with tensors of different shapes and dtypes."""
    n = 16

    def kv_of() -> dict[str, list[torch.Tensor]]:
        if layout == "cpu":
            return {f"l{i}": [_random_bits((n, 2, 16, 8), torch.float32)] for i in range(3)}
        if layout == "flash":
            return {f"l{i}": [_random_bits((2, n, 16, 2, 8), torch.bfloat16)] for i in range(3)}
        return {
            "m0": [_random_bits((n, 3, 5), torch.float32), _random_bits((n, 7), torch.bfloat16)],
            "m1": [_random_bits((n, 4), torch.float64), _random_bits((n, 2, 2), torch.uint8)],
        }

    source, loaded = PagedKV(kv_of(), n), PagedKV(kv_of(), n)
    names = [list(source.tensors)]
    payload = b"".join(_bits(t).numpy().tobytes() for t in source.gather(names, [(0, 1, 2, 3)]))
    expected = {name: [t.clone() for t, _ in ts] for name, ts in loaded.tensors.items()}
    for name, ts in source.tensors.items():  # the reference: per layer, per tensor, per block
        for (s, d), e in zip(ts, expected[name], strict=True):
            for j in range(skip, len(ids)):
                e.select(d, ids[j]).copy_(s.select(d, j))
    with (
        torch.inference_mode()
    ):  # where vLLM calls start_load_kv; the copy runs outside it, on another thread
        target = loaded.target(names, [ids], [skip])
    target.write(memoryview(payload))
    for name, ts in loaded.tensors.items():
        for (t, _), e in zip(ts, expected[name], strict=True):
            assert torch.equal(_bits(t), _bits(e))


def test_an_idle_step_waits_for_a_load_in_flight_but_no_longer_than_its_bound() -> None:
    from concurrent.futures import Future

    loader = Loader(None, paged("zeros"), FP, GROUPS, ConnectorStats())  # type: ignore[arg-type]
    t0 = time.monotonic()
    loader.wait_any(5.0)  # nothing in flight: no wait
    assert time.monotonic() - t0 < 0.5
    pending: Future[list[Exception | None]] = Future()
    loader.in_flight["r"] = (planmod.LoadPlan("r", (), 0), pending, 0.0)
    t0 = time.monotonic()
    loader.wait_any(0.05)
    assert 0.04 < time.monotonic() - t0 < 1.0 and loader.done() == []
    threading.Timer(0.05, pending.set_result, ([],)).start()
    loader.wait_any(5.0)  # returns as soon as the load finishes
    assert loader.done() == ["r"]


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
