"""Oracle: transformers' `KimiLinearForCausalLM` (random tiny configs, written with `save_pretrained`) loaded
by our weights.py must give the same logits (fp32, 1e-4 max-abs over a 1.5k-token prompt) and the same greedy
continuation. Also the other direction: a checkpoint we write loads in transformers with the same logits."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is not None:  # reference overview §7.6: transformers would pick Triton
    pytest.skip(
        "triton is installed: transformers would route KDA to Triton kernels on CPU", allow_module_level=True
    )
transformers = pytest.importorskip("transformers")

from kvpool.model.loader import load_model  # noqa: E402
from kvpool.model.weights import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_deterministic")

BASE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    mlp_layer_types=["dense"] * 4,
    linear_num_heads=4,
    linear_head_dim=32,
    linear_conv_kernel_dim=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(
    BASE,
    hidden_size=128,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_local_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_group=2,
    topk_group=1,
    q_lora_rank=48,
    num_hidden_layers=4,
)


def _hf_model(kw: dict, seed: int):
    torch.manual_seed(seed)
    m = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**kw)).eval()
    with torch.no_grad():  # make the router bias matter (init leaves it at zero)
        for layer in m.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return m


@pytest.mark.parametrize("kw,T", [(BASE, 1500), (MOE, 700)], ids=["dense", "moe-qlora"])
def test_logits_and_greedy_match_transformers(kw, T, tmp_path):
    hf = _hf_model(kw, seed=0)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(3, kw["vocab_size"], (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = ours.prefill(ids[0], logits="all").logits
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

    prompt = ids[:, :200]
    with torch.no_grad():
        ref_gen = hf.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, 200:
        ].tolist()
    assert ours.generate(prompt[0].tolist(), 16, eos_ids=()) == ref_gen


def test_checkpoint_we_write_loads_in_transformers(tmp_path):
    ours = load_model("tiny")
    save_checkpoint(ours, tmp_path, max_shard_bytes=4 << 20)  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    hf = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 1024, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = ours.prefill(ids[0], logits="all").logits
    assert (got - ref).abs().max().item() < 1e-4
    again = load_model(tmp_path)  # and back: same bytes, same fingerprint
    assert again.fingerprint() == ours.fingerprint()
