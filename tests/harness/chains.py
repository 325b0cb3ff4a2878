"""Deterministic 32-byte hash chains for store tests: ``h_i = sha256(h_{i-1} || i)`` from a seed.

Real block hashes (``kvpool.cache.hashing``) need a model fingerprint and tokens; the store needs only
distinct, chained 32-byte keys, and a seed per test keeps chains from colliding.
"""

from __future__ import annotations

import hashlib


def chain(n: int, seed: str = "c") -> list[bytes]:
    """``n`` chained block hashes starting from ``seed``."""
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out
