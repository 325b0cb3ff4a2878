"""Chained block hashes: the identity of a token prefix, shared by gateway, master, workers, simulator.

``h_{-1} = SHA-256(CBOR [FORMAT_VERSION, model fingerprint, tenant salt])`` and
``h_i = SHA-256(CBOR [h_{i-1}, tokens of block i, extra])`` with canonical CBOR (RFC 8949 §4.2), so every
process, language and PYTHONHASHSEED computes the same bytes. Chaining makes ``h_i`` name the whole prefix
``[0, (i+1)·B)``, and the root makes chains of different models / tenants disjoint at every position
(overview §3). Only full blocks get a hash: a partial tail is request-scoped and keyed by request id.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Sequence
from typing import NewType

import cbor2
from kvpool.cache.errors import HashInputError
from kvpool.kvstore.keys import HASH_BYTES
from kvpool.model.cache_schema import FORMAT_VERSION

BlockHash = NewType("BlockHash", bytes)  # 32-byte SHA-256 digest naming the prefix a block closes

KDA_CHUNK = 64  # blocks are multiples of the KDA chunk so prefill runs on one grid (overview §7.3 rule 1)
_MAX_TOKEN = 2**64 - 1  # largest CBOR major-type-0 integer: keeps token encoding one canonical form


def check_block_size(block_size: int) -> int:
    """Return ``block_size`` if it is a positive multiple of 64, else raise ``HashInputError``."""
    if type(block_size) is not int or block_size <= 0 or block_size % KDA_CHUNK:
        raise HashInputError(f"block_size must be a positive multiple of {KDA_CHUNK}, got {block_size!r}")
    return block_size


def canonical_tokens(tokens: Iterable[int]) -> list[int]:
    """Tokens as plain Python ints (numpy / torch ints accepted), rejecting bools, negatives and non-ints."""
    if hasattr(tokens, "tolist"):  # numpy array / torch tensor: one C-level conversion
        tokens = tokens.tolist()
    out: list[int] = []
    for t in tokens:
        if type(t) is not int:
            if isinstance(t, bool):
                raise HashInputError("token ids must be ints, got a bool")
            try:
                t = operator.index(t)
            except TypeError:
                raise HashInputError(f"token ids must be ints, got {type(t).__name__}") from None
        if t < 0 or t > _MAX_TOKEN:
            raise HashInputError(f"token ids must be in [0, 2**64), got {t}")
        out.append(t)
    return out


def _cbor(value: object) -> bytes:
    try:
        return cbor2.dumps(value, canonical=True)
    except (cbor2.CBOREncodeError, TypeError, ValueError) as e:
        raise HashInputError(f"value is not canonically CBOR-encodable: {e}") from e


def root_hash(fingerprint: bytes, salt: str = "") -> BlockHash:
    """``h_{-1}``: the parent of block 0. The salt (tenant / ``cache_salt``) here isolates a whole chain."""
    if not isinstance(fingerprint, bytes | bytearray | memoryview) or len(fingerprint) != HASH_BYTES:
        raise HashInputError(f"model fingerprint must be {HASH_BYTES} bytes")
    if not isinstance(salt, str):
        raise HashInputError(f"salt must be a str, got {type(salt).__name__}")
    return BlockHash(hashlib.sha256(_cbor([FORMAT_VERSION, bytes(fingerprint), salt])).digest())


def _check_parent(parent: bytes) -> bytes:
    if not isinstance(parent, bytes | bytearray) or len(parent) != HASH_BYTES:
        raise HashInputError(f"parent hash must be {HASH_BYTES} bytes")
    return bytes(parent)


def hash_block(parent: bytes, tokens: Sequence[int], extra: object = None) -> BlockHash:
    """``h_i`` from ``h_{i-1}``, the block's tokens and an optional CBOR-able ``extra`` (e.g. multimodal ids).

    The low-level step: use it directly when ``extra`` differs per block. Does not check the token count.
    """
    payload = _cbor([_check_parent(parent), canonical_tokens(tokens), extra])
    return BlockHash(hashlib.sha256(payload).digest())


def hash_blocks(tokens: Sequence[int], block_size: int, root: bytes, extra: object = None) -> list[BlockHash]:
    """Hashes of every *full* block of ``tokens`` (the partial tail has none), chained from ``root``.

    ``extra`` is mixed into every block's hash; for per-block extras call ``hash_block`` in a loop.
    """
    hasher = BlockHasher(block_size, root, extra)
    return hasher.feed(tokens)


def usable_tokens(n_blocks: int, block_size: int) -> int:
    """Tokens covered by the first ``n_blocks`` full blocks: the position where a checkpoint keyed by
    ``hashes[n_blocks - 1]`` sits."""
    check_block_size(block_size)
    if type(n_blocks) is not int or n_blocks < 0:
        raise HashInputError(f"n_blocks must be a non-negative int, got {n_blocks!r}")
    return n_blocks * block_size


class BlockHasher:
    """Incremental chain for tokens that arrive over time (decode output): ``feed`` returns the hashes of
    the blocks it closed, so a decode node can snapshot and push exactly at block boundaries."""

    def __init__(self, block_size: int, root: bytes, extra: object = None) -> None:
        self.block_size = check_block_size(block_size)
        _cbor(extra)  # fail now, not half-way through a feed
        self.extra = extra
        self._parent = _check_parent(root)
        self._pending: list[int] = []
        self.hashes: list[BlockHash] = []

    @property
    def n_tokens(self) -> int:
        """Tokens fed so far (hashed full blocks + pending tail)."""
        return len(self.hashes) * self.block_size + len(self._pending)

    @property
    def pending(self) -> list[int]:
        """Tokens of the not-yet-full block (a copy)."""
        return list(self._pending)

    @property
    def last_hash(self) -> bytes:
        """Hash of the last closed block, or the root if none closed yet."""
        return self._parent

    def feed(self, tokens: Iterable[int]) -> list[BlockHash]:
        """Append tokens; return the hashes of blocks closed by them (possibly empty), in order.

        Validates all tokens before changing state, so a bad token leaves the hasher untouched.
        """
        self._pending.extend(canonical_tokens(tokens))
        closed: list[BlockHash] = []
        b = self.block_size
        start = 0
        while len(self._pending) - start >= b:
            block = self._pending[start : start + b]
            self._parent = hashlib.sha256(_cbor([self._parent, block, self.extra])).digest()
            closed.append(BlockHash(self._parent))
            start += b
        del self._pending[:start]
        self.hashes.extend(closed)
        return closed
