"""Which store key holds which LMCache object.

LMCache names an object by an ``ObjectKey``: the chunk's hash (32 bytes, chained over the prompt's chunks),
the model, the engine's rank (``kv_rank``: world size, global rank, local world size and local rank in one
int), the object group (a KV-cache group of a hybrid model) and the request's ``cache_salt``. Every field
decides whose bytes the object holds, so all of them, with the adapter's own ``salt``, go into one SHA-256:
the store key is ``lmcache:`` + that digest (kind BLOB: LMCache chunks are not kvpool's MLA blocks, and
their prefix order is LMCache's business, not the master's). Another salt, model, rank or group derives
other keys and reads nothing.

No LMCache import here: keys are read by attribute.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

NAMESPACE = b"kvpool-lmcache/1"
PREFIX = b"lmcache:"


def store_key(key: Any, salt: str) -> bytes:
    """The store key of LMCache ``ObjectKey`` ``key`` under the adapter's ``salt``. A key whose fields are
    not what LMCache sends (a hash that is not bytes, a rank that is not an int) is ``TypeError``."""
    chunk = key.chunk_hash
    if not isinstance(chunk, bytes | bytearray):
        raise TypeError(f"chunk_hash must be bytes, got {type(chunk).__name__}")
    fields = [
        salt,
        str(key.model_name),
        int(key.kv_rank),
        int(key.object_group_id),
        str(key.cache_salt or ""),
        bytes(chunk),
    ]
    return PREFIX + hashlib.sha256(NAMESPACE + msgpack.packb(fields)).digest()
