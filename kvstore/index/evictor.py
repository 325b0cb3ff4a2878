"""Expiry and byte-based eviction of a ``PrefixIndex``: watermarks per node and tier, tenant quotas,
prefix-aware order (a block whose descendants are cached goes after them), SSD demotion before dropping.

Which candidate goes first among those that *may* go is the pluggable ``EvictionPolicy`` (``eviction``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
from kvpool.kvstore.index.records import (
    SLOT_LIVE,
    SLOT_PENDING,
    SLOT_PINNED,
    ObjectKind,
    Removal,
    Tier,
)
from kvpool.kvstore.index.state import IndexState


class IndexEviction(IndexState):
    """Expiry and eviction over the index state."""

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

    def _candidates(self, mask: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Slots under ``mask`` that may go now, in policy order, with their scores."""
        c, n = self._cols, self._n
        mask &= (c.flags[:n] & (SLOT_LIVE | SLOT_PENDING | SLOT_PINNED)) == SLOT_LIVE
        mask &= c.leases[:n] == 0
        cand = np.flatnonzero(mask)
        scores = self.policy.scores(c, cand, now)
        order = np.argsort(scores, kind="stable")
        return cand[order], scores[order]

    def _evictable_leaf(self, slot: int) -> bool:
        c = self._cols
        free = (c.flags[slot] & (SLOT_LIVE | SLOT_PENDING | SLOT_PINNED)) == SLOT_LIVE
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
            if not self._cols.flags[slot] & SLOT_LIVE:
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
                if not c.flags[slot] & SLOT_LIVE:  # SSD eviction cannot touch DRAM slots, but be safe
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
            self._learn_eviction(slot, size)
            self._drop(slot, "evicted", emit=True)
            return True

        def exposable(slot: int) -> bool:
            # when demoting, every object in the pool is a candidate already
            return not demote and int(c.node[slot]) == nid and int(c.tier[slot]) == tier and slot != protect

        self._drain(candidates, lambda: node.used[tier] > target, act, exposable, now)

    def _learn_eviction(self, slot: int, size: int) -> None:
        """Tell admission an MLA block or checkpoint left by pressure (and whether it was ever read)."""
        adm, c = self.admission, self._cols
        if adm is None or c.kind[slot] not in (ObjectKind.MLA, ObjectKind.KDA):
            return
        key = self._keys[slot]
        assert key is not None
        adm.evicted(key[1:], size, self.capacity_of(), unread=float(c.freq[slot]) <= 1.0)

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
