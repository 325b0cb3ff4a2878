"""`PrefillResult`: what one prefill call hands back (logits, all MLA latents, KDA checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import BadBoundaryError
from .state import KDACheckpoint, PrefixState


@dataclass
class PrefillResult:
    """``logits``: ``[V]`` for the last token (``logits="last"``) or ``[L - start, V]`` (``"all"``).
    ``mla[i]``: latents of ALL tokens ``[0, L)`` of MLA layer ``i`` (the start's rows, then the new ones).
    ``checkpoints[b]``: KDA state after exactly ``b`` tokens for each requested boundary; ``final``: at ``L``.
    ``anchor``: the KDA state at the start of the last segment (``64 * floor(L / 64)``, = ``final`` when L is
    aligned) and ``tail_tokens`` the tokens after it: what canonical decode needs (see `DecodeState`).
    """

    logits: torch.Tensor
    mla: dict[int, torch.Tensor]
    checkpoints: dict[int, KDACheckpoint] = field(default_factory=dict)
    final: KDACheckpoint = field(default_factory=lambda: KDACheckpoint(0))
    anchor: KDACheckpoint | None = None
    tail_tokens: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return self.final.n_tokens

    def prefix(self, n_tokens: int | None = None) -> PrefixState:
        """The `PrefixState` at ``n_tokens`` (default ``L``): a requested boundary or the end."""
        n = self.final.n_tokens if n_tokens is None else n_tokens
        if n == self.final.n_tokens:
            ckpt = self.final
        elif n in self.checkpoints:
            ckpt = self.checkpoints[n]
        else:
            raise BadBoundaryError(
                f"no KDA checkpoint at {n}; have {sorted(self.checkpoints)} and {self.n_tokens}"
            )
        return PrefixState(n, ckpt, {i: rows[:n] for i, rows in self.mla.items()})
