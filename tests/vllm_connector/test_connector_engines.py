"""KvpoolConnector behind real vLLM engine processes over a real kvpool store (master + storage node).

One store and one tiny random Llama for the module; engines are separate processes, as in production:
A (``kv_both``) computes and saves, a fresh B (``kv_both``) must get its prompts' prefixes from kvpool and
answer exactly as an engine without any connector. The failure cases run on B, in the order that keeps
the store usable until the last one kills it.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc

from tests.vllm_connector.conftest import PROMPTS
from tests.vllm_connector.engines import Engine, close_all, kvpool_spec, prompts_of

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
def engine_b(model_dir: Path, vllm_dir: Path, store, request: pytest.FixtureRequest):
    """A and B boot together with the baseline engine (each boot is seconds of CPU); B runs nothing before
    A has saved, so it is still an engine that never saw these prompts."""
    master, _ = store
    a = Engine(kvpool_spec(model_dir, master.address, "kv_both"), vllm_dir / "engine-a.log")
    b = Engine(kvpool_spec(model_dir, master.address, "kv_both", deadline_s=2.0), vllm_dir / "engine-b.log")
    try:
        baseline = request.getfixturevalue("baseline")
        first = a.run(PROMPTS, salt="tenant-1")
        a.request_exit()  # A's part is done; it shuts down while B works
        assert [o["tokens"] for o in first["outputs"]] == baseline["prompts"]  # saving never changes answers
        assert all(o["cached"] == 0 for o in first["outputs"])  # a cold store
        b.wait_ready()
        yield b
    finally:
        close_all(a, b)


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
    master, node = store
    prompt = prompts_of([330], seed=3)
    before = mla_keys(node)
    cold = engine_b.run(prompt, salt="tenant-3")["outputs"][0]
    new = sorted(mla_keys(node) - before)
    assert len(new) == len(prompt[0]) // CHUNK  # one object per full chunk
    with StoreClient(master.address, "tcp", deadline_s=10) as c:
        flipped = {}
        for key in new:  # same key, same size, one bit flipped in the payload: only kvpool's codec can tell
            data = bytearray(c.get(key))
            data[-1] ^= 0x01
            flipped[key] = bytes(data)
        c.remove(new)
        gone_by = time.monotonic() + 10.0  # the node deletes after the master has forgotten: await both
        while set(new) & mla_keys(node):
            assert time.monotonic() < gone_by, "the node kept removed objects"
            time.sleep(0.05)
        for key, data in flipped.items():
            assert c.put(key, data, kind=common_pb2.MLA_BLOCK)
    again = engine_b.run(prompt, salt="tenant-3")["outputs"][0]
    assert again["tokens"] == cold["tokens"]
    # vLLM's num_cached_tokens keeps what was scheduled; the connector's log says what happened instead
    log = engine_b.log_path.read_text()
    assert "object 1 of 5 not loaded (payload checksum mismatch); vLLM recomputes 5 blocks" in log


def test_a_dead_store_costs_a_deadline_not_an_answer(engine_b, store, baseline) -> None:
    master, node = store
    node.kill()
    master.kill()
    t0 = time.monotonic()
    out = engine_b.run(PROMPTS, salt="tenant-1", deadline_s=60)["outputs"]
    elapsed = time.monotonic() - t0
    assert [o["tokens"] for o in out] == baseline["prompts"]
    assert [o["cached"] for o in out] == [0] * len(PROMPTS)
    assert elapsed < 30, elapsed  # lookups fail fast; each store call is bounded by deadline_s = 2
