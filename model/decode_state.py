"""`DecodeState`: one request's resumable state while decoding (KDA states + growing MLA latents + position).

Advanced in place by ``HybridModel.decode_step`` (latents go into a buffer that doubles when full, so decode
is O(1) amortised per token instead of re-concatenating the whole cache). Use `clone` to keep a copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .state import KDACheckpoint, KDALayerState, PrefixState

if TYPE_CHECKING:
    from .prefill_result import PrefillResult


class DecodeState:
    def __init__(self, n_tokens: int, kda: dict[int, KDALayerState], mla: dict[int, torch.Tensor]) -> None:
        """``mla[i]`` holds exactly ``n_tokens`` rows; they are copied into a private buffer."""
        self.n_tokens = n_tokens
        self.kda = dict(kda)
        self._buf: dict[int, torch.Tensor] = {}
        for i, rows in mla.items():
            buf = rows.new_empty((max(2 * rows.shape[0], 64), rows.shape[1]))
            buf[: rows.shape[0]] = rows
            self._buf[i] = buf

    @classmethod
    def from_prefill(cls, result: PrefillResult) -> DecodeState:
        """Continue right after a prefill: its final KDA state and all its latents."""
        return cls(result.final.n_tokens, result.final.layers, result.mla)

    @classmethod
    def from_prefix(cls, prefix: PrefixState) -> DecodeState:
        """Continue from a fetched prefix (e.g. the request-scoped tail written by a prefill node)."""
        return cls(prefix.n_tokens, prefix.kda.layers, prefix.mla)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._buf))

    def latents(self, layer: int) -> torch.Tensor:
        """The valid rows ``[n_tokens, latent_dim]`` of one MLA layer (a view: do not keep across steps)."""
        return self._buf[layer][: self.n_tokens]

    def append_latent(self, layer: int, row: torch.Tensor) -> None:
        """Store the row of position ``n_tokens`` (the step in progress) for ``layer``."""
        buf = self._buf[layer]
        if self.n_tokens >= buf.shape[0]:
            bigger = buf.new_empty((2 * buf.shape[0], buf.shape[1]))
            bigger[: buf.shape[0]] = buf
            self._buf[layer] = buf = bigger
        buf[self.n_tokens] = row.reshape(-1)

    def checkpoint(self) -> KDACheckpoint:
        """Snapshot of every KDA layer at the current position (copies; safe to store while decoding on)."""
        return KDACheckpoint(
            n_tokens=self.n_tokens,
            layers={i: KDALayerState(s.recurrent.clone(), s.conv.clone()) for i, s in self.kda.items()},
        )

    def prefix_state(self) -> PrefixState:
        """Everything needed to resume at the current position (copies)."""
        return PrefixState(self.n_tokens, self.checkpoint(), {i: self.latents(i).clone() for i in self._buf})

    def clone(self) -> DecodeState:
        return DecodeState.from_prefix(self.prefix_state())
