"""KvpoolConnector behind real vLLM engine processes over a real kvpool store (master + storage node).

One store and one tiny random Llama for the module; engines are separate processes, as in production:
A (``kv_both``) computes and saves, a fresh B (``kv_both``) must get its prompts' prefixes from kvpool and
answer exactly as an engine without any connector. The failure cases run on B, in the order that keeps
the store usable until the last one kills it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc

from tests.vllm_connector.conftest import PROMPTS
from tests.vllm_connector.engines import Engine, kvpool_spec, prompts_of

pytestmark = pytest.mark.slow
CHUNK = 64


def usable_tokens(prompt: list[int]) -> int:
    """What a hit can cover: full chunks before the last prompt token."""
    return (len(prompt) - 1) // CHUNK * CHUNK


def mla_keys(node) -> set[bytes]:
    with grpc.insecure_channel(node.grpc_target) as ch:
        stub = node_pb2_grpc.StorageNodeStub(ch)
        return {
            m.key
            for m in stub.Inventory(node_pb2.InventoryRequest(), timeout=10)
            if m.kind == common_pb2.MLA_BLOCK
        }


@pytest.fixture(scope="module")
def engines(model_dir: Path, vllm_dir: Path, store, request: pytest.FixtureRequest):
    """A and B boot together with the baseline engine (each boot is seconds of CPU); B runs nothing before
    A has saved, so it is still an engine that never saw these prompts. A stays up for the silent-store
    case: it is the writer with a small save queue and a short shutdown deadline."""
    request.getfixturevalue("pd_example")  # the example's two runs boot alongside these engines
    closing = request.getfixturevalue("closing")  # A's and B's exits are awaited at the session's end
    master, _ = store
    a_extra = {"deadline_s": 1.0, "save_queue_mb": 1, "shutdown_deadline_s": 2.0}
    a = Engine(kvpool_spec(model_dir, master.address, "kv_both", **a_extra), vllm_dir / "engine-a.log")
    b = Engine(kvpool_spec(model_dir, master.address, "kv_both", deadline_s=2.0), vllm_dir / "engine-b.log")
    try:
        baseline = request.getfixturevalue("baseline")
        first = a.run(PROMPTS, salt="tenant-1")
        assert [o["tokens"] for o in first["outputs"]] == baseline["prompts"]  # saving never changes answers
        assert all(o["cached"] == 0 for o in first["outputs"])  # a cold store
        saved_by = time.monotonic() + 10.0  # A's saves land in the background: B starts once they have
        while len(mla_keys(store[1])) < sum(len(p) // CHUNK for p in PROMPTS):
            assert time.monotonic() < saved_by, "writer A's saves did not land"
            time.sleep(0.05)
        b.wait_ready()
        yield a, b
    finally:
        for e in (a, b):
            e.request_exit()
        closing.extend((a, b))


@pytest.fixture(scope="module")
def engine_b(engines):
    return engines[1]


def test_a_fresh_engine_gets_the_prefix_from_kvpool_and_answers_identically(engine_b, baseline) -> None:
    out = engine_b.run(PROMPTS, salt="tenant-1")["outputs"]
    assert [o["cached"] for o in out] == [usable_tokens(p) for p in PROMPTS]
    assert [o["tokens"] for o in out] == baseline["prompts"]


def test_two_cache_salts_never_share_a_block(engine_b, baseline) -> None:
    other = engine_b.run(PROMPTS, salt="tenant-2")["outputs"]
    assert [o["cached"] for o in other] == [0] * len(PROMPTS)
    assert [o["tokens"] for o in other] == baseline["prompts"]
    unsalted = engine_b.run(PROMPTS[:1])["outputs"]
    assert unsalted[0]["cached"] == 0


def test_a_corrupted_object_is_recomputed_not_served(engine_b, store) -> None:
    """Objects 1-2 of 5 load, object 3 is corrupt: vLLM keeps the first two and recomputes exactly the
    blocks of objects 3-5 (the chain is only usable up to the first bad object)."""
    master, node = store
    prompt = prompts_of([330], seed=3)
    before = mla_keys(node)
    cold = engine_b.run(prompt, salt="tenant-3")["outputs"][0]
    saved_by = time.monotonic() + 10.0  # saves land in the background: await them
    while len(new := mla_keys(node) - before) < len(prompt[0]) // CHUNK:  # one object per full chunk
        assert time.monotonic() < saved_by, f"{len(new)} chunk objects saved"
        time.sleep(0.05)
    with StoreClient(master.address, "tcp", deadline_s=10) as c:
        while not all(c.batch_exists(sorted(new))):  # the node holds them: the master commits them next
            assert time.monotonic() < saved_by, "the master did not commit the saved chunks"
            time.sleep(0.05)
        second, third = chunk_key(c, new, 1), chunk_key(c, new, 2)
        data = bytearray(c.get(third))  # same key, same size, one bit flipped in the payload: only kvpool's
        data[-1] ^= 0x01  # codec can tell, in the same pass that scatters it
        c.remove([third])
        gone_by = time.monotonic() + 10.0  # the node deletes after the master has forgotten: await both
        while third in mla_keys(node):
            assert time.monotonic() < gone_by, "the node kept a removed object"
            time.sleep(0.05)
        assert c.put(third, bytes(data), kind=common_pb2.MLA_BLOCK, parent=second)
    again = engine_b.run(prompt, salt="tenant-3")["outputs"][0]
    assert again["tokens"] == cold["tokens"]
    # vLLM's num_cached_tokens keeps what was scheduled; the connector's log says what happened instead
    log = engine_b.log_path.read_text()
    assert "object 3 of 5 not loaded (payload checksum mismatch); vLLM recomputes 3 blocks" in log


def chunk_key(client: StoreClient, keys: set[bytes], k: int) -> bytes:
    """The key of chunk k among one prompt's chunk objects: the one with exactly k ancestors among them."""
    parents = {key: client.lookup([key]).found[0].meta.parent for key in keys}
    for key in keys:
        depth, p = 0, parents[key]
        while p in parents:
            depth, p = depth + 1, parents[p]
        if depth == k:
            return key
    raise AssertionError(f"no chunk {k} among {len(keys)} objects")


