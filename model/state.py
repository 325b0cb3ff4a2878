"""The cache state a hybrid model hands out and takes back, independent of any wire format.

Two kinds of per-request state exist (overview §3):

* MLA latents: one row ``[c_kv | k_pe]`` per token per MLA layer. Position-free (Kimi MLA is NoPE), so a
  block of rows can be cut anywhere and concatenated back.
* KDA boundary state: per KDA layer the recurrent state ``S [H, dk, dv]`` (fp32, layout ``HKV``) plus the
  short-conv state, i.e. the last ``W-1`` *pre-conv* rows of the q/k/v projections, ``[W-1, Dq+Dk+Dv]``.
  It is only valid at one exact token position, so it carries that position.

Shapes here are per request (no batch dimension): a checkpoint is the unit that is stored and fetched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STATE_LAYOUT = "HKV"  # S[h, k, v]; fla's layer uses V-first, so the wire header records this


@dataclass
class KDALayerState:
    """Recurrent + conv state of one KDA layer at a token boundary."""

    recurrent: torch.Tensor  # [H, dk, dv] float32
    conv: torch.Tensor  # [W-1, Dq + Dk + Dv], activation dtype, exact pre-conv projection rows


@dataclass
class KDACheckpoint:
    """All KDA layers' state after exactly ``n_tokens`` tokens."""

    n_tokens: int
    layers: dict[int, KDALayerState] = field(default_factory=dict)


@dataclass
class PrefixState:
    """Everything needed to resume a request at ``n_tokens``: the KDA checkpoint there and the MLA latents of
    tokens ``[0, n_tokens)`` for every MLA layer (``[n_tokens, kv_lora_rank + rope_dim]``)."""

    n_tokens: int
    kda: KDACheckpoint
    mla: dict[int, torch.Tensor] = field(default_factory=dict)
