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

Why one module of ~900 lines: ``PrefixIndex`` is one data structure whose invariants (slot flags, the
column store, chain anchors, eviction heaps, pins and leases) every method maintains together; split across
files, each part would reach into the others' private columns. Its records and errors live in ``records``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from kvpool.kvstore.index.eviction import EvictionPolicy, make_policy
from kvpool.kvstore.index.records import (
    _CKPT,
    _DEPTH_MAX,
    _LIVE,
    _MAX_INTERNED,
    _PENDING,
    _PINNED,
    MAX_KEY_BYTES,
    BadObjectError,
    CapacityError,
    DuplicateKeyError,
    IndexStats,
    Lease,
    LocationRow,
    ObjectInfo,
    ObjectKind,
    PrefixMatch,
    QuotaExceededError,
    Removal,
    Tier,
    UnknownKeyError,
    UnknownNodeError,
    _anchor_of,
    _Columns,
    _Node,
)
from kvpool.kvstore.keys import HASH_BYTES, KDA_TAG, MLA_TAG


class PrefixIndex:
    """Object index + prefix matcher + pins + eviction. See the module docstring for the rules."""

    def __init__(
        self,
        policy: str | EvictionPolicy = "lru",
        *,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        lease_ms: int = 5000,
        clock: Callable[[], float] = time.monotonic,
        keep_events: bool = True,
        initial_capacity: int = 1024,
    ) -> None:
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}"
            )
        if lease_ms <= 0:
            raise ValueError("lease_ms must be > 0")
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.lease_ms = lease_ms
        self._clock = clock
        self._keep_events = keep_events
        self._cols = _Columns(initial_capacity)
        self._n = 0  # slots ever used; [0, _n) are addressable
        self._free: list[int] = []
        self._keys: list[bytes | None] = []
        self._anchors: list[bytes | None] = []
        self._slot: dict[bytes, int] = {}  # committed objects
        self._pending: dict[bytes, int] = {}  # two-phase puts not yet committed
        self._orphans: dict[bytes, int] = {}  # absent anchor key -> live dependents waiting for it
        self._odd_twins = 0  # live objects keyed KDA_TAG + hash whose kind is not KDA (see _mark_checkpoint)
        self._tenants: list[str] = [""]
        self._tenant_ids: dict[str, int] = {"": 0}
        self._tenant_bytes: dict[int, int] = {}
        self._quota: dict[int, int] = {}
        self._nodes: dict[int, _Node] = {}
        self._node_names: list[str] = []
        self._node_ids: dict[str, int] = {}
        self._pins: dict[int, float] = {}  # slot -> soft pin deadline
        self._ttl: dict[int, float] = {}  # slot -> expiry deadline
        self._ttl_heap: list[tuple[float, int, bytes]] = []
        self._leases: dict[int, tuple[float, np.ndarray]] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)
        self._events: list[Removal] = []
        self._evictions = 0
        self._evicted_bytes = 0
        self._demotions = 0
        self._expired = 0

    # ------------------------------------------------------------------ nodes and placement

    def add_node(self, node_id: str, dram_bytes: int, ssd_bytes: int = 0) -> None:
        """Add a node or update its capacities (objects stay)."""
        if not node_id:
            raise BadObjectError("node id must be non-empty")
        if dram_bytes < 0 or ssd_bytes < 0:
            raise BadObjectError("capacities must be >= 0")
        nid = self._node_ids.get(node_id)
        if nid is None:
            if len(self._node_names) > _MAX_INTERNED:
                raise CapacityError("too many node ids")
            nid = len(self._node_names)
            self._node_names.append(node_id)
            self._node_ids[node_id] = nid
        node = self._nodes.get(nid)
        if node is None:
            self._nodes[nid] = _Node(node_id, {Tier.DRAM: dram_bytes, Tier.SSD: ssd_bytes})
        else:
            node.capacity = {Tier.DRAM: dram_bytes, Tier.SSD: ssd_bytes}

    def has_node(self, node_id: str) -> bool:
        nid = self._node_ids.get(node_id)
        return nid is not None and nid in self._nodes

    def node_ids(self) -> list[str]:
        return [n.node_id for n in self._nodes.values()]

    def node_usage(self, node_id: str) -> dict[Tier, tuple[int, int]]:
        """(used, capacity) bytes per tier."""
        node = self._node(node_id)
        return {t: (node.used[t], node.capacity[t]) for t in Tier}

    def remove_node(self, node_id: str) -> list[Removal]:
        """Drop the node and every object on it (reason ``node_lost``); returns what was dropped."""
        nid = self._node_ids.get(node_id)
        if nid is None or nid not in self._nodes:
            raise UnknownNodeError(node_id)
        c, n = self._cols, self._n
        slots = np.flatnonzero((c.node[:n] == nid) & ((c.flags[:n] & _LIVE) != 0))
        dropped = [self._drop(int(s), "node_lost", emit=False) for s in slots]
        del self._nodes[nid]
        return dropped

    def place(self, size: int, tier: Tier = Tier.DRAM, avoid: str | None = None) -> str:
        """The node with the most free bytes in ``tier`` whose capacity can hold ``size``; ``avoid`` is
        chosen only when no other node can hold it."""
        best: _Node | None = None
        best_key = (False, -1)
        for node in self._nodes.values():
            cap = node.capacity[tier]
            key = (node.node_id != avoid, cap - node.used[tier])
            if cap >= size and key > best_key:
                best, best_key = node, key
        if best is None:
            raise CapacityError(f"no node has {tier.name} capacity for an object of {size} bytes")
        return best.node_id

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
        c.flags[slot] = _LIVE | (_PENDING if pending else 0)
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

    def commit(self, key: bytes) -> None:
        """Make a pending object visible (second phase of a put)."""
        slot = self._pending.pop(key, None)
        if slot is None:
            raise UnknownKeyError(f"no pending put for key {key[:9].hex()}…")
        self._cols.flags[slot] &= ~np.uint8(_PENDING)
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
        # One dict probe per block: whether KDA_TAG + h is committed too is the _CKPT bit of the MLA slot,
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
            checkpoints = (np.flatnonzero(self._cols.flags[mla] & _CKPT) + 1).tolist()
        else:
            checkpoints = []
        if require_checkpoint:
            usable = checkpoints[-1] if checkpoints else 0
            ck = KDA_TAG + keys[usable - 1][1:] if usable else None
        else:
            usable, ck = run, None
        used = tuple(keys[:usable])
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
        for s in slots[(c.leases[slots] == 0) & ((c.flags[slots] & _LIVE) == 0)]:
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
                self._cols.flags[slot] |= np.uint8(_PINNED)
            else:
                self._unpin(slot)
        return count

    # ------------------------------------------------------------------ time and eviction

    def expire(self) -> list[Removal]:
        """Retire everything due now (leases, soft pins, TTLs); returns the objects dropped by TTL."""
        before = len(self._events)
        removed = self._retire_due(self._clock())
        if not self._keep_events:
            del self._events[before:]
        return removed

    def evict(self) -> list[Removal]:
        """Run the watermark pass on every pool; returns the removals/demotions it made."""
        now = self._clock()
        self._retire_due(now)
        start = len(self._events)
        keep = self._keep_events
        self._keep_events = True
        try:
            for nid, node in list(self._nodes.items()):
                for tier in Tier:
                    if node.capacity[tier]:
                        self._evict_pool(nid, tier, now)
            out = self._events[start:]
        finally:
            self._keep_events = keep
        if not keep:
            del self._events[start:]
        return out

    def drain_events(self) -> list[Removal]:
        """Removals/demotions since the last drain that the owning nodes must carry out."""
        out, self._events = self._events, []
        return out

    def stats(self) -> IndexStats:
        c, n = self._cols, self._n
        live = (c.flags[:n] & _LIVE) != 0
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

    def _node(self, node_id: str) -> _Node:
        nid = self._node_ids.get(node_id)
        node = None if nid is None else self._nodes.get(nid)
        if node is None:
            raise UnknownNodeError(f"unknown node {node_id!r}")
        return node

    def _tenant_id(self, tenant: str) -> int:
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            if len(self._tenants) > _MAX_INTERNED:
                raise QuotaExceededError("too many tenants")
            tid = len(self._tenants)
            self._tenants.append(tenant)
            self._tenant_ids[tenant] = tid
        return tid

    @staticmethod
    def _check_object(
        key: bytes, kind: ObjectKind | int, size: int, ttl_ms: int, checksum: int
    ) -> ObjectKind:
        if not key or len(key) > MAX_KEY_BYTES:
            raise BadObjectError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        try:
            kind = ObjectKind(kind)
        except ValueError:
            raise BadObjectError(f"unknown object kind {kind}") from None
        if kind in (ObjectKind.MLA, ObjectKind.KDA):
            tag = MLA_TAG if kind == ObjectKind.MLA else KDA_TAG
            if len(key) != 1 + HASH_BYTES or key[:1] != tag:
                raise BadObjectError(f"{kind.name} key must be {tag!r} + {HASH_BYTES}-byte hash")
        if size <= 0:
            raise BadObjectError(f"size must be > 0, got {size}")
        if kind == ObjectKind.TAIL and ttl_ms <= 0:
            raise BadObjectError("a request tail must have a TTL")
        if ttl_ms < 0 or checksum < 0 or checksum >= 1 << 64:
            raise BadObjectError("ttl_ms and checksum must be non-negative (checksum < 2^64)")
        return kind

    def _find(self, key: bytes) -> int | None:
        slot = self._slot.get(key)
        return self._pending.get(key) if slot is None else slot

    def _mark_checkpoint(self, slot: int, key: bytes, deps: int) -> None:
        """Keep the _CKPT bit true as ``key`` becomes committed (``deps``: its dependents now): set on an
        MLA-tagged slot whose KDA-tagged twin is committed, or on the committed MLA-tagged twin of a
        KDA-tagged key. By key tag, not kind, exactly like the lookups match_prefix used to make.

        A pending or fresh slot never has the bit (insert writes the flags, _drop clears them). A KDA object
        depends on its MLA block, so a committed KDA twin means ``deps`` > 0; only a twin of another kind
        (``_odd_twins``, a blob under a KDA-tagged key) forces the lookup when there are no dependents. This
        keeps the common insert (a new leaf block) free of building and hashing a second key."""
        if len(key) != 1 + HASH_BYTES:
            return
        tag = key[:1]
        if tag == MLA_TAG:
            if (deps or self._odd_twins) and KDA_TAG + key[1:] in self._slot:
                self._cols.flags[slot] |= np.uint8(_CKPT)
        elif tag == KDA_TAG:
            m = self._slot.get(MLA_TAG + key[1:])
            if m is not None:
                self._cols.flags[m] |= np.uint8(_CKPT)

    def _alloc_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._n == self._cols.capacity:
            self._cols.grow()
        if self._n == len(self._keys):  # else reserve() made the room already
            self._keys.append(None)
            self._anchors.append(None)
        self._n += 1
        return self._n - 1

    def _link_anchor(self, slot: int, key: bytes, kind: ObjectKind, parent: bytes) -> None:
        anchor = _anchor_of(key, kind, parent)
        c = self._cols
        depth = 1 if kind == ObjectKind.MLA else 0
        if anchor is not None:
            a = self._find(anchor)
            if a is None:
                anchor = bytes(anchor)
                self._orphans[anchor] = self._orphans.get(anchor, 0) + 1
                depth = 0  # unknown until the chain is complete; policies treat 0 as 1
            else:
                anchor = self._keys[a]  # share the bytes object
                c.deps[a] += 1
                depth = min(int(c.depth[a]) + (1 if kind == ObjectKind.MLA else 0), _DEPTH_MAX)
        c.depth[slot] = depth
        self._anchors[slot] = anchor

    def _set_ttl(self, slot: int, key: bytes, deadline: float) -> None:
        self._ttl[slot] = deadline
        heapq.heappush(self._ttl_heap, (deadline, slot, key))

    def _unpin(self, slot: int) -> None:
        self._pins.pop(slot, None)
        self._cols.flags[slot] &= ~np.uint8(_PINNED)

    def _retire_due(self, now: float) -> list[Removal]:
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            self.release(lease_id)
        for slot in [s for s, until in self._pins.items() if until <= now]:
            self._unpin(slot)
        removed: list[Removal] = []
        heap = self._ttl_heap
        while heap and heap[0][0] <= now:
            deadline, slot, key = heapq.heappop(heap)
            if self._keys[slot] is not key or self._ttl.get(slot) != deadline:
                continue  # stale entry: object gone or slot reused
            if self._cols.leases[slot]:
                heapq.heappush(heap, (now + 0.05, slot, key))  # being read: expire after the fetch
                self._ttl[slot] = now + 0.05
                continue
            self._expired += 1
            removed.append(self._drop(slot, "expired", emit=True))
        return removed

    def _drop(self, slot: int, reason: str, *, emit: bool, demoted: bool = False) -> Removal:
        """Remove a live slot from every structure; the slot is recycled once no lease refers to it."""
        c = self._cols
        key = self._keys[slot]
        assert key is not None
        committed = self._slot.pop(key, None) is not None
        if not committed:
            self._pending.pop(key, None)
        if len(key) == 1 + HASH_BYTES and key[:1] == KDA_TAG:
            if c.kind[slot] != ObjectKind.KDA:
                self._odd_twins -= 1
            m = self._slot.get(MLA_TAG + key[1:]) if committed else None
            if m is not None:
                c.flags[m] &= ~np.uint8(_CKPT)
        anchor = self._anchors[slot]
        if anchor is not None:
            a = self._find(anchor)
            if a is not None:
                c.deps[a] -= 1
            else:
                left = self._orphans[anchor] - 1
                if left:
                    self._orphans[anchor] = left
                else:
                    del self._orphans[anchor]
        if c.deps[slot]:
            self._orphans[key] = int(c.deps[slot])
        size = int(c.size[slot])
        tier = Tier(int(c.tier[slot]))
        nid = int(c.node[slot])
        node = self._nodes.get(nid)
        if node is not None:
            node.used[tier] -= size
        tid = int(c.tenant[slot])
        self._tenant_bytes[tid] -= size
        self._pins.pop(slot, None)
        self._ttl.pop(slot, None)
        c.flags[slot] = 0
        c.deps[slot] = 0
        self._keys[slot] = None
        self._anchors[slot] = None
        if not c.leases[slot]:
            self._free.append(slot)
        event = Removal(key, self._node_names[nid], tier, size, reason, demoted)
        if emit and self._keep_events:
            self._events.append(event)
        return event

    def _candidates(self, mask: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Slots under ``mask`` that may go now, in policy order, with their scores."""
        c, n = self._cols, self._n
        mask &= (c.flags[:n] & (_LIVE | _PENDING | _PINNED)) == _LIVE
        mask &= c.leases[:n] == 0
        cand = np.flatnonzero(mask)
        scores = self.policy.scores(c, cand, now)
        order = np.argsort(scores, kind="stable")
        return cand[order], scores[order]

    def _evictable_leaf(self, slot: int) -> bool:
        c = self._cols
        free = (c.flags[slot] & (_LIVE | _PENDING | _PINNED)) == _LIVE
        return bool(free and not c.leases[slot] and not c.deps[slot])

    def _drain(
        self,
        candidates: tuple[np.ndarray, np.ndarray],
        over: Callable[[], bool],
        act: Callable[[int], bool],
        exposable: Callable[[int], bool],
        now: float,
    ) -> None:
        """Walk candidates in policy order, merging in anchors that become leaves as their last
        dependent goes, until ``over()`` is False. ``act(slot)`` evicts/demotes; True if it dropped it."""
        order, scores = candidates
        exposed: list[tuple[float, int]] = []
        i = 0
        while over():
            if exposed and (i >= len(order) or exposed[0][0] < scores[i]):
                slot = heapq.heappop(exposed)[1]
            elif i < len(order):
                slot = int(order[i])
                i += 1
            else:
                return
            if not self._cols.flags[slot] & _LIVE:
                continue
            anchor = self._anchors[slot]
            if not act(slot) or anchor is None:
                continue
            a = self._slot.get(anchor)
            if a is not None and self._evictable_leaf(a) and exposable(a):
                score = float(self.policy.scores(self._cols, np.array([a]), now)[0])
                heapq.heappush(exposed, (score, a))

    def _evict_pool(self, nid: int, tier: Tier, now: float, protect: int = -1) -> None:
        node = self._nodes[nid]
        cap = node.capacity[tier]
        if node.used[tier] <= self.high_watermark * cap:
            return
        self._shrink_pool(nid, tier, int(self.low_watermark * cap), now, protect)

    def _make_room(self, nid: int, tier: Tier, size: int, now: float) -> bool:
        node = self._nodes[nid]
        cap = node.capacity[tier]
        if node.used[tier] + size <= cap:
            return True
        self._shrink_pool(nid, tier, min(int(self.low_watermark * cap), cap - size), now)
        return node.used[tier] + size <= cap

    def _shrink_pool(self, nid: int, tier: Tier, target: int, now: float, protect: int = -1) -> None:
        """Bring a pool's used bytes down to ``target``: demote DRAM->SSD when the node has SSD, else drop
        leaves (an object with dependents is never dropped by pressure)."""
        c, n = self._cols, self._n
        node = self._nodes[nid]
        demote = tier == Tier.DRAM and node.capacity[Tier.SSD] > 0
        mask = (c.node[:n] == nid) & (c.tier[:n] == tier)
        if not demote:
            mask &= c.deps[:n] == 0
        if 0 <= protect < n:
            mask[protect] = False
        candidates = self._candidates(mask, now)

        def act(slot: int) -> bool:
            if int(c.tier[slot]) != tier:
                return False  # already demoted earlier in this pass
            size = int(c.size[slot])
            if demote and c.kind[slot] != ObjectKind.TAIL and self._make_room(nid, Tier.SSD, size, now):
                if not c.flags[slot] & _LIVE:  # SSD eviction cannot touch DRAM slots, but be safe
                    return False
                c.tier[slot] = Tier.SSD
                node.used[Tier.DRAM] -= size
                node.used[Tier.SSD] += size
                self._demotions += 1
                if self._keep_events:
                    key = self._keys[slot]
                    assert key is not None
                    self._events.append(Removal(key, node.node_id, Tier.DRAM, size, "demoted", True))
                return False
            if c.deps[slot]:
                return False  # demotion impossible and it still has dependents: keep it
            self._evictions += 1
            self._evicted_bytes += size
            self._drop(slot, "evicted", emit=True)
            return True

        def exposable(slot: int) -> bool:
            # when demoting, every object in the pool is a candidate already
            return not demote and int(c.node[slot]) == nid and int(c.tier[slot]) == tier and slot != protect

        self._drain(candidates, lambda: node.used[tier] > target, act, exposable, now)

    def _evict_tenant(self, tid: int, target: int, now: float) -> None:
        """Drop the tenant's own evictable leaves (any pool) until it holds at most ``target`` bytes."""
        c, n = self._cols, self._n
        candidates = self._candidates((c.tenant[:n] == tid) & (c.deps[:n] == 0), now)

        def act(slot: int) -> bool:
            self._evictions += 1
            self._evicted_bytes += int(c.size[slot])
            self._drop(slot, "quota", emit=True)
            return True

        self._drain(
            candidates,
            lambda: self._tenant_bytes.get(tid, 0) > target,
            act,
            lambda s: int(c.tenant[s]) == tid,
            now,
        )

    def _info(self, slot: int) -> ObjectInfo:
        c = self._cols
        key = self._keys[slot]
        assert key is not None
        kind = ObjectKind(int(c.kind[slot]))
        ttl = self._ttl.get(slot)
        remaining = max(1, int((ttl - self._clock()) * 1000)) if ttl is not None else 0
        return ObjectInfo(
            key=key,
            kind=kind,
            size=int(c.size[slot]),
            checksum=int(c.checksum[slot]),
            tenant=self._tenants[int(c.tenant[slot])],
            parent=(self._anchors[slot] or b"") if kind != ObjectKind.KDA else b"",
            node_id=self._node_names[int(c.node[slot])],
            tier=Tier(int(c.tier[slot])),
            ttl_ms=remaining,
            committed=not c.flags[slot] & _PENDING,
            pinned=slot in self._pins,
            leases=int(c.leases[slot]),
        )
