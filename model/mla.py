"""MLA (multi-head latent attention), NoPE as in Kimi Linear / K3, computed over the cached latents.

Per token the layer caches one row ``[c_kv | k_pe]`` (``kv_lora_rank + qk_rope_head_dim`` values): ``c_kv``
after ``kv_a_layernorm``, ``k_pe`` unrotated (NoPE). Attention is done directly on latents with the
up-projection absorbed into the query and the output (DeepSeek-V2 §2.1.2), so prefill and decode run the
same code and never expand keys/values per token::

    q_lat[h] = W_uk[h]^T q_nope[h]            score[h, t, s] = [q_lat[h] | q_pe[h]] . latent[s] * (dn+dr)^-1/2
    o[h]     = W_uv[h] (softmax(score) @ c_kv)

Mathematically identical to the expanded form transformers uses (agrees to ~1e-8 in fp32, overview §7.2).
Parameter names equal the checkpoint names.

With a DSA indexer (``config.dsa``, model/dsa.py) each cached row becomes a byte record ``[latent | indexer
key]`` and every query attends only over its top-``index_topk`` latents; while the whole context fits in
``index_topk`` the selection is "everything" and the dense code above runs unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .dsa import Indexer, IndexKeyFormat, select_topk
from .norm import RMSNorm


class MLALayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scaling = config.qk_head_dim**-0.5
        qk = config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)  # transformers uses its default eps here
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=config.attention_bias)
        self.index_topk = config.index_topk
        self.index_storage = config.index_cache_dtype
        self.indexer: Indexer | None = Indexer(config) if config.dsa else None

    def row_format(self) -> IndexKeyFormat:
        """Byte layout of this DSA layer's cache rows (latents in the current parameter dtype)."""
        assert self.indexer is not None
        dtype = self.kv_b_proj.weight.dtype
        return IndexKeyFormat(self.rank + self.rope, dtype, self.indexer.dim, self.index_storage)

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """Cache rows of ``x: [T, hidden]``: ``[T, kv_lora_rank + rope]`` = ``[norm(c_kv) | k_pe]``."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [T, hidden]`` at positions ``len(past) .. len(past)+T-1``; ``past: [P, row]`` cached rows
        (``[P, latent_dim]`` model dtype, or ``[P, row_bytes]`` uint8 records with a DSA indexer).

        Returns ``(y [T, hidden], new cache rows [T, row])``; token t attends to rows ``<= P + t`` (with DSA:
        to its top-``index_topk`` of them).
        """
        T, H = x.shape[0], self.num_heads
        new = self.latents(x)
        c_q = None if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if c_q is None else self.q_b_proj(c_q)
        q_nope, q_pe = (
            q.view(T, H, self.nope + self.rope).transpose(0, 1).split([self.nope, self.rope], dim=-1)
        )
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, dn, r], [H, dv, r]
        q_lat = torch.cat([q_nope @ w_uk, q_pe], dim=-1)  # [H, T, r + rope]
        if self.indexer is None:
            kv = torch.cat([past.to(new.dtype), new], dim=0) if past.shape[0] else new  # [P+T, latent]
            o_lat = self._dense(q_lat, kv)
            rows = new
        else:
            P = past.shape[0]
            fmt = self.row_format()
            positions = torch.arange(P, P + T, device=x.device)
            rows = fmt.pack(new, self.indexer.keys(x, positions))
            cache = torch.cat([past, rows], dim=0) if P else rows  # [P+T, row_bytes]
            kv = fmt.latents(cache)
            if self.index_topk >= P + T:  # every causal key is selected: exactly dense attention
                o_lat = self._dense(q_lat, kv)
            else:
                q_idx, w_idx = self.indexer.queries(x if c_q is None else c_q, x, positions)
                scores = self.indexer.scores(q_idx, w_idx, fmt.keys(cache), P)
                o_lat = self._sparse(q_lat, kv, *select_topk(scores, self.index_topk))
        o = (o_lat @ w_uv.transpose(1, 2)).transpose(0, 1).reshape(T, H * self.v_dim)  # [T, H*dv]
        return self.o_proj(o), rows

    def _dense(self, q_lat: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q_lat [H, T, r+rope]`` (the last T positions) over all ``kv [P+T, .]``."""
        T = q_lat.shape[1]
        scores = (q_lat @ kv.T).float() * self.scaling  # [H, T, P+T]
        P = kv.shape[0] - T
        if T > 1:
            cols = torch.arange(P + T, device=kv.device)
            rows = torch.arange(P, P + T, device=kv.device)
            scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(kv.dtype)
        return probs @ kv[:, : self.rank]  # [H, T, r]

    def _sparse(
        self, q_lat: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Query t attends only over the latents ``kv[idx[t]]`` (``valid`` masks padding slots)."""
        sel = kv[idx]  # [T, k, r + rope]: each query's own selected latents, in position order
        scores = (q_lat.transpose(0, 1) @ sel.transpose(1, 2)).float() * self.scaling  # [T, H, k]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(kv.dtype)
        return (probs @ sel[..., : self.rank]).transpose(0, 1)  # [H, T, r]
