"""The ``k3.1`` model spec: K3 plus 132 B of fp8 DSA indexer key per token per MLA layer, and the simulator's
byte accounting (which pricing reads) really charging them."""

from __future__ import annotations

import pytest
from kvpool.model.cache_schema import CacheSchema
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import bundled_trace, read_mooncake


def test_k31_spec_matches_the_codec_row():
    k3, k31 = get_spec("k3"), get_spec("k3.1")
    assert k31.mla_bytes_per_token == 24 * (1152 + 132) == 30_816
    assert k31.kda_bytes_per_checkpoint == k3.kda_bytes_per_checkpoint
    schema = CacheSchema(
        fingerprint=bytes(32),
        mla_layers=tuple(range(24)),
        latent_dim=576,
        mla_dtype="bfloat16",
        kda_layers=tuple(range(24, 93)),
        state_shape=(96, 128, 128),
        conv_shape=(3, 3 * 96 * 128),
        conv_dtype="bfloat16",
        block_size=512,
        index_dim=128,
        index_dtype="float8_e4m3fn",
    )
    assert schema.mla_block_bytes() == k31.mla_block_bytes(512)
    assert schema.kda_checkpoint_bytes() == k31.kda_bytes_per_checkpoint
    assert k31.breakeven_tokens == pytest.approx(14_582.4, abs=0.1)  # K3: 16,253


def test_simulator_charges_indexer_bytes():
    reqs = read_mooncake(bundled_trace("synthetic"))[:300]
    held = {
        name: simulate(reqs, SimConfig(spec=get_spec(name, pure_mla=True))).bytes_held
        for name in ("k3", "k3.1")
    }
    assert held["k3"] > 0 and held["k3.1"] * 1152 == held["k3"] * 1284
    cap = held["k3"] // 4  # same memory: the bigger rows fit fewer blocks, so K3.1 hits no more than K3
    rates = {
        name: simulate(reqs, SimConfig(spec=get_spec(name, pure_mla=True), capacity=cap)).to_dict()[
            "block_hit_rate"
        ]
        for name in ("k3", "k3.1")
    }
    assert rates["k3.1"] <= rates["k3"]
