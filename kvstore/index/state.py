"""The prefix index's state: the column store of object slots, nodes and their tiers, tenants, chain
anchors, and the slot operations every part of the index builds on (find, allocate, link, drop).

``PrefixIndex`` (``prefix_index``) is this state plus eviction (``evictor``) and its public calls.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable

import numpy as np
from kvpool.kvstore.index.admission import Admission, AdmissionConfig
from kvpool.kvstore.index.eviction import EvictionPolicy, make_policy
from kvpool.kvstore.index.records import (
    DEPTH_MAX,
    MAX_INTERNED,
    MAX_KEY_BYTES,
    SLOT_CKPT,
    SLOT_LIVE,
    SLOT_PENDING,
    SLOT_PINNED,
    BadObjectError,
    CapacityError,
    Columns,
    NodeUsage,
    ObjectInfo,
    ObjectKind,
    QuotaExceededError,
    Removal,
    Tier,
    UnknownNodeError,
    anchor_of,
)
from kvpool.kvstore.keys import HASH_BYTES, KDA_TAG, MLA_TAG


class IndexState:
    """Slots, nodes and tenants of a ``PrefixIndex``; see ``prefix_index`` for the rules and the API."""

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
        admission: AdmissionConfig | None = None,
    ) -> None:
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}"
            )
        if lease_ms <= 0:
            raise ValueError("lease_ms must be > 0")
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        if admission is None and getattr(self.policy, "admits", False):
            admission = AdmissionConfig()
        # None: every put is admitted (the policy only orders evictions)
        self.admission = None if admission is None else Admission(admission, clock)
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.lease_ms = lease_ms
        self._clock = clock
        self._keep_events = keep_events
        self._cols = Columns(initial_capacity)
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
        self._nodes: dict[int, NodeUsage] = {}
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

    def add_node(self, node_id: str, dram_bytes: int, ssd_bytes: int = 0) -> None:
        """Add a node or update its capacities (objects stay)."""
        if not node_id:
            raise BadObjectError("node id must be non-empty")
        if dram_bytes < 0 or ssd_bytes < 0:
            raise BadObjectError("capacities must be >= 0")
        nid = self._node_ids.get(node_id)
        if nid is None:
            if len(self._node_names) > MAX_INTERNED:
                raise CapacityError("too many node ids")
            nid = len(self._node_names)
            self._node_names.append(node_id)
            self._node_ids[node_id] = nid
        node = self._nodes.get(nid)
        if node is None:
            self._nodes[nid] = NodeUsage(node_id, {Tier.DRAM: dram_bytes, Tier.SSD: ssd_bytes})
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
        slots = np.flatnonzero((c.node[:n] == nid) & ((c.flags[:n] & SLOT_LIVE) != 0))
        dropped = [self._drop(int(s), "node_lost", emit=False) for s in slots]
        del self._nodes[nid]
        return dropped

    def place(self, size: int, tier: Tier = Tier.DRAM, avoid: str | None = None) -> str:
        """The node with the most free bytes in ``tier`` whose capacity can hold ``size``; ``avoid`` is
        chosen only when no other node can hold it."""
        best: NodeUsage | None = None
        best_key = (False, -1)
        for node in self._nodes.values():
            cap = node.capacity[tier]
            key = (node.node_id != avoid, cap - node.used[tier])
            if cap >= size and key > best_key:
                best, best_key = node, key
        if best is None:
            raise CapacityError(f"no node has {tier.name} capacity for an object of {size} bytes")
        return best.node_id

    def capacity_of(self, tier: Tier = Tier.DRAM) -> int:
        """Bytes of ``tier`` over all nodes."""
        return sum(node.capacity[tier] for node in self._nodes.values())

    def _node(self, node_id: str) -> NodeUsage:
        nid = self._node_ids.get(node_id)
        node = None if nid is None else self._nodes.get(nid)
        if node is None:
            raise UnknownNodeError(f"unknown node {node_id!r}")
        return node

    def _tenant_id(self, tenant: str) -> int:
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            if len(self._tenants) > MAX_INTERNED:
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
        """Keep the SLOT_CKPT bit true as ``key`` becomes committed (``deps``: its dependents now): set on an
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
                self._cols.flags[slot] |= np.uint8(SLOT_CKPT)
        elif tag == KDA_TAG:
            m = self._slot.get(MLA_TAG + key[1:])
            if m is not None:
                self._cols.flags[m] |= np.uint8(SLOT_CKPT)

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
        anchor = anchor_of(key, kind, parent)
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
                depth = min(int(c.depth[a]) + (1 if kind == ObjectKind.MLA else 0), DEPTH_MAX)
        c.depth[slot] = depth
        self._anchors[slot] = anchor

    def _set_ttl(self, slot: int, key: bytes, deadline: float) -> None:
        self._ttl[slot] = deadline
        heapq.heappush(self._ttl_heap, (deadline, slot, key))

    def _unpin(self, slot: int) -> None:
        self._pins.pop(slot, None)
        self._cols.flags[slot] &= ~np.uint8(SLOT_PINNED)

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
                c.flags[m] &= ~np.uint8(SLOT_CKPT)
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
            committed=not c.flags[slot] & SLOT_PENDING,
            pinned=slot in self._pins,
            leases=int(c.leases[slot]),
        )
