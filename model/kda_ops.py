"""KDA (Kimi Delta Attention) math on plain tensors, per request (no batch dimension).

Shapes: ``q, k: [T, H, dk]``, ``v: [T, H, dv]``, ``g: [T, H, dk]`` (log-space decay, <= 0), ``beta: [T, H]``,
state ``S: [H, dk, dv]`` fp32 (layout HKV). Per head and token (arXiv 2510.26692)::

    S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T        o_t = S_t^T q_t

``kda_recurrent`` is that formula token by token (decode, and the in-tree reference); ``kda_chunk`` is the
closed form of one chunk of <= 64 tokens (prefill). They agree to ~1e-6 but not bitwise; bit-exact resume
comes from always using the same one for the same tokens (see docs/design/model.md).

q and k are expected already L2-normalised and q already scaled by ``dk^-1/2`` (``prepare_qk``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` in fp32 (fla's kernel form: +eps, not max(norm, eps))."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q and k in fp32 and fold the ``dk^-1/2`` readout scale into q."""
    q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5), k


def softplus_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear forget gate in log space: ``g = -exp(A_log[h]) * softplus(f + dt_bias)``, fp32.

    ``f: [T, H, dk]`` is the low-rank projection ``f_b(f_a(x))``; softplus is linear above 20 (as in
    transformers).
    """
    _T, H, dk = f.shape
    x = f.float() + dt_bias.float().view(H, dk)
    return -torch.exp(a_log.float().view(H, 1)) * F.softplus(x, beta=1.0, threshold=20.0)


def lower_bound_gate(
    f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float
) -> torch.Tensor:
    """K3-style "safe" gate: ``g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` in ``[lb, 0)``, fp32."""
    _T, H, dk = f.shape
    x = f.float() + dt_bias.float().view(H, dk)
    return lower_bound * torch.sigmoid(torch.exp(a_log.float().view(H, 1)) * x)


def short_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv (no bias, no activation) as an explicit shift-multiply-add.

    ``x: [T, D]`` pre-conv rows, ``conv_state: [W-1, D]`` the rows before them, ``weight: [D, W]`` (tap
    ``W-1`` multiplies the current row). Every output row is the same sequence of elementwise ops whatever
    ``T`` is, so running a sequence in pieces gives the same bits as running it whole (conv1d kernels do
    not: overview §7.3).
    Returns ``(y [T, D], new_state [W-1, D])``.
    """
    T = x.shape[0]
    W = weight.shape[1]
    xx = torch.cat([conv_state.to(x.dtype), x], dim=0)  # [T + W - 1, D]
    w = weight.to(x.dtype)
    y = xx[0:T] * w[:, 0]
    for i in range(1, W):
        y = y + xx[i : i + T] * w[:, i]
    return y, xx[T:].clone()


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence as written: decay, delta-rule write, readout with the updated state. fp32.

    Returns ``(o [T, H, dv] fp32, S [H, dk, dv] fp32)``.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float()
    outs = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t]).unsqueeze(-1)  # Diag(alpha_t) S
        err = v[t] - torch.einsum("hkv,hk->hv", S, k[t])  # v_t - S^T k_t
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t].unsqueeze(-1) * err)  # + b k (v - S^T k)^T
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))  # o_t = S_t^T q_t
    return torch.stack(outs, 0), S


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk (``T <= 64`` tokens) in closed form. fp32. Returns ``(o [T, H, dv], S [H, dk, dv])``.

    With ``G = cumsum(g)`` and the writes ``u_t = b_t (v_t - (Diag(e^{g_t}) S_{t-1})^T k_t)``, unrolling the
    recurrence from ``S_0`` gives (all decays pairwise ``e^{G_t - G_j} <= 1``, so no overflow)::

        (I + L) U = diag(b) (V - (K * e^G) S_0),      L_tj = b_t k_t . (k_j * e^{G_t - G_j})   (j < t)
        o_t = S_0^T (q_t * e^{G_t}) + sum_{j<=t} (q_t . (k_j * e^{G_t - G_j})) u_j
        S_T = Diag(e^{G_T}) S_0 + sum_j (k_j * e^{G_T - G_j}) u_j^T
    """
    q, k, v, g, beta = (t.float().transpose(0, 1) for t in (q, k, v, g, beta))  # head-major
    S0 = state.float()
    _H, T, _ = q.shape
    G = g.cumsum(1)  # [H, T, dk]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    diff = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~causal[..., None], float("-inf"))
    k_dec = torch.exp(diff) * k.unsqueeze(1)  # [H, T(t), T(j), dk]: k_j decayed to step t
    kk = torch.einsum("htjd,htd->htj", k_dec, k)  # k_t . (k_j e^{G_t-G_j})
    qk = torch.einsum("htjd,htd->htj", k_dec, q)  # q_t . (k_j e^{G_t-G_j})
    b = beta.unsqueeze(-1)  # [H, T, 1]
    eye = torch.eye(T, dtype=q.dtype, device=q.device)
    lhs = eye + (b * kk).tril(-1)
    rhs = b * (v - (k * torch.exp(G)) @ S0)
    U = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)  # [H, T, dv]
    o = (q * torch.exp(G)) @ S0 + qk.tril() @ U
    G_T = G[:, -1:, :]  # [H, 1, dk]
    S = torch.exp(G_T).transpose(1, 2) * S0 + (k * torch.exp(G_T - G)).transpose(1, 2) @ U
    return o.transpose(0, 1), S


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole sequence as consecutive chunks on the grid starting at token 0 of ``q`` (the last may be
    short)."""
    outs = []
    S = state
    for s in range(0, q.shape[0], chunk):
        e = s + chunk
        o, S = kda_chunk(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], S)
        outs.append(o)
    return torch.cat(outs, 0), S
