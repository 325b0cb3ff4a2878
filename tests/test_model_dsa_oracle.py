"""Oracle: our DSA MLA layer vs transformers 5.24 ``DeepseekV32Attention`` (lightning indexer + MLA) on the
same weights (parameter names match, so ``load_state_dict`` is strict).

Kimi MLA is NoPE while DeepSeek's MLA rotates ``q_pe``/``k_pe`` (interleaved RoPE); the indexer's half RoPE is
the same in both. The oracle's MLA RoPE is therefore switched off (identity), which is exactly Kimi's MLA
with DeepSeek's indexer. Our layer runs on the canonical 64-token segments over its own cache, so the
indexer keys the oracle computes in one pass are compared with keys we cached segment by segment at their
absolute positions.

* ``index_topk >= context``: outputs agree to 1e-5 (dense attention).
* ``index_topk < context``: top-k is discontinuous, so (overview §7.3 rule 5) selections are compared only
  where our k-th and (k+1)-th index scores differ by a real margin; ReLU makes exact-zero ties common, and
  there transformers' ``topk`` order is unspecified while ours is (score desc, index asc). Where the selected
  sets agree, outputs agree to 1e-5.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

if importlib.util.find_spec("triton") is not None:  # reference overview §7.6
    pytest.skip("triton is installed: transformers would route kernels to Triton", allow_module_level=True)
transformers = pytest.importorskip("transformers")
mv = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")

from kvpool.model.dsa import select_topk  # noqa: E402
from kvpool.model.mla import MLALayer  # noqa: E402
from kvpool.model.tiny import tiny_dsa_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_deterministic")

T, TOPK = 256, 64


@pytest.fixture(scope="module")
def oracle():
    cfg = transformers.DeepseekV32Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=TOPK,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    attn = mv.DeepseekV32Attention(cfg, 0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
        attn.indexer.k_norm.weight.uniform_(0.5, 1.5)
        attn.indexer.k_norm.bias.normal_(0.0, 0.1)
    x = torch.randn(1, T, 256, generator=torch.Generator().manual_seed(1))
    cos, sin = mv.DeepseekV32RotaryEmbedding(cfg)(x, torch.arange(T)[None])
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    return attn, x, (cos, sin), mask


def _nope(monkeypatch) -> None:
    """Kimi MLA: no RoPE on q_pe / k_pe (the indexer keeps its own half RoPE)."""
    monkeypatch.setattr(mv, "apply_rotary_pos_emb_interleave", lambda q, k, cos, sin, *a, **kw: (q, k))


def _ours(attn, topk: int) -> MLALayer:
    layer = MLALayer(replace(tiny_dsa_config(), index_topk=topk, index_cache_dtype="float32"))
    layer.load_state_dict(attn.state_dict(), strict=True)
    return layer.eval()


@torch.no_grad()
def _run_segments(layer: MLALayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    past = torch.empty(0, layer.row_format().row_bytes, dtype=torch.uint8)
    outs = []
    for s in range(0, x.shape[0], 64):
        y, new = layer(x[s : s + 64], past)
        past = torch.cat([past, new])
        outs.append(y)
    return torch.cat(outs), past


@torch.no_grad()
def _oracle_out(attn, x, pe, mask, topk: int) -> torch.Tensor:
    attn.indexer.index_topk = topk
    return attn(x, pe, mask)[0][0]


def test_dense_when_topk_covers_context(oracle, monkeypatch):
    attn, x, pe, mask = oracle
    _nope(monkeypatch)
    ref = _oracle_out(attn, x, pe, mask, T)
    got, _ = _run_segments(_ours(attn, T), x[0])
    assert (got - ref).abs().max().item() < 1e-5


@torch.no_grad()
def test_selection_equal_where_margin_allows(oracle, monkeypatch):
    attn, x, pe, mask = oracle
    _nope(monkeypatch)
    ours = _ours(attn, TOPK)
    got, cache = _run_segments(ours, x[0])
    ref = _oracle_out(attn, x, pe, mask, TOPK)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    theirs = attn.indexer(x, q_resid, pe, mask[:, 0], None)[0].long()  # [T, topk]
    # our index scores against the keys we cached segment by segment
    pos = torch.arange(T)
    q, w = ours.indexer.queries(q_resid[0], x[0], pos)
    scores = ours.indexer.scores(q, w, ours.row_format().keys(cache), 0)
    mine, _ = select_topk(scores, TOPK)
    ranked = scores.sort(dim=-1, descending=True).values
    margin = ranked[:, TOPK - 1] - ranked[:, TOPK]
    checked = same = 0
    for t in range(TOPK, T):  # rows with more causal keys than TOPK: a real choice
        agree = set(mine[t].tolist()) == set(theirs[t].tolist())
        if margin[t] > 1e-5 * ranked[t, 0].abs():
            checked += 1
            assert agree, f"query {t}: selections differ with margin {margin[t].item():.2e}"
        if agree:
            same += 1
            assert (got[t] - ref[t]).abs().max().item() < 1e-5, f"query {t}: output differs"
    assert checked >= 0.8 * (T - TOPK), f"margin guard left only {checked} rows"
    assert (got[:TOPK] - ref[:TOPK]).abs().max().item() < 1e-5
    # the test can fail: the sparse outputs really differ from dense attention
    assert (got[TOPK:] - _oracle_out(attn, x, pe, mask, T)[TOPK:]).abs().max().item() > 1e-4
    assert same >= checked


@torch.no_grad()
def test_sparse_path_with_everything_selected_equals_dense(oracle):
    """The gather path (per-query selected latents) is the dense formula when every key is selected: with
    ``index_topk`` one short of a 128-row segment, each query but the last takes the gather path with all
    of its causal keys selected, and must answer what the dense path (``index_topk`` = 128) answers."""
    attn, x, _, _ = oracle
    empty = torch.empty(0, _ours(attn, 128).row_format().row_bytes, dtype=torch.uint8)
    dense, dense_rows = _ours(attn, 128)(x[0, :128], empty)
    gathered, rows = _ours(attn, 127)(x[0, :128], empty)
    assert torch.equal(rows, dense_rows)
    assert (gathered[:127] - dense[:127]).abs().max().item() < 1e-6
    assert (gathered[127] - dense[127]).abs().max().item() > 1e-6  # the last query did drop a key


@torch.no_grad()
def test_decode_steps_match_oracle_rows(oracle, monkeypatch):
    """Single-token steps (the decode path: T = 1, gather over its own top-k) for the last 16 positions,
    against the oracle's rows wherever the selected sets agree (margin guard as above)."""
    attn, x, pe, mask = oracle
    _nope(monkeypatch)
    ours = _ours(attn, TOPK)
    ref = _oracle_out(attn, x, pe, mask, TOPK)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    theirs = attn.indexer(x, q_resid, pe, mask[:, 0], None)[0].long()
    _, past = _run_segments(ours, x[0, : T - 16])
    compared = 0
    for t in range(T - 16, T):
        y, new = ours(x[0, t : t + 1], past)
        past = torch.cat([past, new])
        q, w = ours.indexer.queries(q_resid[0, t : t + 1], x[0, t : t + 1], torch.tensor([t]))
        mine, _ = select_topk(ours.indexer.scores(q, w, ours.row_format().keys(past), t), TOPK)
        if set(mine[0].tolist()) == set(theirs[t].tolist()):
            compared += 1
            assert (y[0] - ref[t]).abs().max().item() < 1e-5, f"decode step at {t} differs"
    assert compared >= 12


