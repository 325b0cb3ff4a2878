"""Kimi-Linear MoE block: sigmoid router with a score-correction bias, group-limited top-k, renormalised and
scaled weights, per-expert SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down) plus always-on shared experts.

Names follow the original checkpoint (``block_sparse_moe.experts.{e}.w1``); routing follows transformers'
``KimiLinearTopkRouter`` so the oracle picks the same experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .mlp import MLP


class Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E = config.num_experts
        self.top_k, self.n_group, self.topk_group = (
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
        )
        self.norm_topk_prob, self.scale = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(E, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))  # a checkpoint tensor, not trained

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [T, hidden]`` -> ``(weights [T, k] fp32, expert ids [T, k])``."""
        scores = torch.sigmoid(x.float() @ self.weight.float().T)  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        T, E = choice.shape
        per_group = choice.view(T, self.n_group, E // self.n_group)
        group_scores = per_group.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, idx


class MoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(
            Expert(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():  # ascending expert order: a fixed summation order
            rows, slot = torch.where(idx == e)
            y = self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
