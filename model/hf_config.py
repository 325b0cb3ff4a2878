"""A Hugging Face Kimi-Linear ``config.json`` read into a `ModelConfig`, and written back.

Field names follow ``transformers`` 5.24 ``KimiLinearConfig`` and the original Moonshot checkpoint config
(``linear_attn_config`` with 1-based ``full_attn_layers``/``kda_layers``, ``num_experts``,
``num_experts_per_token``, ...). Both spellings are accepted; precedence mirrors transformers so that the same
file means the same model to us and to the oracle. Anything we would have to guess about (RoPE MLA,
non-sigmoid routers, quantised weights, ...) raises `UnsupportedConfigError` instead of running a
different model. ``canonical_json`` is the architecture's bytes the model fingerprint hashes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import DENSE, KDA, MLA, SPARSE, ModelConfig
from .errors import ConfigError, UnsupportedConfigError

# transformers attribute_map: alias used in checkpoints -> our field
_ALIASES = {
    "num_experts": "num_experts",
    "num_local_experts": "num_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_experts_per_tok": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "n_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "n_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "norm_topk_prob": "norm_topk_prob",
}

# keys read into fields; anything else a checkpoint carries is kept in ``ModelConfig.extra``
_KNOWN_KEYS = frozenset(_ALIASES) | {
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "layer_types",
    "mlp_layer_types",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
    "intermediate_size",
    "moe_intermediate_size",
    "topk_group",
    "routed_scaling_factor",
    "linear_attn_config",
    "linear_num_heads",
    "linear_head_dim",
    "linear_conv_kernel_dim",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "attention_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "moe_router_activation_func",
    "num_nextn_predict_layers",
    "pretraining_tp",
    "torch_dtype",
    "first_k_dense_replace",
    "moe_layer_freq",
    "mla_use_nope",
    "model_type",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "index_cache_dtype",
}
# RoPE only matters to the DSA indexer: a dense (NoPE) model keeps these keys in ``extra``
_DSA_KEYS = frozenset({"rope_theta", "rope_scaling", "rope_parameters", "indexer_types"})


def _refuse_unsupported(d: dict[str, Any]) -> bool:
    """Raise on what we would have to guess about; return whether the config has a DSA indexer."""
    model_type = d.get("model_type")
    if model_type not in (None, "kimi_linear"):
        raise UnsupportedConfigError(f"model_type {model_type!r}: only 'kimi_linear' is supported")
    if d.get("quantization_config"):
        raise UnsupportedConfigError("quantized checkpoints (quantization_config) are not supported")
    if d.get("mla_use_nope", True) is False:
        raise UnsupportedConfigError("mla_use_nope=false (RoPE MLA) is not implemented; Kimi MLA is NoPE")
    if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise UnsupportedConfigError(
            f"moe_router_activation_func {d['moe_router_activation_func']!r}: only 'sigmoid' is implemented"
        )
    if int(d.get("num_nextn_predict_layers", 0) or 0) > 0:
        raise UnsupportedConfigError(
            "multi-token-prediction layers (num_nextn_predict_layers>0) are not supported"
        )
    if int(d.get("pretraining_tp", 1) or 1) != 1:
        raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
    dsa = d.get("index_n_heads") is not None or d.get("index_topk") is not None
    if dsa:
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UnsupportedConfigError(
                f"DSA indexer with rope scaling {rope!r}: only default RoPE is implemented"
            )
        if d.get("indexer_types") not in (None, []) and set(d["indexer_types"]) != {"full"}:
            raise UnsupportedConfigError(
                "indexer_types other than 'full' (layers sharing another layer's top-k) are not supported"
            )
    return dsa


def _layer_types_from_lac(lac: dict[str, Any], n_layers: int) -> list[str]:
    """The original checkpoint's 1-based ``full_attn_layers`` / ``kda_layers`` lists, else transformers'
    default pattern (MLA at every 4th layer from layer 4)."""
    if "full_attn_layers" not in lac or "kda_layers" not in lac:
        return [MLA if i and i % 4 == 0 else KDA for i in range(n_layers)]
    lt: list[str | None] = [None] * n_layers
    for name, key in ((MLA, "full_attn_layers"), (KDA, "kda_layers")):
        for one_based in lac[key]:
            if not isinstance(one_based, int) or not 1 <= one_based <= n_layers:
                raise ConfigError(
                    f"linear_attn_config.{key}: {one_based!r} not in 1..{n_layers} (these lists are 1-based)"
                )
            lt[one_based - 1] = name
    if None in lt:
        raise ConfigError(
            f"layers {[i + 1 for i, t in enumerate(lt) if t is None]} (1-based) are in "
            "neither full_attn_layers nor kda_layers"
        )
    return [t for t in lt if t is not None]


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Parse a Kimi-Linear ``config.json`` dict (transformers-written or original Moonshot spelling)."""
    if not isinstance(d, dict):
        raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
    dsa = _refuse_unsupported(d)

    try:
        n_layers = int(d.get("num_hidden_layers", 27))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"num_hidden_layers: {exc}") from None
    lac = d.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError("linear_attn_config must be an object")
    if lac.get("num_v_heads") not in (None, lac.get("num_heads", d.get("linear_num_heads"))):
        raise UnsupportedConfigError("KDA with num_v_heads != num_heads (GVA) is not supported")
    if lac.get("use_full_rank_gate"):
        raise UnsupportedConfigError("KDA use_full_rank_gate is not supported")

    layer_types = d.get("layer_types")
    if layer_types is None:
        layer_types = _layer_types_from_lac(lac, n_layers)

    moe = {_ALIASES[k]: v for k, v in d.items() if k in _ALIASES}
    num_experts = int(moe.get("num_experts", 256) or 0)
    mlp_layer_types = d.get("mlp_layer_types")
    if mlp_layer_types is None:
        first_dense = int(d.get("first_k_dense_replace", 1) or 0)
        freq = int(d.get("moe_layer_freq", 1) or 1)
        mlp_layer_types = [
            SPARSE if num_experts > 0 and i >= first_dense and i % freq == 0 else DENSE
            for i in range(n_layers)
        ]

    eos = d.get("eos_token_id", 163586)
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
    known = _KNOWN_KEYS | (_DSA_KEYS if dsa else frozenset())
    try:
        return ModelConfig(
            vocab_size=int(d.get("vocab_size", 163840)),
            hidden_size=int(d.get("hidden_size", 2304)),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_layer_types),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=d.get("hidden_act", "silu"),
            intermediate_size=int(d.get("intermediate_size", 9216)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 1024)),
            num_experts=num_experts,
            num_experts_per_tok=int(moe.get("num_experts_per_tok", 8) or 0),
            n_shared_experts=int(moe.get("n_shared_experts", 1) or 0),
            n_group=int(moe.get("n_group", 1) or 1),
            topk_group=int(d.get("topk_group", 1) or 1),
            norm_topk_prob=bool(moe.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 2.446)),
            kda_num_heads=int(lac.get("num_heads", d.get("linear_num_heads", 32))),
            kda_head_dim=int(lac.get("head_dim", d.get("linear_head_dim", 128))),
            kda_conv_kernel=int(lac.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4))),
            kda_gate_lower_bound=lac.get("gate_lower_bound"),
            kda_allow_neg_eigval=bool(lac.get("allow_neg_eigval", False)),
            num_attention_heads=int(d.get("num_attention_heads", 32)),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=int(d.get("kv_lora_rank", 512)),
            qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
            qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
            v_head_dim=int(d.get("v_head_dim", 128)),
            attention_bias=bool(d.get("attention_bias", False)),
            index_n_heads=int(d.get("index_n_heads") or 64) if dsa else 0,
            index_head_dim=int(d.get("index_head_dim") or 128),
            index_topk=int(d.get("index_topk") or 2048),
            index_cache_dtype=str(d.get("index_cache_dtype") or "bfloat16"),
            rope_theta=float(
                d.get("rope_theta")
                or ((d.get("rope_parameters") or {}).get("rope_theta") if dsa else None)
                or 10000.0
            ),
            bos_token_id=d.get("bos_token_id", 163584),
            eos_token_id=eos_ids,
            pad_token_id=d.get("pad_token_id", 163839),
            torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            extra={k: v for k, v in d.items() if k not in known},
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"malformed config.json: {exc}") from None