def test_a_silent_store_never_stalls_a_step_and_shutdown_keeps_its_deadline(engines, store) -> None:
    """Master and node stop answering (SIGSTOP): writer A's lookups fail within their deadline (1 s), its
    saves are copied out and queued, the 1 MiB queue overflows and drops them (counted, logged), and no
    step waits for the store. Then A shuts down with saves still queued: it is gone within its 2 s
    shutdown deadline plus vLLM's own teardown."""
    a, _ = engines
    master, node = store
    big = prompts_of([1000, 1000, 1000], seed=5)  # 45 chunk objects, ~3 MiB: more than the queue holds
    for p in (master, node):
        os.kill(p.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = a.run(big, salt="silent", deadline_s=120)["outputs"]
        elapsed = time.monotonic() - t0
        assert [o["cached"] for o in out] == [0, 0, 0]
        assert elapsed < 30, elapsed  # three 1 s lookups at most and the compute; never a save's wait
        assert "objects dropped" in a.log_path.read_text()
        a.run(prompts_of([200], seed=6), salt="silent-2", deadline_s=60)  # one more save queued
        a.request_exit()
        t0 = time.monotonic()
        a.proc.wait(timeout=60)
        assert time.monotonic() - t0 < 25, "shutdown waited for the silent store past its deadline"
    finally:
        for p in (master, node):
            os.kill(p.pid, signal.SIGCONT)


def test_a_node_gone_after_the_lookup_costs_only_recompute(engine_b, store, baseline) -> None:
    """The node dies with its memory (SIGKILL, segment removed) while the master still lists it: lookups
    still offer the prefix, every load fails at the node, vLLM recomputes, the answers stay exact."""
    _, node = store
    shm = node.endpoint.shm_name
    node.kill()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{shm.lstrip('/')}")
    failed_before = engine_b.log_path.read_text().count("not loaded")
    out = engine_b.run(PROMPTS, salt="tenant-1", deadline_s=60)["outputs"]
    assert [o["tokens"] for o in out] == baseline["prompts"]
    assert engine_b.log_path.read_text().count("not loaded") > failed_before


def test_a_dead_store_costs_a_deadline_not_an_answer(engine_b, store, baseline) -> None:
    master, node = store
    if node.alive():
        node.kill()
    master.kill()
    t0 = time.monotonic()
    out = engine_b.run(PROMPTS, salt="tenant-1", deadline_s=60)["outputs"]
    elapsed = time.monotonic() - t0
    assert [o["tokens"] for o in out] == baseline["prompts"]
    assert [o["cached"] for o in out] == [0] * len(PROMPTS)
    assert elapsed < 30, elapsed  # lookups fail fast; each store call is bounded by deadline_s = 2
