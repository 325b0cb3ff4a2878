"""DSA (lightning indexer + top-k sparse MLA) on the tiny hybrid: bit-exact resume and decode on the canonical
schedule with prompts longer than ``index_topk`` (so selection is exercised), deterministic tie-breaking, the
config switch, checkpoint I/O, and the loader names.

Oracle comparisons against transformers' DeepseekV32 live in test_model_dsa_oracle.py."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
from kvpool.model.decode_state import DecodeState
from kvpool.model.dsa import dequantize_keys, quantize_keys, select_topk
from kvpool.model.errors import BadStartStateError, ConfigError, UnsupportedConfigError
from kvpool.model.hf_config import config_from_hf, config_to_hf
from kvpool.model.loader import load_model, tiny_model_config
from kvpool.model.tiny import build_tiny, tiny_config, tiny_dsa_config

pytestmark = pytest.mark.usefixtures("torch_deterministic")

L = 192  # 3 segments; index_topk = 64, so every query past the first segment attends to 64 of up to 192 keys


@pytest.fixture(scope="module", params=["float8_e4m3fn", "bfloat16"])
def model(request):
    return build_tiny(config=tiny_dsa_config(index_cache_dtype=request.param))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


def test_selection_is_exercised(model):
    """Same weights with index_topk >= context is dense MLA: identical while the context fits in 64 tokens,
    different once the indexer has to choose (else every other DSA test would pass for a dense model)."""
    ids = _ids(L, 3)
    sparse = model.prefill(ids, logits="all").logits
    dense_model = build_tiny(config=replace(model.config, index_topk=10**6))
    dense = dense_model.prefill(ids, logits="all").logits
    assert torch.equal(sparse[:64], dense[:64])
    assert (sparse[64:] - dense[64:]).abs().max() > 1e-3


def test_resume_is_bitwise(model):
    ids = _ids(L, 0)
    splits = (64, 128)
    full = model.prefill(ids, boundaries=splits, logits="all")
    for p in splits:
        rest = model.prefill(ids[p:], start=_roundtrip(full.prefix(p)), logits="all")
        assert torch.equal(rest.logits, full.logits[p:]), f"logits differ after resume at {p}"
        for i in full.mla:
            assert torch.equal(rest.mla[i], full.mla[i]), f"latent+indexer rows differ (layer {i}, split {p})"
        for i, st in full.final.layers.items():
            assert torch.equal(rest.final.layers[i].recurrent, st.recurrent)


def test_decode_after_resume_is_bitwise_and_canonical(model):
    """Decode from a resumed prefix == decode from the uncut prefill, bit for bit, across a segment end; the
    rows decode leaves at that segment end equal a prefill of prompt + output (canonical decode)."""
    ids = _ids(L - 6, 1)  # 186: the tail segment is partial, decode crosses 192
    full = model.prefill(ids)
    a = DecodeState.from_prefill(full)
    part = model.prefill(ids[:128])
    rest = model.prefill(ids[128:], start=_roundtrip(part.prefix(128)))
    b = DecodeState.from_prefill(rest)
    tok_a = tok_b = int(torch.argmax(full.logits))
    out = [tok_a]
    for _ in range(8):
        la, a = model.decode_step(tok_a, a)
        lb, b = model.decode_step(tok_b, b)
        assert torch.equal(la, lb)
        tok_a = tok_b = int(torch.argmax(la))
        out.append(tok_a)
    for i in model.config.mla_layers:
        assert torch.equal(a.latents(i), b.latents(i))
    conv = model.prefill(ids + out[:6])  # positions [0, 192): what the decode node pushes at 192
    for i in model.config.mla_layers:
        assert torch.equal(a.latents(i)[:L], conv.mla[i])


def test_decode_close_to_prefill(model):
    """A decode step's logits vs a prefill of the same tokens: not bitwise (M=1 vs M=64 GEMMs), but close,
    with the same argmax, once selection is active (a position past index_topk)."""
    ids = _ids(150, 2)
    st = DecodeState.from_prefill(model.prefill(ids[:149]))
    logits, _ = model.decode_step(ids[149], st)
    ref = model.prefill(ids).logits
    assert (logits - ref).abs().max() < 1e-4 and int(logits.argmax()) == int(ref.argmax())


def test_select_topk_ties_score_desc_then_index_asc():
    s = torch.tensor([[0.5, 1.0, 0.5, 1.0, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    idx, valid = select_topk(s, 4)
    assert idx.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]] and valid.all()
    causal = torch.tensor([[2.0, float("-inf"), float("-inf")], [1.0, 1.0, float("-inf")]])
    idx, valid = select_topk(causal, 2)
    assert idx.tolist() == [[0, 1], [0, 1]] and valid.tolist() == [[True, False], [True, True]]
    # the rule against a brute-force sort on random ties (many exact zeros, as ReLU produces)
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 4, (32, 50), generator=g).float()
    idx, _ = select_topk(s, 7)
    for t in range(32):
        want = sorted(sorted(range(50), key=lambda j: (-s[t, j].item(), j))[:7])
        assert idx[t].tolist() == want


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn", "float32"])
def test_key_storage_roundtrip(storage):
    k = torch.randn(20, 32, generator=torch.Generator().manual_seed(0)) * 3
    k[3] = 0.0
    rec = quantize_keys(k, storage)
    back = dequantize_keys(rec, 32, storage)
    # dequantisation is exact (fp8: power-of-two scale), so stored values survive another quantisation
    assert torch.equal(dequantize_keys(quantize_keys(back, storage), 32, storage), back)
    tol = {"bfloat16": 1e-2, "float8_e4m3fn": 7e-2, "float32": 0}[storage]
    assert ((back - k).abs() <= tol * k.abs().amax(-1, keepdim=True)).all()
    assert rec.shape == (20, {"bfloat16": 64, "float8_e4m3fn": 36, "float32": 128}[storage])


def test_dense_rows_are_refused_by_a_dsa_model_and_vice_versa():
    dsa, dense = load_model("tiny-dsa"), load_model("tiny")
    ids = _ids(128, 4)
    with pytest.raises(BadStartStateError):
        dsa.prefill(ids[64:], start=dense.prefill(ids[:64]).prefix())
    with pytest.raises(BadStartStateError):
        dense.prefill(ids[64:], start=dsa.prefill(ids[:64]).prefix())


def test_config_switch_hf_roundtrip_and_errors():
    c = tiny_dsa_config()
    d = config_to_hf(c)
    assert (d["index_n_heads"], d["index_head_dim"], d["index_topk"]) == (4, 32, 64)
    assert config_from_hf(d) == c
    assert "index_topk" not in config_to_hf(tiny_config())  # dense config JSON (and fingerprint) unchanged
    v32 = dict(config_to_hf(tiny_config()), index_n_heads=8, index_head_dim=64, index_topk=16, q_lora_rank=32)
    v32["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e4}
    got = config_from_hf(v32)
    assert got.dsa and got.index_cache_dtype == "bfloat16" and got.rope_theta == 5e4
    with pytest.raises(UnsupportedConfigError):
        config_from_hf(dict(v32, rope_scaling={"type": "yarn", "factor": 40}))
    with pytest.raises(UnsupportedConfigError):
        replace(c, index_cache_dtype="float16")
    with pytest.raises(ConfigError):
        replace(c, index_topk=0)


def test_loader_names_and_checkpoint_roundtrip(tmp_path):
    from kvpool.model.weights import save_checkpoint

    m = load_model("tiny-dsa")
    assert tiny_model_config("tiny-dsa") == m.config and tiny_model_config("nope") is None
    fp8 = load_model("tiny-dsa-fp8")
    assert fp8.config.index_cache_dtype == "float8_e4m3fn"
    assert load_model("tiny").fingerprint() != m.fingerprint() != fp8.fingerprint()
    names = {n for n in m.state_dict() if ".indexer." in n}
    assert names == {
        f"model.layers.3.self_attn.indexer.{n}"
        for n in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
    }
    save_checkpoint(m, tmp_path)
    again = load_model(tmp_path)
    assert again.config == m.config and again.fingerprint() == m.fingerprint()


def test_without_q_lora_the_indexer_reads_the_layer_input():
    """Kimi-Linear-48B style (q_lora_rank null): wq_b maps hidden -> n_heads * d, and resume stays bitwise."""
    m = build_tiny(config=replace(tiny_dsa_config(), q_lora_rank=None))
    assert m.model.layers[3].self_attn.indexer.wq_b.in_features == 256
    ids = _ids(160, 6)
    full = m.prefill(ids, boundaries=(128,), logits="all")
    rest = m.prefill(ids[128:], start=full.prefix(128), logits="all")
    assert torch.equal(rest.logits, full.logits[128:]) and torch.equal(rest.mla[3], full.mla[3])


def test_bf16_model_resume_is_bitwise():
    m = load_model("tiny-dsa-fp8", dtype=torch.bfloat16)
    ids = _ids(192, 5)
    full = m.prefill(ids, boundaries=(128,), logits="all")
    rest = m.prefill(ids[128:], start=full.prefix(128), logits="all")
    assert torch.equal(rest.logits, full.logits[128:])
    assert m.cache_schema().mla_row_bytes == 80 * 2 + 32 + 4
