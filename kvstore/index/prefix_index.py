"""PrefixIndex: the master's in-memory object index, prefix matcher, pin table and byte-based evictor.

Pure and deterministic: no gRPC, no threads, no wall clock (``clock`` is injected), so the master service
and the offline trace simulator (``kvpool replay --sim``) run the very same code and agree on hit rates.
Not thread-safe: the master serialises calls behind one lock.

API (all sizes in bytes, all durations in ms, ``now`` always from ``clock()`` in seconds)::

    idx = PrefixIndex(policy="lru", high_watermark=0.95, low_watermark=0.85, lease_ms=5000, clock=fn)
    idx.add_node(node_id, dram_bytes, ssd_bytes=0)      # capacity per node and tier; re-adding updates it
    idx.remove_node(node_id) -> list[Removal]           # node died: every object on it leaves the index
    idx.place(size, tier=Tier.DRAM) -> node_id          # most free bytes first (CapacityError if none fits)
    idx.insert(key, kind, size, node_id=None, tier=Tier.DRAM, tenant="", parent=b"", checksum=0,
               ttl_ms=0, pending=False, evict=True, avoid_node=None) -> node_id
                                                        # pending=True: reserved, invisible until commit()
    idx.commit(key); idx.remove(key, reason="removed") -> bool
    idx.reserve(objects)                                # size once for a bulk load (a node's inventory)
    idx.match_prefix(block_hashes, require_checkpoint=True, touch=False) -> PrefixMatch
    idx.lookup(keys, touch=False) -> list[ObjectInfo | None]; idx.get(key) -> ObjectInfo | None
    idx.acquire(keys, lease_ms=None) -> Lease | None; idx.release(lease_id) -> bool     # read pins
    idx.pin(keys, ttl_ms) -> int                        # soft pin; ttl_ms=0 unpins
    idx.set_quota(tenant, max_bytes)                    # 0 = unlimited
    idx.expire() -> list[Removal]                       # retire due leases, pins and TTLs now
    idx.evict() -> list[Removal]                        # watermark pass over every pool (insert does it too)
    idx.drain_events() -> list[Removal]                 # what nodes must do: delete or demote (keep_events)
    idx.stats() -> IndexStats

Rules:

- **Joint prefix rule.** ``match_prefix`` returns the largest p such that MLA blocks [0, p) are all
  committed and a KDA checkpoint keyed by h_{p-1} is committed (p = 0 always usable); with
  ``require_checkpoint=False`` p is the plain MLA run. Lookups never pin and never change recency unless
  ``touch=True`` says the caller really used the objects (a fetch) — probes cannot starve eviction.
- **Dependencies.** An MLA block depends on its ``parent`` (previous MLA block); a KDA checkpoint keyed by
  h_i depends on the MLA block h_i (without it the checkpoint is unusable); a tail/blob depends on its
  ``parent`` if given. ``deps[slot]`` counts live dependents; nothing with dependents is ever *evicted*
  (dropped by pressure), so the cache is always a forest of usable prefixes: leaves and suffixes go first,
  and a checkpoint is always a leaf, so dropping one invalidates nothing else. Explicit removal, TTL
  expiry and node loss may orphan dependents; they stay correct (matching stops at the gap) and are
  re-linked if the missing object comes back.
- **Eviction by bytes**, per (node, tier) pool: when a pool passes ``high_watermark`` x capacity it is
  drained to ``low_watermark`` in policy order (``kvstore.eviction``). A DRAM pool on a node with an SSD
  tier demotes instead (the object stays indexed with tier SSD, the SSD pool has its own watermark and
  drops leaves). Leased, soft-pinned and pending objects are never candidates.
- **Quotas**: a tenant whose bytes would exceed its quota drops its own evictable objects first; if that
  is not enough the insert raises :class:`QuotaExceededError`.

Memory: struct-of-arrays. Per object: one ``dict`` entry key -> slot (the key bytes object is shared with
the slot's reverse list and with dependents' anchor references), two list pointers, and 45 bytes of
numpy columns. Tenants and node ids are interned to 16-bit ids; children are counted, not listed.

Where the parts live: ``records`` (kinds, tiers, errors, returned records, column store), ``state`` (slots,
nodes, tenants and the slot operations), ``evictor`` (expiry, watermarks, quotas, demotion) and this module
(the public calls: writes, reads, prefix matching, pins and leases).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

import numpy as np
from kvpool.kvstore.index.evictor import IndexEviction
from kvpool.kvstore.index.records import (
    SLOT_CKPT,
    SLOT_LIVE,
    SLOT_PENDING,
    SLOT_PINNED,
    BadObjectError,
    CapacityError,
    DuplicateKeyError,
    IndexStats,
    Lease,
    LocationRow,
    NotAdmittedError,
    ObjectInfo,
    ObjectKind,
    PrefixMatch,
    QuotaExceededError,
    Tier,
    UnknownKeyError,
)
from kvpool.kvstore.keys import HASH_BYTES, KDA_TAG, MLA_TAG


class PrefixIndex(IndexEviction):
    """Object index + prefix matcher + pins + eviction. See the module docstring for the rules."""

    # ------------------------------------------------------------------ nodes and placement

    # ------------------------------------------------------------------ writes

    def reserve(self, objects: int) -> None:
        """Make room for ``objects`` more inserts at once (a node's inventory: its size is known up front).

        Why: one-by-one growth (x1.5 columns, list over-allocation, each step copying and freeing the old
        arrays) leaves up to half a column of slack and a trail of freed blocks in the C heap; sized exactly
        once, a bulk adoption allocates every column and slot list a single time. Recycled slots count."""
        need = self._n + max(0, objects - len(self._free))
        if need > self._cols.capacity:
            self._cols.grow(exact=need)
        if need > len(self._keys):
            more = need - len(self._keys)
            self._keys.extend(itertools.repeat(None, more))
            self._anchors.extend(itertools.repeat(None, more))

    def insert(
        self,
        key: bytes,
        kind: ObjectKind,
        size: int,
        *,
        node_id: str | None = None,
        tier: Tier = Tier.DRAM,
        tenant: str = "",
        parent: bytes = b"",
        checksum: int = 0,
        ttl_ms: int = 0,
        pending: bool = False,
        evict: bool = True,
        avoid_node: str | None = None,
    ) -> str:
        """Index an object on a node (placed by free space if ``node_id`` is None); returns the node id.

        Makes room first (quota, then pool capacity) and runs the watermark pass after, so the index never
        holds more than a pool's capacity. ``pending=True`` reserves the bytes for a two-phase put.
        ``evict=False`` (adopting a node's inventory) skips quotas and eviction until the caller runs
        :meth:`evict` once the whole inventory is in, so no block is judged a leaf before its children
        have arrived; it still refuses to overfill a pool.
        """
        kind = self._check_object(key, kind, size, ttl_ms, checksum)
        if key in self._slot or key in self._pending:
            raise DuplicateKeyError(key, key in self._pending)
        now = self._clock()
        self._retire_due(now)
        if evict and self.admission is not None and kind in (ObjectKind.MLA, ObjectKind.KDA):
            self._admit(key, kind, size, parent)
        tid = self._tenant_id(tenant)
        quota = self._quota.get(tid, 0) if evict else 0
        if quota:
            if size > quota:
                raise QuotaExceededError(f"object of {size} bytes exceeds tenant {tenant!r} quota {quota}")
            if self._tenant_bytes.get(tid, 0) + size > quota:
                self._evict_tenant(tid, quota - size, now)
                if self._tenant_bytes.get(tid, 0) + size > quota:
                    raise QuotaExceededError(
                        f"tenant {tenant!r} holds {self._tenant_bytes.get(tid, 0)} of {quota} bytes, "
                        f"all pinned or in use; cannot fit {size}"
                    )
        if node_id is None:
            node_id = self.place(size, tier, avoid_node)
        node = self._node(node_id)
        nid = self._node_ids[node_id]
        if size > node.capacity[tier]:
            raise CapacityError(f"object of {size} bytes exceeds {tier.name} capacity of node {node_id!r}")
        cap = node.capacity[tier]
        if not (self._make_room(nid, tier, size, now) if evict else node.used[tier] + size <= cap):
            raise CapacityError(
                f"node {node_id!r} {tier.name}: {node.used[tier]} of {node.capacity[tier]} bytes held by "
                f"pinned/leased/pending objects; cannot fit {size}"
            )
        slot = self._alloc_slot()
        c = self._cols
        c.kind[slot] = kind
        c.tier[slot] = tier
        c.flags[slot] = SLOT_LIVE | (SLOT_PENDING if pending else 0)
        c.tenant[slot] = tid
        c.node[slot] = nid
        c.leases[slot] = 0
        c.size[slot] = size
        c.checksum[slot] = checksum
        c.last_use[slot] = now
        c.freq[slot] = 1.0  # a write is the first use, identical under every policy (no per-insert call)
        deps = c.deps[slot] = self._orphans.pop(key, 0)
        self._link_anchor(slot, key, kind, parent)
        (self._pending if pending else self._slot)[key] = slot
        self._keys[slot] = key
        if kind != ObjectKind.KDA and len(key) == 1 + HASH_BYTES and key[:1] == KDA_TAG:
            self._odd_twins += 1
        if not pending:
            self._mark_checkpoint(slot, key, deps)
        node.used[tier] += size
        self._tenant_bytes[tid] = self._tenant_bytes.get(tid, 0) + size
        if ttl_ms:
            self._set_ttl(slot, key, now + ttl_ms / 1000.0)
        if evict:
            self._evict_pool(nid, tier, now, protect=slot)
        return node_id

    def _admit(self, key: bytes, kind: ObjectKind, size: int, parent: bytes) -> None:
        """Raise NotAdmittedError when admission turns the object away. Unticketed objects follow their
        chain: an MLA block whose parent, or a checkpoint whose own block, was refused and is not cached
        is refused too (it could never be part of a usable prefix)."""
        adm = self.admission
        assert adm is not None
        h = key[1:]
        if kind == ObjectKind.MLA:
            hangs_on = parent if len(parent) == 1 + HASH_BYTES and parent[:1] == MLA_TAG else b""
        else:
            hangs_on = MLA_TAG + h

        def chain_refused() -> bool:
            return bool(hangs_on) and self._find(hangs_on) is None and adm.was_refused(hangs_on[1:])

        if not adm.admit(h, size, chain_refused):
            raise NotAdmittedError(f"{kind.name} object {key[:9].hex()}… not admitted")

    def commit(self, key: bytes, checksum: int | None = None) -> None:
        """Make a pending object visible (second phase of a put); ``checksum`` when the writer declares it
        only now (it hashed the bytes while copying them)."""
        if checksum is not None and not 0 < checksum < 1 << 64:
            raise BadObjectError("a checksum declared at commit must be in 1 .. 2^64-1")
        slot = self._pending.pop(key, None)
        if slot is None:
            raise UnknownKeyError(f"no pending put for key {key[:9].hex()}…")
        if checksum is not None:
            self._cols.checksum[slot] = checksum
        self._cols.flags[slot] &= ~np.uint8(SLOT_PENDING)
        self._slot[key] = slot
        self._mark_checkpoint(slot, key, int(self._cols.deps[slot]))
        now = self._clock()
        self._cols.last_use[slot] = now  # recency counts from visibility; the write was the one use
        # never evict what was just written: the writer has not even been told it succeeded
        self._evict_pool(int(self._cols.node[slot]), Tier(int(self._cols.tier[slot])), now, protect=slot)

    def remove(self, key: bytes, reason: str = "removed") -> bool:
        """Drop an object (committed or pending) regardless of pins; False if it was not indexed."""
        slot = self._slot.get(key)
        if slot is None:
            slot = self._pending.get(key)
        if slot is None:
            return False
        self._drop(slot, reason, emit=False)
        return True

    def set_quota(self, tenant: str, max_bytes: int) -> None:
        """Cap a tenant's indexed bytes (all tiers, pending included); 0 removes the cap.

        A tenant already above the new cap loses its own evictable objects now (as far as they go)."""
        if max_bytes < 0:
            raise BadObjectError("quota must be >= 0")
        tid = self._tenant_id(tenant)
        if max_bytes:
            self._quota[tid] = max_bytes
            if self._tenant_bytes.get(tid, 0) > max_bytes:
                now = self._clock()
                self._retire_due(now)
                self._evict_tenant(tid, max_bytes, now)
        else:
            self._quota.pop(tid, None)

    def promote(self, key: bytes) -> bool:
        """Move a committed SSD object back to DRAM on its node (promotion on a real hit), demoting or
        dropping colder DRAM objects to make room. False if it is not on SSD or DRAM cannot take it."""
        slot = self._slot.get(key)
        c = self._cols
        if slot is None or c.tier[slot] != Tier.SSD:
            return False
        nid = int(c.node[slot])
        node = self._nodes[nid]
        size = int(c.size[slot])
        if size > node.capacity[Tier.DRAM]:
            return False
        now = self._clock()
        c.tier[slot] = Tier.DRAM
        node.used[Tier.SSD] -= size
        node.used[Tier.DRAM] += size
        self._evict_pool(nid, Tier.DRAM, now, protect=slot)
        if node.used[Tier.DRAM] > node.capacity[Tier.DRAM]:  # everything else pinned: undo
            c.tier[slot] = Tier.SSD
            node.used[Tier.DRAM] -= size
            node.used[Tier.SSD] += size
            return False
        return True

    # ------------------------------------------------------------------ reads

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    def match_prefix(
        self, block_hashes: Sequence[bytes], *, require_checkpoint: bool = True, touch: bool = False
    ) -> PrefixMatch:
        """Longest usable prefix of a hash chain (joint rule), the plain MLA run and the checkpoints in it.

        ``touch=True`` marks the usable objects as used (recency/frequency); plain lookups must leave it
        False so that probing never keeps objects alive.
        """
        # One dict probe per block: whether KDA_TAG + h is committed too is the SLOT_CKPT bit of the MLA slot,
        # read for the whole run with one numpy gather (half the key building and hashing of probing both).
        get = self._slot.get
        keys: list[bytes] = []
        found: list[int] = []
        for h in block_hashes:
            if len(h) != HASH_BYTES:
                raise BadObjectError(f"block hash must be {HASH_BYTES} bytes, got {len(h)}")
            mk = MLA_TAG + h
            s = get(mk)
            if s is None:
                break
            keys.append(mk)
            found.append(s)
        run = len(keys)
        if run:
            mla = np.array(found, dtype=np.int64)
            checkpoints = (np.flatnonzero(self._cols.flags[mla] & SLOT_CKPT) + 1).tolist()
        else:
            checkpoints = []
        if require_checkpoint:
            usable = checkpoints[-1] if checkpoints else 0
            ck = KDA_TAG + keys[usable - 1][1:] if usable else None
        else:
            usable, ck = run, None
        used = tuple(keys[:usable])
        if touch and self.admission is not None:  # the writer's fetch: it will put what it missed
            self.admission.on_lookup(block_hashes, run, self.capacity_of())
        if touch and usable:
            idx = mla[:usable]
            if ck is not None:
                idx = np.append(idx, self._slot[ck])
            self.policy.touch(self._cols, idx, self._clock())
        return PrefixMatch(usable, run, tuple(checkpoints), used, ck)

    def get(self, key: bytes) -> ObjectInfo | None:
        """Info on a committed or pending object, None if absent. Never changes recency."""
        slot = self._slot.get(key)
        if slot is None:
            slot = self._pending.get(key)
        return None if slot is None else self._info(slot)

    def rows(self, keys: Sequence[bytes]) -> list[LocationRow]:
        """Compact location rows of committed keys (absent keys skipped), built column-wise: the fast
        path for replies listing thousands of blocks. Never changes recency."""
        found = [(k, s) for k, s in ((k, self._slot.get(k)) for k in keys) if s is not None]
        if not found:
            return []
        c = self._cols
        idx = np.fromiter((s for _, s in found), dtype=np.int64, count=len(found))
        kinds, sizes, sums = c.kind[idx].tolist(), c.size[idx].tolist(), c.checksum[idx].tolist()
        tiers, nodes, tenants = c.tier[idx].tolist(), c.node[idx].tolist(), c.tenant[idx].tolist()
        names, tnames, ttl = self._node_names, self._tenants, self._ttl
        now = self._clock() if ttl else 0.0
        return [
            LocationRow(
                key,
                kinds[i],
                sizes[i],
                sums[i],
                tnames[tenants[i]],
                tiers[i],
                names[nodes[i]],
                max(1, int((ttl[slot] - now) * 1000)) if slot in ttl else 0,
            )
            for i, (key, slot) in enumerate(found)
        ]

    def count_on_tier(self, keys: Sequence[bytes], tier: Tier) -> int:
        """How many of the committed ``keys`` sit on ``tier`` (routers credit SSD hits less)."""
        slots = [s for s in map(self._slot.get, keys) if s is not None]
        if not slots:
            return 0
        return int(np.count_nonzero(self._cols.tier[np.array(slots, dtype=np.int64)] == tier))

    def lookup(self, keys: Iterable[bytes], *, touch: bool = False) -> list[ObjectInfo | None]:
        """Info on committed objects in order (None where absent); ``touch`` as in match_prefix."""
        out: list[ObjectInfo | None] = []
        used: list[int] = []
        for key in keys:
            slot = self._slot.get(key)
            if slot is None:
                out.append(None)
            else:
                used.append(slot)
                out.append(self._info(slot))
        if touch and used:
            self.policy.touch(self._cols, np.array(used, dtype=np.int64), self._clock())
        return out

    def touch(self, keys: Iterable[bytes]) -> int:
        """Record a real use of committed objects; returns how many were found."""
        used = [s for s in (self._slot.get(k) for k in keys) if s is not None]
        if used:
            self.policy.touch(self._cols, np.array(used, dtype=np.int64), self._clock())
        return len(used)

    # ------------------------------------------------------------------ pins and leases

    def acquire(self, keys: Iterable[bytes], lease_ms: int | None = None) -> Lease | None:
        """Read-pin the committed objects among ``keys`` until released or the deadline; None if none."""
        found = [(k, s) for k, s in ((k, self._slot.get(k)) for k in keys) if s is not None]
        if not found:
            return None
        ms = lease_ms or self.lease_ms
        slots = np.unique(np.array([s for _, s in found], dtype=np.int64))
        self._cols.leases[slots] += 1
        lease_id = next(self._lease_ids)
        deadline = self._clock() + ms / 1000.0
        self._leases[lease_id] = (deadline, slots)
        heapq.heappush(self._lease_heap, (deadline, lease_id))
        return Lease(lease_id, deadline, tuple(k for k, _ in found))

    def release(self, lease_id: int) -> bool:
        """End a lease early (the fetch finished); False if unknown or already expired."""
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            return False
        slots = entry[1]
        c = self._cols
        c.leases[slots] -= 1
        # slots whose object was dropped while leased are reusable only once the last lease lets go
        for s in slots[(c.leases[slots] == 0) & ((c.flags[slots] & SLOT_LIVE) == 0)]:
            self._free.append(int(s))
        return True

    def pin(self, keys: Iterable[bytes], ttl_ms: int) -> int:
        """Soft-pin committed objects for ``ttl_ms`` (0 unpins): they are not evicted while pinned."""
        now = self._clock()
        count = 0
        for key in keys:
            slot = self._slot.get(key)
            if slot is None:
                continue
            count += 1
            if ttl_ms:
                self._pins[slot] = now + ttl_ms / 1000.0
                self._cols.flags[slot] |= np.uint8(SLOT_PINNED)
            else:
                self._unpin(slot)
        return count

    # ------------------------------------------------------------------ time and eviction

    def stats(self) -> IndexStats:
        c, n = self._cols, self._n
        live = (c.flags[:n] & SLOT_LIVE) != 0
        tiers = {t.name: int(c.size[:n][live & (c.tier[:n] == t)].sum()) for t in Tier}
        return IndexStats(
            objects=len(self._slot),
            pending=len(self._pending),
            bytes=int(c.size[:n][live].sum()),
            capacity_bytes=sum(node.capacity[t] for node in self._nodes.values() for t in Tier),
            nodes=len(self._nodes),
            active_leases=len(self._leases),
            soft_pins=len(self._pins),
            evictions=self._evictions,
            evicted_bytes=self._evicted_bytes,
            demotions=self._demotions,
            expired=self._expired,
            bytes_per_tier=tiers,
            bytes_per_tenant={self._tenants[t]: b for t, b in self._tenant_bytes.items() if b},
            policy=self.policy.name,
        )

    # ------------------------------------------------------------------ internals
