"""What a model's cache objects must look like: the contract between the model and the cache-unit codec.

The model builds a ``CacheSchema`` from its config (``HybridModel.cache_schema()``); the codec in
``kvpool.cache.units`` checks every header against it, so a block written by another model, another
layout or another dtype is rejected as a miss instead of being silently misread.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_VERSION = 1
# DSA indexer-key storage formats -> bytes of one key of ``dim`` values (fp8: e4m3 codes + one fp32 scale)
INDEX_KEY_FORMATS = {"bfloat16": (2, 0), "float8_e4m3fn": (1, 4), "float32": (4, 0)}


def index_key_record_bytes(dim: int, storage: str) -> int:
    """Bytes of one cached DSA indexer key: ``2d`` bf16, ``d + 4`` fp8 + fp32 scale (132 B at d = 128), ``4d``
    fp32."""
    try:
        per_value, extra = INDEX_KEY_FORMATS[storage]
    except KeyError:
        raise ValueError(f"unknown indexer key storage {storage!r}") from None
    return dim * per_value + extra


@dataclass(frozen=True)
class CacheSchema:
    """Shapes and dtypes of one model's cache units (per request, no batch dimension)."""

    fingerprint: bytes  # 32-byte model fingerprint (config + weights); part of every hash root and header
    mla_layers: tuple[int, ...]  # layer ids of MLA layers, ascending
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim: one row [c_kv | k_pe] per token
    mla_dtype: str  # torch dtype name of latents, e.g. "float32", "bfloat16"
    kda_layers: tuple[int, ...]  # layer ids of KDA layers, ascending
    state_shape: tuple[int, int, int]  # (H, dk, dv) of the recurrent state, fp32, layout HKV
    conv_shape: tuple[int, int]  # (W-1, Dq+Dk+Dv) pre-conv rows carried across a boundary
    conv_dtype: str  # activation dtype of the conv state
    block_size: int  # tokens per hash block (multiple of 64)
    state_layout: str = "HKV"  # axis order of S; fla's V-first layout would be "HVK" and must not be misread
    # DSA: every MLA row is the byte record [latent (mla_dtype) | indexer key (index_dtype)]; 0/"" = dense MLA
    index_dim: int = 0  # index_head_dim d of the lightning indexer's single key head
    index_dtype: str = ""  # key storage: "bfloat16" | "float8_e4m3fn" (+ fp32 scale) | "float32"

    @property
    def dsa(self) -> bool:
        """True when MLA rows carry DSA indexer keys."""
        return self.index_dim > 0

    @property
    def index_key_bytes(self) -> int:
        """Bytes of one token's indexer key in one MLA layer (0 for dense MLA)."""
        return index_key_record_bytes(self.index_dim, self.index_dtype) if self.dsa else 0

    @property
    def latent_bytes(self) -> int:
        """Bytes of one token's latent ``[c_kv | k_pe]`` in one MLA layer."""
        import torch

        return self.latent_dim * torch.empty((), dtype=getattr(torch, self.mla_dtype)).element_size()

    @property
    def mla_row_bytes(self) -> int:
        """Bytes one token costs in one MLA layer: latent + indexer key (K3.1 fp8: 1152 + 132)."""
        return self.latent_bytes + self.index_key_bytes

    @property
    def conv_taps(self) -> int:
        """Pre-conv rows carried across a boundary (W - 1 = 3 for Kimi); a 4-slot layout would say 4."""
        return self.conv_shape[0]

    def mla_block_bytes(self, n_tokens: int | None = None) -> int:
        """Payload bytes of one MLA block (all MLA layers) holding ``n_tokens`` (default: a full block)."""
        n = self.block_size if n_tokens is None else n_tokens
        return n * self.mla_row_bytes * len(self.mla_layers)

    def kda_checkpoint_bytes(self) -> int:
        """Payload bytes of one KDA checkpoint (all KDA layers)."""
        import torch

        h, dk, dv = self.state_shape
        conv_item = torch.empty((), dtype=getattr(torch, self.conv_dtype)).element_size()
        per_layer = h * dk * dv * 4 + self.conv_shape[0] * self.conv_shape[1] * conv_item
        return per_layer * len(self.kda_layers)
