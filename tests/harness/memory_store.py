"""`MemoryStore`: a test double of the workers' `CacheStore` protocol (no master, no node).

Why it exists: the engine unit tests need the store's *semantics* (joint prefix rule, leases,
duplicate-safe immutable puts, typed per-key misses) without processes; fault hooks (`corrupt`, `drop`,
`unreachable`) let a test break exactly one object. Integration tests use the real store; no shipped code
uses this one (a worker without a store gets None).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from kvpool.kvstore.client.async_client import LocatedPrefix, PutItem
from kvpool.kvstore.errors import (
    ObjectNotAdmittedError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
)
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG
from kvpool.kvstore.transport.base import Payload
from kvpool.proto import common_pb2


class MemoryStore:
    """Dict of immutable objects + the joint prefix rule; counts gets/puts for assertions."""

    def __init__(self) -> None:
        self.objects: dict[bytes, bytes] = {}
        self.meta: dict[bytes, common_pb2.ObjectMeta] = {}
        self.leases: dict[str, list[bytes]] = {}
        self.unreachable = False
        self.refuse: set[bytes] = set()  # keys whose puts are answered "not admitted" (admission control)
        self.delay_s = 0.0
        self.gets = 0
        self.puts = 0
        self.batches: list[list[int]] = []  # the object kinds of each batch_put call, in call order
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ fault hooks
    def corrupt(self, key: bytes, offset: int = -1) -> None:
        """Flip one byte of a stored object (its bytes are then wrong, its key still indexed)."""
        data = bytearray(self.objects[key])
        data[offset] ^= 0xFF
        self.objects[key] = bytes(data)

    def drop(self, key: bytes) -> None:
        """Lose an object's bytes but keep it in the index (a node that forgot it)."""
        self.objects[key] = b""

    def _check(self) -> None:
        if self.unreachable:
            raise StoreUnavailableError("memory store marked unreachable")

    async def _wait(self) -> None:
        self._check()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)

    # ------------------------------------------------------------------ CacheStore
    async def match_prefix(
        self,
        block_hashes: Sequence[bytes],
        *,
        tenant: str | None = None,
        require_checkpoint: bool = True,
        acquire: bool = False,
        lease_ms: int | None = None,
        route: bytes | None = None,
        resume: bool = False,  # learning is the real master's: nothing to tell apart here
    ) -> LocatedPrefix:
        await self._wait()
        run, checkpoints = 0, []
        for h in block_hashes:
            if MLA_TAG + bytes(h) not in self.meta:
                break
            run += 1
            if KDA_TAG + bytes(h) in self.meta:
                checkpoints.append(run)
        usable = (checkpoints[-1] if checkpoints else 0) if require_checkpoint else run
        mla = [common_pb2.ObjectLocation(meta=self.meta[MLA_TAG + bytes(h)]) for h in block_hashes[:usable]]
        checkpoint = None
        if require_checkpoint and usable:
            checkpoint = common_pb2.ObjectLocation(meta=self.meta[KDA_TAG + bytes(block_hashes[usable - 1])])
        lease_id = ""
        if acquire and usable:
            lease_id = f"mem:{next(self._ids)}"
            self.leases[lease_id] = [MLA_TAG + bytes(h) for h in block_hashes[:usable]]
        return LocatedPrefix(usable, run, checkpoints, lease_id, 0, mla, checkpoint)

    async def release(self, lease_id: str) -> None:
        self._check()
        self.leases.pop(lease_id, None)

    async def batch_get(self, keys: Sequence[bytes], route: bytes | None = None) -> list[bytes | StoreError]:
        await self._wait()
        out: list[bytes | StoreError] = []
        for key in keys:
            self.gets += 1
            data = self.objects.get(bytes(key))
            out.append(data if data else ObjectNotFoundError(f"{bytes(key)[:8].hex()} not stored"))
        return out

    async def fetch_into(
        self, locations: Sequence[common_pb2.ObjectLocation], outs: Sequence[bytearray]
    ) -> list[int | StoreError]:
        got = await self.batch_get([loc.meta.key for loc in locations])
        results: list[int | StoreError] = []
        for data, out in zip(got, outs, strict=True):
            if isinstance(data, StoreError):
                results.append(data)
            else:
                n = min(len(data), len(out))
                out[:n] = data[:n]
                results.append(n)
        return results

    async def batch_put(self, items: Sequence[PutItem]) -> list[StoreError | None]:
        await self._wait()
        self.batches.append([item.kind for item in items])
        out: list[StoreError | None] = [None] * len(items)
        for i, item in enumerate(items):
            if bytes(item.key) in self.refuse:
                out[i] = ObjectNotAdmittedError(f"put of {bytes(item.key)[:9].hex()}… not admitted")
            elif item.key not in self.meta:  # immutable: a duplicate is a no-op success
                self.puts += 1
                self.meta[bytes(item.key)] = common_pb2.ObjectMeta(
                    key=bytes(item.key),
                    kind=item.kind,
                    size=item.nbytes,
                    tenant=item.tenant or "",
                    parent=item.parent,
                    ttl_ms=item.ttl_ms,
                )
                self.objects[bytes(item.key)] = bytes(Payload.of(item.data).joined())
        return out

    def route_of(self, block_hashes: Sequence[bytes]) -> bytes:
        return b""  # one index: nothing to route

    async def remove(self, keys: Sequence[bytes], route: bytes | None = None) -> int:
        self._check()
        n = 0
        for key in keys:
            n += self.meta.pop(bytes(key), None) is not None
            self.objects.pop(bytes(key), None)
        return n
