"""`ModelConfig`: the hybrid KDA + MLA architecture as plain fields, its derived widths, and the checks
that refuse an impossible or unsupported one with a message naming the field.

Reading and writing a Hugging Face Kimi-Linear ``config.json`` is ``hf_config``'s job.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError, UnsupportedConfigError

KDA = "linear_attention"
MLA = "full_attention"
DENSE = "dense"
SPARSE = "sparse"
KDA_CHUNK = 64  # the KDA chunk and the canonical prefill segment length (overview §7.3 rule 1)


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

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d
