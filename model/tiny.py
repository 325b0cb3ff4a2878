"""The embedded default model: a tiny KDA+MLA hybrid built deterministically from a seed (no download),
then, for ``tiny`` itself, given the trained weights shipped in ``model/data/tiny.safetensors``
(``scripts/train_tiny.py``: next-byte prediction on Python standard-library sources), so the default
model answers in text. ``tiny-random`` and the other embedded names keep the seeded random weights.

Shape from reference overview §7.4: vocab 1024, hidden 256, layers [KDA, KDA, KDA, MLA] (MLA at 0-based
``i % 4 == 3``, i.e. K3's 1-based 4, 8, ...), KDA 4 heads x 32, MLA 4 heads (kv_lora 64, rope 16, nope 32,
v 32), dense SwiGLU MLP 512. About 2.7 M parameters.

Initialisation follows transformers/fla so activations stay in the regime real checkpoints live in: linear and
embedding weights N(0, 0.02), norms 1, ``A_log = log U(1, 16)``, ``dt_bias = softplus^-1(dt)`` with
``dt ~ logU(1e-3, 1e-1)`` (moderate per-step decay). Conv taps U(-1/2, 1/2) like PyTorch's default for a
4-tap depthwise conv. Values are drawn in sorted parameter-name order from one CPU generator, so the same seed
gives the same bytes (and fingerprint) on every machine.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from .config import DENSE, KDA, MLA, ModelConfig
from .hybrid import HybridModel

TINY_SEED = 0
TRAINED_WEIGHTS = Path(__file__).resolve().parent / "data" / "tiny.safetensors"


def tiny_config(num_layers: int = 4) -> ModelConfig:
    """The tiny config (``num_layers`` a multiple of 4 keeps the 3:1 KDA:MLA pattern)."""
    return ModelConfig(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=num_layers,
        layer_types=tuple(MLA if i % 4 == 3 else KDA for i in range(num_layers)),
        mlp_layer_types=(DENSE,) * num_layers,
        intermediate_size=512,
        num_experts=0,
        rms_norm_eps=1e-5,
        kda_num_heads=4,
        kda_head_dim=32,
        kda_conv_kernel=4,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        bos_token_id=1,
        eos_token_id=(2,),
        pad_token_id=0,
        torch_dtype="float32",
    )


def tiny_dsa_config(num_layers: int = 4, index_cache_dtype: str = "bfloat16") -> ModelConfig:
    """The tiny config with a DSA indexer on its MLA layers (reference overview §7.4 "DSA variant"): indexer
    4 heads x 32, ``index_topk`` 64 so selection is exercised beyond one segment, and ``q_lora_rank`` 64 so
    the indexer query reads ``c_Q`` as in DeepSeek-V3.2 and K3 (which has q_lora 1536)."""
    base = tiny_config(num_layers)
    return replace(
        base,
        q_lora_rank=64,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
        index_cache_dtype=index_cache_dtype,
    )


@torch.no_grad()
def init_weights(model: HybridModel, seed: int = TINY_SEED, std: float = 0.02) -> HybridModel:
    """Deterministic fla/transformers-like init of every tensor of ``model`` (in place)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        shape = tuple(t.shape)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            v = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif leaf == "dt_bias":
            dt = (
                torch.empty(shape)
                .uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
                .exp()
                .clamp_min(1e-4)
            )
            v = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif leaf == "e_score_correction_bias" or leaf == "bias":
            v = torch.zeros(shape)
        elif "norm" in name:
            v = torch.ones(shape)
        elif "conv1d" in name:
            v = torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)
        else:
            v = torch.empty(shape).normal_(0.0, std, generator=gen)
        t.copy_(v.to(t.dtype))
    model.invalidate_fingerprint()
    return model


def build_tiny(
    seed: int = TINY_SEED,
    device: str | torch.device | None = "cpu",
    dtype: torch.dtype = torch.float32,
    num_layers: int = 4,
    config: ModelConfig | None = None,
) -> HybridModel:
    """The embedded default model (weights made on CPU, then moved, so every device gets the same bytes);
    ``config`` overrides the architecture (e.g. `tiny_dsa_config`)."""
    model = init_weights(HybridModel(config or tiny_config(num_layers), device="cpu"), seed)
    return model.to(device=device if device not in (None, "auto") else _auto(), dtype=dtype)


def _auto() -> torch.device:
    from .hybrid import resolve_device

    return resolve_device("auto")


def build_trained_tiny(
    device: str | torch.device | None = "cpu", dtype: torch.dtype = torch.float32
) -> HybridModel:
    """``tiny`` with its trained weights (same architecture and tokenizer as the seeded one)."""
    from safetensors.torch import load_file

    from .errors import WeightsError

    if not TRAINED_WEIGHTS.is_file():
        raise WeightsError(
            f"the trained tiny weights are missing ({TRAINED_WEIGHTS}); see scripts/train_tiny.py"
        )
    model = HybridModel(tiny_config(4), device="cpu")
    state = load_file(str(TRAINED_WEIGHTS))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise WeightsError(
            f"trained tiny weights do not fit the config: missing {missing}, unexpected {unexpected}"
        )
    model.invalidate_fingerprint()
    return model.to(device=device if device not in (None, "auto") else _auto(), dtype=dtype)
