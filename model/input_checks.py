"""What ``HybridModel`` refuses before computing anything: token ids, a resume state, checkpoint boundaries.

Why up front and typed: a cached resume is only exact when the state it starts from is exactly the shape,
dtype and position the model would have produced itself. A silent cast or a prefix off the 64-token grid
would compute *something* and return wrong tokens; these checks turn each such case into a
``ModelInputError`` subclass naming what was wrong, which the workers treat as a miss (recompute).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .config import KDA_CHUNK, ModelConfig
from .errors import (
    BadBoundaryError,
    BadStartStateError,
    EmptyPromptError,
    ModelInputError,
    TokenOutOfRangeError,
)
from .state import KDACheckpoint, PrefixState

SEGMENT = KDA_CHUNK  # prefill runs, and resumes, on this token grid


def token_ids(tokens: Sequence[int] | torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``tokens`` as a 1-D long tensor on ``device``: ints (not bools) inside ``[0, vocab_size)``, at least
    one."""
    if isinstance(tokens, torch.Tensor):
        if (
            tokens.dim() != 1
            or tokens.dtype.is_floating_point
            or tokens.dtype == torch.bool
            or tokens.is_complex()
        ):
            raise ModelInputError(
                f"tokens must be a 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        ids = tokens.to(device=device, dtype=torch.long)
    else:
        seq = list(tokens)
        for pos, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ModelInputError(f"token {pos} is {t!r}, not an int")
        ids = torch.tensor(seq, dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise EmptyPromptError("empty prompt: prefill needs at least one token")
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        pos = int(bad[0, 0])
        raise TokenOutOfRangeError(
            f"token id {int(ids[pos])} at position {pos} is outside the vocabulary [0, {vocab_size})"
        )
    return ids


def check_start(
    start: PrefixState, config: ModelConfig, dtype: torch.dtype, mla_row: tuple[int, torch.dtype]
) -> None:
    """A prefill's starting state: on the 64-token grid, and (past token 0) exactly the model's layers,
    shapes and dtypes (``check_prefix``)."""
    if not isinstance(start, PrefixState):
        raise BadStartStateError(f"start must be a PrefixState, got {type(start).__name__}")
    n = start.n_tokens
    if not isinstance(n, int) or n < 0 or n % SEGMENT:
        raise BadStartStateError(
            f"start.n_tokens={n!r} is not a non-negative multiple of {SEGMENT} "
            "(prefill resumes only on the canonical 64-token grid)"
        )
    if n:
        check_prefix(n, start.kda, start.mla, config, dtype, mla_row)


def check_prefix(
    n: int,
    kda: KDACheckpoint,
    mla: dict[int, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype,
    mla_row: tuple[int, torch.dtype],
) -> None:
    """``n`` tokens of state: a KDA checkpoint at ``n`` for every KDA layer (fp32 recurrent, conv in the
    model's dtype) and ``n`` MLA rows of ``mla_row`` (width, dtype) for every MLA layer."""
    c = config
    if kda.n_tokens != n:
        raise BadStartStateError(f"KDA checkpoint is at {kda.n_tokens} tokens, prefix claims {n}")
    if set(kda.layers) != set(c.kda_layers):
        raise BadStartStateError(f"KDA layers {sorted(kda.layers)} != model's {list(c.kda_layers)}")
    want_s = (c.kda_num_heads, c.kda_head_dim, c.kda_head_dim)
    want_c = (c.kda_conv_kernel - 1, c.conv_dim)
    for i, st in kda.layers.items():
        if tuple(st.recurrent.shape) != want_s or st.recurrent.dtype != torch.float32:
            raise BadStartStateError(
                f"layer {i}: recurrent state {st.recurrent.dtype} {tuple(st.recurrent.shape)}, "
                f"want float32 {want_s}"
            )
        if tuple(st.conv.shape) != want_c or st.conv.dtype != dtype:
            raise BadStartStateError(
                f"layer {i}: conv state {st.conv.dtype} {tuple(st.conv.shape)}, want {dtype} {want_c}"
            )
    if set(mla) != set(c.mla_layers):
        raise BadStartStateError(f"MLA layers {sorted(mla)} != model's {list(c.mla_layers)}")
    width, row_dtype = mla_row
    for i, rows in mla.items():
        if tuple(rows.shape) != (n, width) or rows.dtype != row_dtype:
            # a silent cast would break exactness: latents must be in the dtype they were computed in
            # (DSA: byte records [latent | indexer key], so a dense model's rows never fit and vice versa)
            raise BadStartStateError(
                f"layer {i}: latents {rows.dtype} {tuple(rows.shape)}, want {row_dtype} {(n, width)}"
            )


def checked_boundaries(boundaries: Iterable[int], start: int, end: int) -> set[int]:
    """Where a prefill over ``(start, end]`` may take checkpoints: segment ends (multiples of 64) or
    ``end``."""
    out = set()
    for b in boundaries:
        if isinstance(b, bool) or not isinstance(b, int):
            raise BadBoundaryError(f"boundary {b!r} is not an int")
        if not start < b <= end:
            raise BadBoundaryError(f"boundary {b} not in ({start}, {end}]")
        if b % SEGMENT and b != end:
            raise BadBoundaryError(f"boundary {b} is not a segment end (a multiple of {SEGMENT}, or L={end})")
        out.add(b)
    return out
