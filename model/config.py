"""`ModelConfig`: the hybrid KDA + MLA architecture, read from / written to a Hugging Face Kimi-Linear
``config.json``.

Field names follow ``transformers`` 5.24 ``KimiLinearConfig`` and the original Moonshot checkpoint config
(``linear_attn_config`` with 1-based ``full_attn_layers``/``kda_layers``, ``num_experts``,
``num_experts_per_token``, ...). Both spellings are accepted; precedence mirrors transformers so that the same
file means the same model to us and to the oracle. Anything we would have to guess about (RoPE MLA,
non-sigmoid routers, quantised weights, ...) raises `UnsupportedConfigError` instead of running a
different model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, UnsupportedConfigError

KDA = "linear_attention"
MLA = "full_attention"
DENSE = "dense"
SPARSE = "sparse"
KDA_CHUNK = 64  # the KDA chunk and the canonical prefill segment length (overview §7.3 rule 1)

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


@dataclass
class ModelConfig:
    """Plain description of a Kimi-Linear-style hybrid. Layer ids are 0-based everywhere in kvpool."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_hidden_layers: int = 4
    layer_types: tuple[str, ...] = (KDA, KDA, KDA, MLA)
    mlp_layer_types: tuple[str, ...] = (DENSE,) * 4
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # dense MLP / MoE
    intermediate_size: int = 512
    moe_intermediate_size: int = 1024
    num_experts: int = 0
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.446
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 32
    kda_conv_kernel: int = 4
    kda_gate_lower_bound: float | None = None  # K3-style "safe gate"; None = Kimi-Linear softplus gate
    kda_allow_neg_eigval: bool = False
    # MLA (NoPE)
    num_attention_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    attention_bias: bool = False
    # DSA lightning indexer on every MLA layer (DeepSeek-V3.2 / K3.1); index_n_heads == 0 means dense MLA
    index_n_heads: int = 0
    index_head_dim: int = 128
    index_topk: int = 2048
    index_cache_dtype: str = "bfloat16"  # how indexer keys are cached: bfloat16 | float8_e4m3fn | float32
    rope_theta: float = 10000.0  # only the indexer rotates (Kimi MLA is NoPE)
    # tokens
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)
    pad_token_id: int | None = 0
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.layer_types = tuple(self.layer_types)
        self.mlp_layer_types = tuple(self.mlp_layer_types)
        self.eos_token_id = tuple(self.eos_token_id)
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLA)

    @property
    def kda_dim(self) -> int:
        """Width of each of the q, k, v projections of a KDA layer (H * head_dim)."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def conv_dim(self) -> int:
        """Width of the pre-conv rows carried in the conv state: q, k and v concatenated."""
        return 3 * self.kda_dim

    @property
    def latent_dim(self) -> int:
        """One cached MLA row: ``[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def dsa(self) -> bool:
        """True when every MLA layer carries a DSA lightning indexer (sparse attention over top-k latents)."""
        return self.index_n_heads > 0

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Reject impossible or unsupported configs with a message naming the field."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "kda_num_heads",
            "kda_head_dim",
            "kda_conv_kernel",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "intermediate_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 0:
            raise ConfigError(
                f"qk_rope_head_dim must be a non-negative integer, got {self.qk_rope_head_dim!r}"
            )
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ConfigError(f"q_lora_rank must be null or a positive integer, got {self.q_lora_rank!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {self.num_hidden_layers} layers"
            )
        for i, t in enumerate(self.layer_types):
            if t not in (KDA, MLA):
                raise UnsupportedConfigError(f"layer {i}: attention type {t!r} (supported: {KDA!r}, {MLA!r})")
        for i, t in enumerate(self.mlp_layer_types):
            if t not in (DENSE, SPARSE):
                raise UnsupportedConfigError(f"layer {i}: mlp type {t!r} (supported: {DENSE!r}, {SPARSE!r})")
        if SPARSE in self.mlp_layer_types:
            if self.num_experts <= 0:
                raise ConfigError("mlp_layer_types has 'sparse' layers but num_experts is 0")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} not in [1, {self.num_experts}]"
                )
            if self.n_group <= 0 or self.num_experts % self.n_group:
                raise ConfigError(f"num_experts={self.num_experts} not divisible by n_group={self.n_group}")
            if not 0 < self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group={self.topk_group} not in [1, n_group={self.n_group}]")
            if self.num_experts // self.n_group < 2:
                raise UnsupportedConfigError("grouped routing needs at least 2 experts per group")
        if self.index_n_heads:
            self._validate_dsa()
        if self.hidden_act != "silu":
            raise UnsupportedConfigError(f"hidden_act {self.hidden_act!r}: only 'silu' is implemented")
        if self.kda_gate_lower_bound is not None and not (
            isinstance(self.kda_gate_lower_bound, (int, float)) and self.kda_gate_lower_bound < 0
        ):
            raise ConfigError(
                f"gate_lower_bound must be a negative number, got {self.kda_gate_lower_bound!r}"
            )
        if not (
            isinstance(self.rms_norm_eps, (int, float))
            and math.isfinite(self.rms_norm_eps)
            and self.rms_norm_eps > 0
        ):
            raise ConfigError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        for tok in (self.bos_token_id, self.pad_token_id, *self.eos_token_id):
            if tok is not None and not 0 <= tok < self.vocab_size:
                raise ConfigError(f"special token id {tok} outside vocab [0, {self.vocab_size})")

    def _validate_dsa(self) -> None:
        from kvpool.model.cache_schema import INDEX_KEY_FORMATS

        INDEX_CACHE_DTYPES = tuple(INDEX_KEY_FORMATS)

        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise UnsupportedConfigError(
                f"index_cache_dtype {self.index_cache_dtype!r} (supported: {', '.join(INDEX_CACHE_DTYPES)})"
            )
        r = self.qk_rope_head_dim
        if r % 2 or r > self.index_head_dim:
            raise ConfigError(
                f"the indexer rotates its first qk_rope_head_dim={r} dims: must be even and <= "
                f"index_head_dim={self.index_head_dim}"
            )
        theta = self.rope_theta
        if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
            raise ConfigError(f"rope_theta must be a positive number, got {self.rope_theta!r}")

    # ------------------------------------------------------------------ HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a Kimi-Linear ``config.json`` dict (transformers-written or original Moonshot spelling)."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in (None, "kimi_linear"):
            raise UnsupportedConfigError(f"model_type {model_type!r}: only 'kimi_linear' is supported")
        if d.get("quantization_config"):
            raise UnsupportedConfigError("quantized checkpoints (quantization_config) are not supported")
        if d.get("mla_use_nope", True) is False:
            raise UnsupportedConfigError("mla_use_nope=false (RoPE MLA) is not implemented; Kimi MLA is NoPE")
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise UnsupportedConfigError(
                f"moe_router_activation_func {d['moe_router_activation_func']!r}: "
                "only 'sigmoid' is implemented"
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
            if "full_attn_layers" in lac and "kda_layers" in lac:
                lt: list[str | None] = [None] * n_layers
                for name, key in ((MLA, "full_attn_layers"), (KDA, "kda_layers")):
                    for one_based in lac[key]:
                        if not isinstance(one_based, int) or not 1 <= one_based <= n_layers:
                            raise ConfigError(
                                f"linear_attn_config.{key}: {one_based!r} not in 1..{n_layers} "
                                "(these lists are 1-based)"
                            )
                        lt[one_based - 1] = name
                if None in lt:
                    raise ConfigError(
                        f"layers {[i + 1 for i, t in enumerate(lt) if t is None]} (1-based) are in "
                        "neither full_attn_layers nor kda_layers"
                    )
                layer_types = lt
            else:  # transformers' default pattern
                layer_types = [MLA if i and i % 4 == 0 else KDA for i in range(n_layers)]

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
        known = set(_ALIASES) | {
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
        if dsa:  # RoPE only matters to the indexer; a dense (NoPE) model keeps these keys in `extra`
            known |= {"rope_theta", "rope_scaling", "rope_parameters", "indexer_types"}
        try:
            return cls(
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

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
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
        return cls.from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` both transformers' ``KimiLinearConfig`` and the original remote code can read.

        The layer pattern is written twice (``layer_types`` and the 1-based ``linear_attn_config`` lists);
        they agree by construction. Unknown keys read from a checkpoint (``extra``) are not written back.
        """
        eos: int | list[int] | None
        eos = (
            None
            if not self.eos_token_id
            else (self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id))
        )
        lac: dict[str, Any] = {
            "num_heads": self.kda_num_heads,
            "head_dim": self.kda_head_dim,
            "short_conv_kernel_size": self.kda_conv_kernel,
            "full_attn_layers": [i + 1 for i in self.mla_layers],
            "kda_layers": [i + 1 for i in self.kda_layers],
        }
        if self.kda_gate_lower_bound is not None:
            lac["gate_lower_bound"] = self.kda_gate_lower_bound
        if self.kda_allow_neg_eigval:
            lac["allow_neg_eigval"] = True
        out = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_tok,
            "num_shared_experts": self.n_shared_experts,
            "num_expert_group": self.n_group,
            "topk_group": self.topk_group,
            "moe_renormalize": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "linear_num_heads": self.kda_num_heads,
            "linear_head_dim": self.kda_head_dim,
            "linear_conv_kernel_dim": self.kda_conv_kernel,
            "linear_attn_config": lac,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "attention_bias": self.attention_bias,
            "mla_use_nope": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "dtype": self.torch_dtype,
        }
        if self.dsa:  # written only for DSA models: a dense model's config (and fingerprint) is unchanged
            out.update(
                index_n_heads=self.index_n_heads,
                index_head_dim=self.index_head_dim,
                index_topk=self.index_topk,
                index_cache_dtype=self.index_cache_dtype,
                rope_theta=self.rope_theta,
            )
        return out

    def canonical_json(self) -> bytes:
        """Deterministic bytes of the architecture (for the fingerprint): sorted keys, no whitespace."""
        d = self.to_hf_dict()
        d.pop("dtype")  # the weights' bytes carry the dtype; a cast config is not a new architecture
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d
