"""The KDA token mixer of one layer (Kimi-Linear ``KimiLinearDeltaAttention``), per request.

    x -> q,k,v = W_q x, W_k x, W_v x -> causal depthwise conv (W taps) + SiLU -> L2 norm (q, k)
      -> g = forget gate(x), beta = sigmoid(W_b x) -> KDA recurrence -> RMSNorm_h(o) * sigmoid(W_g x) -> W_o

Parameter names equal the Kimi-Linear checkpoint names (``q_conv1d``, ``f_a_proj``, ``A_log``, ...), so
loading is a plain ``state_dict`` copy. The state crossing a token boundary is `KDALayerState`:
``S [H, dk, dv]`` fp32 and the last ``W-1`` *pre-conv* q/k/v rows (``[W-1, 3*H*dk]``, activation dtype,
exact). The recurrence runs on the backend of ``kda_backend`` (ours by default, fla's kernels on a GPU).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kda_backend import chunk_fn, recurrent_fn
from .kda_ops import lower_bound_gate, prepare_qk, short_conv, softplus_gate
from .norm import GatedRMSNorm
from .state import KDALayerState


class KDALayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, H, dk = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        D, W = config.kda_dim, config.kda_conv_kernel
        self.num_heads, self.head_dim, self.kernel = H, dk, W
        self.lower_bound = config.kda_gate_lower_bound
        self.beta_scale = 2.0 if config.kda_allow_neg_eigval else 1.0
        self.q_proj = nn.Linear(hidden, D, bias=False)
        self.k_proj = nn.Linear(hidden, D, bias=False)
        self.v_proj = nn.Linear(hidden, D, bias=False)
        self.q_conv1d = nn.Conv1d(D, D, W, groups=D, bias=False)  # weights only; applied by `short_conv`
        self.k_conv1d = nn.Conv1d(D, D, W, groups=D, bias=False)
        self.v_conv1d = nn.Conv1d(D, D, W, groups=D, bias=False)
        self.f_a_proj = nn.Linear(hidden, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, D, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, H, 1))
        self.dt_bias = nn.Parameter(torch.zeros(D))
        self.b_proj = nn.Linear(hidden, H, bias=False)
        self.g_a_proj = nn.Linear(hidden, dk, bias=False)
        self.g_b_proj = nn.Linear(dk, D, bias=False)
        self.o_norm = GatedRMSNorm(dk, config.rms_norm_eps)
        self.o_proj = nn.Linear(D, hidden, bias=False)

    def empty_state(self, dtype: torch.dtype, device: torch.device) -> KDALayerState:
        """State before token 0: zero recurrent state and zero conv history (the conv's causal padding)."""
        H, dk = self.num_heads, self.head_dim
        return KDALayerState(
            recurrent=torch.zeros(H, dk, dk, dtype=torch.float32, device=device),
            conv=torch.zeros(self.kernel - 1, 3 * H * dk, dtype=dtype, device=device),
        )

    def conv_weight(self) -> torch.Tensor:
        """The three depthwise kernels as one ``[3D, W]`` matrix, rows in q|k|v order like the conv state."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0).squeeze(1)

    def forward(
        self, x: torch.Tensor, state: KDALayerState, mode: Literal["chunk", "recurrent"] = "chunk"
    ) -> tuple[torch.Tensor, KDALayerState]:
        """``x: [T, hidden]`` (already input-normed) -> ``([T, hidden], state after the T tokens)``.

        ``mode="chunk"`` needs ``T <= 64`` (one canonical segment); ``"recurrent"`` takes any ``T`` (decode).
        """
        T = x.shape[0]
        H, dk = self.num_heads, self.head_dim
        pre = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3D] pre-conv rows
        mixed, conv_state = short_conv(pre, state.conv, self.conv_weight())
        mixed = F.silu(mixed)
        q, k, v = (t.reshape(T, H, dk) for t in mixed.split(H * dk, dim=-1))
        q, k = prepare_qk(q, k)
        f = self.f_b_proj(self.f_a_proj(x)).view(T, H, dk)
        if self.lower_bound is None:
            g = softplus_gate(f, self.A_log, self.dt_bias)
        else:
            g = lower_bound_gate(f, self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float()) * self.beta_scale
        if mode == "chunk":
            if T > 64:
                raise ValueError(f"chunk mode takes one segment of <= 64 tokens, got {T}")
            o, S = chunk_fn()(q, k, v.float(), g, beta, state.recurrent)
        elif mode == "recurrent":
            o, S = recurrent_fn()(q, k, v.float(), g, beta, state.recurrent)
        else:
            raise ValueError(f"unknown KDA mode {mode!r}")
        gate = self.g_b_proj(self.g_a_proj(x)).view(T, H, dk)
        y = self.o_norm(o.to(x.dtype), gate).reshape(T, H * dk)
        return self.o_proj(y), KDALayerState(recurrent=S, conv=conv_state)
