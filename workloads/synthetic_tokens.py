"""Tokens for a hash-id-only trace: block id ``k`` always expands to the same tokens, so equal id prefixes
give equal token prefixes and a live replay through the gateway reproduces the trace's sharing exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
from kvpool.workloads.errors import TraceFormatError
from kvpool.workloads.trace_record import MOONCAKE_BLOCK, Request

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, vectorised: a fixed, seedable stream independent of numpy's RNG versions."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return z ^ (z >> np.uint64(31))


def synthesize_tokens(
    hash_ids: list[int], input_length: int, vocab: int, block_size: int = MOONCAKE_BLOCK, seed: int = 0
) -> list[int]:
    """Deterministic token ids for a hash-id-only request: block ``k`` always expands to the same
    ``block_size`` tokens (the last block truncated), so equal id prefixes give equal token prefixes
    and a live replay reproduces the trace's sharing. Tokens are drawn from ``[0, vocab)``."""
    if vocab <= 0:
        raise TraceFormatError("vocab must be positive")
    if not hash_ids:
        return []
    ids = np.asarray(hash_ids, dtype=np.uint64)
    pos = np.arange(block_size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = (ids[:, None] * np.uint64(block_size) + pos[None, :]) ^ (np.uint64(seed) << np.uint64(40))
    toks = (_splitmix64(base) % np.uint64(vocab)).reshape(-1)[:input_length]
    return toks.astype(np.int64).tolist()


def with_synthetic_tokens(requests: Iterable[Request], vocab: int, seed: int = 0) -> Iterator[Request]:
    """Requests with ``tokens`` filled from their hash ids (those that already have tokens pass as is)."""
    for req in requests:
        if req.tokens is None and req.hash_ids is not None:
            req.tokens = synthesize_tokens(req.hash_ids, req.input_length, vocab, req.block_size, seed)
        yield req