def test_whole_model_matches_deepseek_v32_when_topk_covers_context(monkeypatch):
    """A pure-MLA HybridModel with the indexer vs ``DeepseekV32ForCausalLM`` (MLA RoPE off) on the same
    weights: prefill logits over the canonical segments, then greedy decode through the DSA byte-record
    cache (the indexer keys are computed, stored and carried; with index_topk >= context it selects all)."""
    from kvpool.model.config import DENSE, MLA
    from kvpool.model.hybrid import HybridModel

    _nope(monkeypatch)
    n = 200
    hf_cfg = transformers.DeepseekV32Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=4096,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(3)
    hf = transformers.DeepseekV32ForCausalLM(hf_cfg).eval()
    cfg = replace(
        tiny_dsa_config(),
        num_hidden_layers=2,
        layer_types=(MLA, MLA),
        mlp_layer_types=(DENSE, DENSE),
        rms_norm_eps=hf_cfg.rms_norm_eps,
        index_topk=4096,
        index_cache_dtype="float32",
    )
    ours = HybridModel(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.randint(3, 1024, (1, n), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        gen = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, n:]
    got = ours.prefill(ids[0], logits="all").logits
    assert (got - ref).abs().max().item() < 1e-4
    assert ours.generate(ids[0].tolist(), 8, eos_ids=()) == gen.tolist()
