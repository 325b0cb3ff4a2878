"""Which store key holds which HiCache page: SGLang's page key, the pool, the rank scope and the salt.

SGLang names a page by a string (the chained hash of its tokens, ``get_hash_str``), the same on every rank.
kvpool keys the page's object by a 32-byte hash of that string under a *namespace root*
(``kvpool.cache.hashing``: ``root_hash(fingerprint, salt)`` and one ``hash_block`` step), so:

- the salt is in the root: another salt derives other keys and reads nothing;
- the fingerprint names whose bytes they are: the model, the pipeline stage, the attention context-parallel
  and decode-context-parallel shard, and, for state SGLang shards across tensor-parallel ranks, the TP rank
  and size. MLA KV (``is_mla_model``: every TP rank holds the same latents) has no TP rank in its root, so
  rank 0 writes a page once and every rank reads it; MHA KV and the Mamba/KDA state pool (TP-sharded even
  beside replicated MLA KV) are keyed per rank;
- the KV page is ``mla_key(h)`` (kind MLA_BLOCK, parent: the previous page's key when known, so the
  master's prefix-aware eviction drops suffixes first), the Mamba/KDA state is ``kda_key(h)`` (kind
  KDA_CHECKPOINT: a checkpoint, a leaf of its block), any other side pool (DSA indexer, SWA, ...) a blob
  ``sglang:<pool>:`` + h hanging on its page (``kvstore.keys``: the tag is the object's kind).

No SGLang import here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import cbor2
from kvpool.cache.hashing import hash_block, root_hash
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.proto import common_pb2

NAMESPACE_VERSION = 1
KV_POOL = "kv"
# pools whose state SGLang shards across TP ranks even when the KV pool is replicated (Kimi's KDA state
# lives in SGLang's Mamba pool): keyed per rank, written by every rank
PER_RANK_POOLS = frozenset({"mamba"})
_BLOB_PREFIX = b"sglang:"


@dataclass(frozen=True, slots=True)
class Identity:
    """The parts of ``HiCacheStorageConfig`` that decide whose bytes a page holds."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    replicated_kv: bool = False  # SGLang's is_mla_model: every TP rank holds the same KV pages

    @classmethod
    def of(cls, config: Any) -> Identity:
        """From an SGLang ``HiCacheStorageConfig`` (read by attribute)."""
        return cls(
            model=str(config.model_name or ""),
            tp_rank=int(config.tp_rank),
            tp_size=int(config.tp_size),
            pp_rank=int(config.pp_rank),
            pp_size=int(config.pp_size),
            cp_rank=int(config.attn_cp_rank),
            cp_size=int(config.attn_cp_size),
            dcp_rank=int(getattr(config, "dcp_rank", 0)),
            dcp_size=int(getattr(config, "dcp_size", 1)),
            replicated_kv=bool(config.is_mla_model),
        )

    @property
    def kv_writer(self) -> bool:
        """Whether this rank writes replicated KV: rank 0 of its DCP group (SGLang: ``is_storage_writer``)."""
        return not self.replicated_kv or self.tp_rank == self.dcp_rank

    def per_rank(self, pool: str) -> bool:
        return pool in PER_RANK_POOLS or not self.replicated_kv


def fingerprint(identity: Identity, per_rank: bool) -> bytes:
    i = identity
    doc = [
        NAMESPACE_VERSION,
        "sglang-hicache",
        i.model,
        [i.pp_rank, i.pp_size],
        [i.cp_rank, i.cp_size],
        [i.dcp_rank, i.dcp_size],
        [i.tp_rank, i.tp_size] if per_rank else None,
    ]
    return hashlib.sha256(cbor2.dumps(doc, canonical=True)).digest()


class KeySpace:
    """Store keys of one rank's pages under one salt."""

    def __init__(self, identity: Identity, salt: str) -> None:
        self.identity = identity
        self._shared = root_hash(fingerprint(identity, per_rank=False), salt)
        self._ranked = root_hash(fingerprint(identity, per_rank=True), salt)

    def page_hash(self, key: str, pool: str = KV_POOL) -> bytes:
        root = self._ranked if self.identity.per_rank(pool) else self._shared
        return hash_block(root, (), key)

    def object_key(self, key: str, pool: str = KV_POOL) -> tuple[bytes, int]:
        """The store key of ``pool``'s object for page ``key``, and its kind."""
        h = self.page_hash(key, pool)
        if pool == KV_POOL:
            return mla_key(h), common_pb2.MLA_BLOCK
        if pool in PER_RANK_POOLS:
            return kda_key(h), common_pb2.KDA_CHECKPOINT
        return _BLOB_PREFIX + pool.encode() + b":" + h, common_pb2.BLOB

    def parent(self, key: str, pool: str, previous: str | None) -> bytes:
        """What the object depends on in the store's index: a KV page on the page before it (``previous``,
        when the caller knows it), a side-pool blob on its own KV page; a state object on nothing named
        here (the index ties ``kda_key(h)`` to ``mla_key(h)`` itself)."""
        if pool == KV_POOL:
            return mla_key(self.page_hash(previous, KV_POOL)) if previous is not None else b""
        if pool in PER_RANK_POOLS:
            return b""
        return mla_key(self.page_hash(key, KV_POOL))
