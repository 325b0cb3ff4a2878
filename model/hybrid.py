"""`HybridModel`: the Kimi-Linear-style stack (KDA and MLA token mixers, dense or MoE MLPs) with the two entry
points serving needs: `prefill` on the canonical 64-token schedule and single-token `decode_step`.

The canonical schedule (docs/design/model.md): tokens are processed in segments ``[64k, 64k+64)`` of the
*absolute* position grid, one full forward per segment starting from the previous segment's state, the last
segment possibly short. Every op inside a segment sees the same inputs and shapes whether the prompt was run
whole or resumed from a 64-aligned `PrefixState`, so ``prefill(0..L)`` equals ``prefill(0..p)`` -> state ->
``prefill(p..L)`` bit for bit. Decode is always the single-token recurrent form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
from kvpool.model.cache_schema import CacheSchema
from torch import nn

from .config import DENSE, KDA, ModelConfig
from .decode_state import DecodeState
from .dsa import IndexKeyFormat
from .errors import (
    BadStartStateError,
    ModelInputError,
)
from .hf_config import canonical_json
from .input_checks import SEGMENT, check_prefix, check_start, checked_boundaries, token_ids
from .kda import KDALayer
from .mla import MLALayer
from .mlp import MLP
from .moe import MoE
from .norm import RMSNorm
from .prefill_result import PrefillResult
from .state import KDACheckpoint, KDALayerState, PrefixState


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None -> cuda when available else cpu; anything else is taken literally."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelInputError("device 'cuda' requested but CUDA is not available")
    return dev


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += mixer(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, idx: int) -> None:
        super().__init__()
        self.is_kda = config.layer_types[idx] == KDA
        self.self_attn: KDALayer | MLALayer = KDALayer(config) if self.is_kda else MLALayer(config)
        self.mlp: MLP | MoE = (
            MLP(config.hidden_size, config.intermediate_size)
            if config.mlp_layer_types[idx] == DENSE
            else MoE(config)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    """Holds the parameters under the checkpoint's ``model.`` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: str | torch.device | None = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)
        self.eval()
        self.to(device=resolve_device(device), dtype=dtype)
        self._fingerprint: bytes | None = None

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def invalidate_fingerprint(self) -> None:
        """Call after changing weights in place (loaders do)."""
        self._fingerprint = None

    def fingerprint(self) -> bytes:
        """32-byte SHA-256 over the canonical config JSON and every tensor (name, dtype, shape, bytes) in name
        order. Same weights + same architecture -> same bytes on any machine; it roots every block hash."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"kvpool-model-fingerprint-v1\0")
            h.update(canonical_json(self.config))
            for name, t in sorted(self.state_dict().items()):
                t = t.detach().to("cpu").contiguous()
                h.update(f"\0{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._fingerprint = h.digest()
        return self._fingerprint

    def cache_schema(self, block_size: int = 64) -> CacheSchema:
        """Shapes/dtypes of this model's cache units for the codec (latents in model dtype, S fp32 HKV)."""
        if block_size <= 0 or block_size % SEGMENT:
            raise ModelInputError(f"block_size must be a positive multiple of {SEGMENT}, got {block_size}")
        c = self.config
        name = str(self.dtype).removeprefix("torch.")
        dsa = {"index_dim": c.index_head_dim, "index_dtype": c.index_cache_dtype} if c.dsa else {}
        return CacheSchema(
            fingerprint=self.fingerprint(),
            mla_layers=c.mla_layers,
            latent_dim=c.latent_dim,
            mla_dtype=name,
            kda_layers=c.kda_layers,
            state_shape=(c.kda_num_heads, c.kda_head_dim, c.kda_head_dim),
            conv_shape=(c.kda_conv_kernel - 1, c.conv_dim),
            conv_dtype=name,
            block_size=block_size,
            **dsa,
        )

    def mla_row(self) -> tuple[int, torch.dtype]:
        """Width and dtype of one cached MLA row: ``(latent_dim, model dtype)``, or for a DSA model the byte
        record ``[latent | indexer key]``: ``(row_bytes, uint8)`` (model/dsa.py)."""
        c = self.config
        if not c.dsa:
            return c.latent_dim, self.dtype
        fmt = IndexKeyFormat(c.latent_dim, self.dtype, c.index_head_dim, c.index_cache_dtype)
        return fmt.row_bytes, torch.uint8

    def _state_in(self, st: KDALayerState) -> KDALayerState:
        return KDALayerState(st.recurrent.to(self.device, torch.float32), st.conv.to(self.device, self.dtype))

    # ------------------------------------------------------------------ forward
    def _segment(
        self, ids: torch.Tensor, pos: int, kda: dict[int, KDALayerState], latents: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """One canonical segment at absolute position ``pos``; updates ``kda`` and writes ``latents`` rows."""
        T = ids.shape[0]
        h = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
            if layer.is_kda:
                y, kda[i] = layer.self_attn(x, kda[i], mode="chunk")
            else:
                y, new = layer.self_attn(x, latents[i][:pos])
                latents[i][pos : pos + T] = new
            h = h + y
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    @torch.no_grad()
    def prefill(
        self,
        tokens: Sequence[int] | torch.Tensor,
        start: PrefixState | None = None,
        boundaries: Sequence[int] = (),
        logits: Literal["last", "all"] = "last",
    ) -> PrefillResult:
        """Run the NEW ``tokens`` (absolute positions ``start.n_tokens ..  L-1``) on the canonical schedule.

        ``start``: the resumed prefix (``n_tokens`` a multiple of 64) or None for position 0. ``boundaries``:
        absolute positions in ``(start, L]`` that are multiples of 64 (or ``L``) where KDA checkpoints are
        wanted. Raises `ModelInputError` subclasses on bad input before computing anything.
        """
        if logits not in ("last", "all"):
            raise ModelInputError(f"logits must be 'last' or 'all', got {logits!r}")
        ids = token_ids(tokens, self.config.vocab_size, self.device)
        c = self.config
        p0 = 0
        if start is not None:
            check_start(start, self.config, self.dtype, self.mla_row())
            p0 = start.n_tokens
        L = p0 + ids.shape[0]
        wanted = checked_boundaries(boundaries, p0, L)

        if p0:
            kda = {i: self._state_in(s) for i, s in start.kda.layers.items()}
        else:
            kda = {
                i: self.model.layers[i].self_attn.empty_state(self.dtype, self.device) for i in c.kda_layers
            }
        width, row_dtype = self.mla_row()
        latents = {i: torch.empty(L, width, dtype=row_dtype, device=self.device) for i in c.mla_layers}
        if p0:
            for i in c.mla_layers:
                latents[i][:p0] = start.mla[i]

        checkpoints: dict[int, KDACheckpoint] = {}
        outs: list[torch.Tensor] = []
        h = ids.new_empty(0)
        anchor, tail_from = KDACheckpoint(p0, dict(kda)), p0
        for pos in range(p0, L, SEGMENT):
            end = min(pos + SEGMENT, L)
            if end - pos < SEGMENT:
                anchor, tail_from = KDACheckpoint(pos, dict(kda)), pos
            h = self._segment(ids[pos - p0 : end - p0], pos, kda, latents)
            if logits == "all":
                outs.append(self.lm_head(h))
            if end in wanted:
                checkpoints[end] = KDACheckpoint(end, dict(kda))
        out = torch.cat(outs, 0) if logits == "all" else self.lm_head(h[-1:])[0]
        final = KDACheckpoint(L, dict(kda))
        if L % SEGMENT == 0:
            anchor, tail_from = final, L
        return PrefillResult(
            logits=out,
            mla=latents,
            checkpoints=checkpoints,
            final=final,
            anchor=anchor,
            tail_tokens=ids[tail_from - p0 :].tolist(),
        )

    @torch.no_grad()
    def decode_step(self, token: int, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        """Feed one token at position ``state.n_tokens``; returns ``(logits [V], state)``.

        The state is advanced in place (and returned for convenience); ``state.clone()`` keeps a copy."""
        if not isinstance(state, DecodeState):
            raise BadStartStateError(f"state must be a DecodeState, got {type(state).__name__}")
        if isinstance(token, torch.Tensor):
            token = int(token.item()) if token.numel() == 1 else token
        ids = token_ids([token], self.config.vocab_size, self.device)
        n = state.n_tokens
        latents = {i: state.latents(i) for i in state.mla_layers}
        check_prefix(n, KDACheckpoint(n, state.kda), latents, self.config, self.dtype, self.mla_row())
        h = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
            if layer.is_kda:
                y, state.kda[i] = layer.self_attn(x, self._state_in(state.kda[i]), mode="recurrent")
            else:
                y, new = layer.self_attn(x, state.latents(i))
                state.append_latent(i, new)
            h = h + y
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.lm_head(self.model.norm(h))[0]
        state.n_tokens += 1
        if state.anchor is not None:
            state.pending.append(int(ids[0]))
            if state.n_tokens % SEGMENT == 0:
                self._canonicalize(state)
        return logits, state

    def _canonicalize(self, state: DecodeState) -> None:
        """Re-run the segment just completed by decode on the prefill path, from the anchor, and adopt its
        KDA state and MLA rows: the state at every segment end is then what a prefill would have made."""
        anchor = state.anchor
        pos = anchor.n_tokens
        ids = torch.tensor(state.pending, dtype=torch.long, device=self.device)
        kda = {i: self._state_in(s) for i, s in anchor.layers.items()}
        self._segment(ids, pos, kda, state.buffers())  # rewrites rows [pos, pos + 64) of every MLA layer
        state.kda = kda
        state.anchor = KDACheckpoint(state.n_tokens, dict(kda))
        state.pending = []

    def decode_step_batch(self, tokens: Sequence[int], states: Sequence[DecodeState]) -> list[torch.Tensor]:
        """Several requests, one step each. Per-request exact: each row is computed exactly as `decode_step`
        would (a stacked GEMM would change the bits: M=B rows differ from M=1 by ~1e-7, overview §7.3)."""
        if len(tokens) != len(states):
            raise ModelInputError(f"{len(tokens)} tokens for {len(states)} states")
        return [self.decode_step(t, s)[0] for t, s in zip(tokens, states, strict=True)]

    def generate(
        self, prompt_ids: Sequence[int] | torch.Tensor, max_tokens: int, eos_ids: Iterable[int] | None = None
    ) -> list[int]:
        """Greedy decoding: prefill the prompt, then up to ``max_tokens`` decode steps; stops after an eos id
        (``eos_ids`` default: the config's). Returns the generated ids (eos included if produced)."""
        if max_tokens < 0:
            raise ModelInputError(f"max_tokens must be >= 0, got {max_tokens}")
        stop = set(self.config.eos_token_id if eos_ids is None else eos_ids)
        result = self.prefill(prompt_ids)
        if max_tokens == 0:
            return []
        state = DecodeState.from_prefill(result)
        out = [int(torch.argmax(result.logits))]
        while len(out) < max_tokens and out[-1] not in stop:
            logits, state = self.decode_step(out[-1], state)
            out.append(int(torch.argmax(logits)))
        return out
