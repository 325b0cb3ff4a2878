"""Which tokens one kvpool object covers, and the chained keys that name them for one served model.

A *chunk* is the unit of one store object: ``lcm(64, every group's vLLM block size)`` tokens, so a chunk is
whole vLLM blocks in every KV-cache group and lies on kvpool's 64-token grid. Its key is kvpool's own
chained hash (``kvpool.cache.hashing``) of the prompt's token ids, rooted in a *fingerprint* of what the
bytes mean (model, dtype, every group's layers and spec, block and chunk sizes, tensor-parallel rank) and
in the request's ``cache_salt``: a different model, dtype, layout or salt starts another chain and can never
match. Only full chunks get keys, and a lookup never covers the chunk holding the last prompt token: the
engine must compute at least one token itself to sample from.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import cbor2
from kvpool.cache.hashing import KDA_CHUNK, BlockHash, hash_blocks, root_hash

FINGERPRINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One vLLM KV-cache group as the connector sees it: its layers, block size, and whether it holds
    per-token attention KV (``attention``) or a recurrent state that is only valid at a boundary."""

    layer_names: tuple[str, ...]
    block_size: int
    attention: bool
    spec: str  # the group's spec, printed: part of the fingerprint (heads, head size, dtype, state shapes)


def chunk_tokens(groups: Sequence[GroupLayout]) -> int:
    """Tokens per store object: the least common multiple of 64 and every group's block size."""
    return math.lcm(KDA_CHUNK, *(g.block_size for g in groups))


def fingerprint(model: str, dtype: str, groups: Sequence[GroupLayout], tp_rank: int, tp_size: int) -> bytes:
    """32 bytes naming the meaning of the stored bytes: two engines share objects only if all of it is equal.

    The tensor-parallel rank is in it because each rank holds its own heads: rank r's chain is its own."""
    doc = [
        FINGERPRINT_VERSION,
        model,
        dtype,
        [[list(g.layer_names), g.block_size, g.attention, g.spec] for g in groups],
        chunk_tokens(groups),
        tp_rank,
        tp_size,
    ]
    return hashlib.sha256(cbor2.dumps(doc, canonical=True)).digest()


def chunk_hashes(tokens: Sequence[int], chunk: int, fp: bytes, salt: str | None) -> list[BlockHash]:
    """Hashes of every full chunk of ``tokens``, chained from the root of (fingerprint, salt)."""
    return hash_blocks(list(tokens), chunk, root_hash(fp, salt or ""))


def matchable_chunks(prompt_len: int, chunk: int) -> int:
    """Chunks a lookup may cover: full chunks that end before the last prompt token."""
    return max(prompt_len - 1, 0) // chunk
