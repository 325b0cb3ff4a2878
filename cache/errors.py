"""Typed errors of the cache layer.

Callers treat every ``CacheUnitError`` as a cache miss (recompute from the last good boundary, count it) and
never as a crash, so the decoder raises only these for anything wrong with the bytes it is given. The
subclasses exist so that metrics and logs can tell a flipped bit from a stale model or a layout change.
"""

from __future__ import annotations


class CacheUnitError(Exception):
    """A cache unit cannot be used: treat it as a miss."""


class CorruptUnitError(CacheUnitError):
    """Bad magic, truncated or oversized buffer, unparsable header, or checksum mismatch."""


class UnsupportedVersionError(CacheUnitError):
    """The unit was written with a wire format version this reader does not understand."""


class FingerprintMismatchError(CacheUnitError):
    """The unit was written by another model (config or weights differ)."""


class SchemaMismatchError(CacheUnitError):
    """Kind, layer ids, shapes, dtypes or layout differ from the reader's ``CacheSchema``."""


class PositionMismatchError(CacheUnitError):
    """The unit is intact and for this model, but for another block, token count, block hash or token run."""


class HashInputError(ValueError):
    """Invalid input to the block-hash chain (block size, tokens, fingerprint, salt or an un-encodable extra).

    A ``ValueError``, not a ``CacheUnitError``: this is a caller bug, not a miss.
    """
