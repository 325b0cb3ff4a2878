"""DSA (DeepSeek Sparse Attention) on MLA layers: the lightning indexer, its cached keys, top-k selection.

Per query token t and past token s <= t (reference overview §7.2, transformers ``DeepseekV32Indexer``)::

    q^I_{t,j} = RoPE_half(W_IQ,j c_Q,t)              wq_b: q_lora_rank -> n_heads * d
    k^I_s     = RoPE_half(LayerNorm(W_IK h_s))       wk: hidden -> d, ONE key head, cached per token
    w_{t,j}   = (W_w h_t)_j * n_heads^-1/2           weights_proj: hidden -> n_heads
    I_{t,s}   = sum_j w_{t,j} * ReLU(d^-1/2 * q^I_{t,j} . k^I_s)
    S_t       = top-k_s I_{t,s}  (causal; ties: score descending, then index ascending)

and the MLA layer attends only over the latents ``s in S_t``. ``RoPE_half`` is the non-interleaved
(rotate-half) rotation of the first ``qk_rope_head_dim`` dims at the token's **absolute** position; Kimi MLA
itself is NoPE, so these are the only position-dependent values in the cache. Without ``q_lora_rank`` (Kimi
Linear 48B style) there is no ``c_Q``; the indexer query then reads the layer input ``h`` (what ``q_proj``
reads), so ``wq_b`` is ``hidden -> n_heads * d`` (documented choice, docs/design/dsa.md).

Cache layout. A DSA layer's cache row per token is one byte record ``[latent | indexer key]``:
``latent_dim`` values in the model dtype, then the key in the configured storage format:

* ``bfloat16``: ``d`` bf16 values (256 B for d = 128);
* ``float8_e4m3fn``: ``d`` e4m3 codes + one fp32 scale (132 B for d = 128, DeepSeek/vLLM's layout). The scale
  is a power of two (``ue8m0``-style, ``2^ceil(log2(amax / 448))``), so ``code * scale`` is exact in fp32;
* ``float32``: ``d`` fp32 values (exact; for oracle tests).

Keys are quantised the moment they are computed, and every score (this segment's own queries included)
reads the *dequantised stored* key: a resumed run scores against bytes fetched from the store and the
uninterrupted run against bytes it just wrote, and those are the same bytes, so selection is bit-identical.
Records are row-sliceable and concatenable like the plain latent rows, which is why every cache path
(``PrefixState.mla``, ``DecodeState``, cache units) carries them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvpool.model.cache_schema import INDEX_KEY_FORMATS, index_key_record_bytes
from torch import nn

from .config import ModelConfig

INDEX_CACHE_DTYPES = tuple(INDEX_KEY_FORMATS)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-4  # an all-zero key gets scale 2^-22 instead of 0 (DeepSeek clamps amax the same way)


def _typed(rows: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[start, stop)`` of every row reinterpreted as ``dtype`` (a fresh contiguous tensor)."""
    return rows[:, start:stop].contiguous().view(dtype)


