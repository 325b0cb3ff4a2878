"""`DecodeState`: one request's resumable state while decoding (KDA states + growing MLA latents + position).

Advanced in place by ``HybridModel.decode_step`` (latents go into a buffer that doubles when full, so decode
is O(1) amortised per token instead of re-concatenating the whole cache). Use `clone` to keep a copy.

Canonical decode: when the state knows its *anchor* (the KDA state at the last 64-aligned position, computed
on the canonical schedule) and the tokens fed since (``pending``), ``decode_step`` re-runs each completed
64-token segment through the prefill path and replaces that segment's KDA state and MLA rows with the
canonical ones. So every block and checkpoint a decode node pushes at a segment end is bit-identical to
what a prefill of the whole conversation would compute, and the next turn's cache hit is exact
(docs/design/model.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .config import KDA_CHUNK
from .errors import BadStartStateError
from .state import KDACheckpoint, KDALayerState, PrefixState

if TYPE_CHECKING:
    from .prefill_result import PrefillResult


class DecodeState:
    def __init__(
        self,
        n_tokens: int,
        kda: dict[int, KDALayerState],
        mla: dict[int, torch.Tensor],
        anchor: KDACheckpoint | None = None,
        pending: Sequence[int] = (),
    ) -> None:
        """``mla[i]`` holds exactly ``n_tokens`` rows; they are copied into a private buffer. ``anchor``
        (optional) is the canonical KDA checkpoint at a multiple of 64 and ``pending`` the tokens at positions
        ``[anchor.n_tokens, n_tokens)``; without them decode works but does not canonicalise."""
        if anchor is not None and (
            anchor.n_tokens % KDA_CHUNK
            or anchor.n_tokens + len(pending) != n_tokens
            or len(pending) >= KDA_CHUNK
        ):
            raise BadStartStateError(
                f"anchor at {anchor.n_tokens} + {len(pending)} pending tokens does not lead to {n_tokens} "
                f"within one {KDA_CHUNK}-token segment"
            )
        self.n_tokens = n_tokens
        self.kda = dict(kda)
        self.anchor = anchor
        self.pending = [int(t) for t in pending] if anchor is not None else []
        self._buf: dict[int, torch.Tensor] = {}
        for i, rows in mla.items():
            buf = rows.new_empty((max(2 * rows.shape[0], 64), rows.shape[1]))
            buf[: rows.shape[0]] = rows
            self._buf[i] = buf

    @classmethod
    def from_prefill(cls, result: PrefillResult) -> DecodeState:
        """Continue right after a prefill: its final KDA state, all its latents, and its anchor."""
        return cls(result.final.n_tokens, result.final.layers, result.mla, result.anchor, result.tail_tokens)

    @classmethod
    def from_prefix(
        cls, prefix: PrefixState, anchor: KDACheckpoint | None = None, tail_tokens: Sequence[int] = ()
    ) -> DecodeState:
        """Continue from a fetched prefix (e.g. the request-scoped tail written by a prefill node).

        A 64-aligned prefix is its own anchor; otherwise pass the checkpoint at ``64 * (n // 64)`` and the
        tail tokens to keep decode canonical."""
        if anchor is None and prefix.n_tokens % KDA_CHUNK == 0:
            anchor, tail_tokens = prefix.kda, ()
        return cls(prefix.n_tokens, prefix.kda.layers, prefix.mla, anchor, tail_tokens)

    @property
    def canonical(self) -> bool:
        """True when segment ends reached while decoding are re-run on the canonical schedule."""
        return self.anchor is not None

    def buffers(self) -> dict[int, torch.Tensor]:
        """The latent buffers (capacity >= n_tokens rows) for the model's canonicalisation pass."""
        return self._buf

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
        p = self.prefix_state()
        anchor = None
        if self.anchor is not None:
            anchor = KDACheckpoint(
                self.anchor.n_tokens,
                {
                    i: KDALayerState(s.recurrent.clone(), s.conv.clone())
                    for i, s in self.anchor.layers.items()
                },
            )
        return DecodeState(p.n_tokens, p.kda.layers, p.mla, anchor, self.pending)
