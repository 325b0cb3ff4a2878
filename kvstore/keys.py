"""Object keys in the store: a one-byte kind tag followed by the 32-byte block hash that closes the object.

The store treats keys as opaque bytes; only this module knows how a block hash becomes a key, so the
master's prefix index, the simulator, prefill and decode all derive the same keys (overview §3).
"""

from __future__ import annotations

HASH_BYTES = 32
MLA_TAG = b"M"  # MLA latents of one block
KDA_TAG = b"K"  # KDA checkpoint at the end of a block
TAIL_TAG = b"T"  # request-scoped tail (partial block + state at prompt end)


class BadKeyError(ValueError):
    """A key or block hash does not have the expected shape."""


def _check_hash(block_hash: bytes) -> bytes:
    if len(block_hash) != HASH_BYTES:
        raise BadKeyError(f"block hash must be {HASH_BYTES} bytes, got {len(block_hash)}")
    return bytes(block_hash)


def mla_key(block_hash: bytes) -> bytes:
    """Key of the MLA block closed by ``block_hash``."""
    return MLA_TAG + _check_hash(block_hash)


def kda_key(block_hash: bytes) -> bytes:
    """Key of the KDA checkpoint taken at the end of the block ``block_hash`` closes."""
    return KDA_TAG + _check_hash(block_hash)


def tail_key(request_id: str) -> bytes:
    """Key of a request-scoped tail object."""
    if not request_id:
        raise BadKeyError("request id must be non-empty")
    return TAIL_TAG + request_id.encode()


def block_tag(key: bytes) -> bytes | None:
    """``MLA_TAG`` or ``KDA_TAG`` when ``key`` is a block key (the tag + a block hash), else None. The tag
    is an object's kind: the index refuses an object whose declared kind disagrees with it."""
    tag = key[:1]
    return tag if len(key) == 1 + HASH_BYTES and tag in (MLA_TAG, KDA_TAG) else None