def read_config_json(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {p}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: invalid JSON: {exc}") from None
    return config_from_hf(data)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` both transformers' ``KimiLinearConfig`` and the original remote code can read.

    The layer pattern is written twice (``layer_types`` and the 1-based ``linear_attn_config`` lists);
    they agree by construction. Unknown keys read from a checkpoint (``extra``) are not written back.
    """
    eos: int | list[int] | None
    eos = (
        None
        if not cfg.eos_token_id
        else (cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else list(cfg.eos_token_id))
    )
    lac: dict[str, Any] = {
        "num_heads": cfg.kda_num_heads,
        "head_dim": cfg.kda_head_dim,
        "short_conv_kernel_size": cfg.kda_conv_kernel,
        "full_attn_layers": [i + 1 for i in cfg.mla_layers],
        "kda_layers": [i + 1 for i in cfg.kda_layers],
    }
    if cfg.kda_gate_lower_bound is not None:
        lac["gate_lower_bound"] = cfg.kda_gate_lower_bound
    if cfg.kda_allow_neg_eigval:
        lac["allow_neg_eigval"] = True
    out = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(cfg.layer_types),
        "mlp_layer_types": list(cfg.mlp_layer_types),
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_tok,
        "num_shared_experts": cfg.n_shared_experts,
        "num_expert_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "moe_renormalize": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "linear_num_heads": cfg.kda_num_heads,
        "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.kda_conv_kernel,
        "linear_attn_config": lac,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "attention_bias": cfg.attention_bias,
        "mla_use_nope": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.torch_dtype,
    }
    if cfg.dsa:  # written only for DSA models: a dense model's config (and fingerprint) is unchanged
        out.update(
            index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim,
            index_topk=cfg.index_topk,
            index_cache_dtype=cfg.index_cache_dtype,
            rope_theta=cfg.rope_theta,
        )
    return out


def canonical_json(cfg: ModelConfig) -> bytes:
    """Deterministic bytes of the architecture (for the fingerprint): sorted keys, no whitespace."""
    d = config_to_hf(cfg)
    d.pop("dtype")  # the weights' bytes carry the dtype; a cast config is not a new architecture
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
