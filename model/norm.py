"""RMS norms used by the hybrid model (fp32 inside, as the Kimi-Linear reference does)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``; normalised in fp32, cast back before the weight multiply."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GatedRMSNorm(nn.Module):
    """KDA output norm: ``RMSNorm_dv(o) * w * sigmoid(gate)``, all in fp32 (weights never downcast)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.float() * h
        return (h * torch.sigmoid(gate.float())).to(dtype)