@dataclass(frozen=True)
class IndexKeyFormat:
    """Byte layout of one cached row of a DSA layer: ``latent_dim`` model-dtype values, then the key."""

    latent_dim: int
    latent_dtype: torch.dtype
    dim: int  # index_head_dim
    storage: str  # one of INDEX_CACHE_DTYPES

    @property
    def latent_bytes(self) -> int:
        return self.latent_dim * self.latent_dtype.itemsize

    @property
    def key_bytes(self) -> int:
        """Bytes of one stored key: 2d (bf16), d + 4 (fp8 codes + fp32 scale) or 4d (fp32)."""
        return index_key_record_bytes(self.dim, self.storage)

    @property
    def row_bytes(self) -> int:
        return self.latent_bytes + self.key_bytes

    def pack(self, latents: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Latents ``[T, latent_dim]`` (model dtype) + keys ``[T, d]`` fp32 -> rows ``[T, row_bytes]``."""
        lat = latents.contiguous().view(torch.uint8).reshape(latents.shape[0], -1)
        return torch.cat([lat, quantize_keys(keys, self.storage)], dim=1)

    def latents(self, rows: torch.Tensor) -> torch.Tensor:
        """The ``[N, latent_dim]`` latent part of byte rows, in the model dtype."""
        return _typed(rows, 0, self.latent_bytes, self.latent_dtype)

    def keys(self, rows: torch.Tensor) -> torch.Tensor:
        """The dequantised indexer keys ``[N, d]`` fp32 of byte rows (exactly what scoring uses)."""
        return dequantize_keys(rows[:, self.latent_bytes :], self.dim, self.storage)


def quantize_keys(keys: torch.Tensor, storage: str) -> torch.Tensor:
    """fp32 keys ``[T, d]`` -> stored records ``[T, key_record_bytes]`` (uint8)."""
    T = keys.shape[0]
    k = keys.float()
    if storage == "float8_e4m3fn":
        amax = k.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
        scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))  # power of two: k / scale is exact
        codes = (k / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch.cat([codes.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)
    dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
    if storage not in ("bfloat16", "float32"):
        raise ValueError(f"unknown index key storage {storage!r}")
    return k.to(dtype).contiguous().view(torch.uint8).reshape(T, -1)


def dequantize_keys(records: torch.Tensor, dim: int, storage: str) -> torch.Tensor:
    """Stored records ``[N, key_record_bytes]`` -> keys ``[N, d]`` fp32 (exact inverse on stored values)."""
    if storage == "float8_e4m3fn":
        codes = _typed(records, 0, dim, torch.float8_e4m3fn).float()
        scale = _typed(records, dim, dim + 4, torch.float32)
        return codes * scale
    if storage == "bfloat16":
        return _typed(records, 0, 2 * dim, torch.bfloat16).float()
    if storage == "float32":
        return _typed(records, 0, 4 * dim, torch.float32)
    raise ValueError(f"unknown index key storage {storage!r}")


def rope_half(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """Rotate the first ``rope_dim`` dims of ``x [T, ..., d]`` (fp32) at absolute ``positions [T]``, in the
    non-interleaved layout ``x1 * cos - x2 * sin | x2 * cos + x1 * sin`` over halves ``x1, x2``."""
    if rope_dim == 0:
        return x
    exponents = torch.arange(0, rope_dim, 2, device=x.device, dtype=torch.float32) / rope_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[:, None] * inv_freq  # [T, rope_dim / 2]
    emb = torch.cat([angles, angles], dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos, sin = emb.cos().view(shape), emb.sin().view(shape)
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    half = rope_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Indexer(nn.Module):
    """The lightning indexer of one MLA layer (parameter names = DeepSeek-V3.2 checkpoint names)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.theta = config.qk_rope_head_dim, float(config.rope_theta)
        q_in = config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size
        self.wq_b = nn.Linear(q_in, self.n_heads * self.dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def keys(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``k^I`` of ``h [T, hidden]`` at ``positions [T]``: ``[T, d]`` fp32, before storage rounding."""
        k = self.wk(h).float()
        norm = self.k_norm
        k = F.layer_norm(k, (self.dim,), norm.weight.float(), norm.bias.float(), norm.eps)
        return rope_half(k, positions, self.rope_dim, self.theta)

    def queries(
        self, q_in: torch.Tensor, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q^I [T, n_heads, d], w [T, n_heads])`` fp32; ``q_in`` is ``c_Q`` (``h`` without q_lora)."""
        q = self.wq_b(q_in).float().view(q_in.shape[0], self.n_heads, self.dim)
        w = self.weights_proj(h).float() * self.n_heads**-0.5
        return rope_half(q, positions, self.rope_dim, self.theta), w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, first_pos: int) -> torch.Tensor:
        """``I [T, N]`` for queries at ``first_pos .. first_pos+T-1`` against ``keys [N, d]`` (positions
        ``0 .. N-1``); non-causal entries are ``-inf``."""
        T, N = q.shape[0], keys.shape[0]
        logits = (q.reshape(T * self.n_heads, self.dim) @ keys.T).view(T, self.n_heads, N) * self.dim**-0.5
        index = (w.unsqueeze(1) @ torch.relu(logits)).squeeze(1)  # sum_j w_j ReLU(.)  -> [T, N]
        cols = torch.arange(N, device=q.device)
        rows = torch.arange(first_pos, first_pos + T, device=q.device)
        return index.masked_fill(cols[None, :] > rows[:, None], float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic top-k of ``scores [T, N]``: order by score descending, ties by index ascending (a
    stable descending sort keeps equal scores in index order; ``torch.topk`` promises no tie order).

    Returns ``(idx [T, k'], valid [T, k'])`` with ``k' = min(k, N)``, each row's indices ascending (a
    canonical set, attended in position order); ``valid`` is False where a row had fewer than ``k`` causal
    keys and the slot holds a masked (``-inf``) one."""
    k = min(k, scores.shape[-1])
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    top, top_scores = ranked.indices[:, :k], ranked.values[:, :k]
    idx, perm = torch.sort(top, dim=-1)
    valid = torch.gather(top_scores, 1, perm) > float("-inf")
    return idx, valid
