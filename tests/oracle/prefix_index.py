"""The oracle of the compiled prefix index: the plain-Python ``PrefixIndex`` the master and the simulator
ran on until the core (``kvstore/index/prefix_index.pyx``) replaced it, kept as it was (commit ce7b766) so
that the differential and trace-equality tests (tests/test_index_core_*.py) hold the core to its answers.

PrefixIndex: the master's in-memory object index, prefix matcher, pin table and byte-based evictor.

Pure and deterministic: no network, no threads, no wall clock (``clock`` is injected), so the master and
the offline trace simulator (``kvpool replay --sim``) run the very same code and agree on hit rates. Not
thread-safe: the master calls it from one event loop.

API (all sizes in bytes, all durations in ms, ``now`` always from ``clock()`` in seconds)::

    idx = PrefixIndex(policy="lru", high_watermark=0.95, low_watermark=0.85, lease_ms=5000, clock=fn)
    idx.add_node(node_id, dram_bytes, ssd_bytes=0)      # capacity per node and tier; re-adding updates it
    idx.remove_node(node_id) -> list[Removal]           # node died: every object on it leaves the index
    idx.insert(key, kind, size, node_id=None, tier=Tier.DRAM, tenant="", parent=b"", checksum=0,
               ttl_ms=0, pending=False, evict=True, avoid_node=None) -> node_id
                                                        # placed by free space; pending=True: invisible
                                                        # until commit()
    idx.insert_chain(hashes, sizes, admits, [(c, size, admit), ...], node_id=..., tenant="") -> list[int]
                                                        # a writer's puts in order, as insert; a slot or
                                                        # -records.PUT_* each: exists, not admitted, no room
    idx.commit(key); idx.remove(key, reason="removed") -> bool; idx.promote(key) -> bool
    idx.reserve(objects)                                # size once for a bulk load (a node's inventory)
    idx.match_prefix(block_hashes, require_checkpoint=True, touch=False) -> PrefixMatch
    idx.lookup(keys, touch=False) -> list[ObjectInfo | None]; idx.get(key) -> ObjectInfo | None
    idx.rows(keys) -> list[LocationRow]; idx.columns(slots) -> (sizes, checksums, tiers, node ids)
    iter(idx); idx.pending_keys()
    idx.acquire(keys, lease_ms=None) -> Lease | None; idx.release(lease_id) -> bool     # read pins
    idx.pin(keys, ttl_ms, session="") -> int           # soft pin within the pin budget; ttl_ms=0 unpins
    idx.end_session(tenant, session) -> int             # release every pin the session holds
    idx.set_quota(tenant, max_bytes)                    # 0 = unlimited
    idx.expire() -> list[Removal]                       # retire due leases, pins and TTLs now
    idx.evict() -> list[Removal]                        # watermark pass over every pool (insert does it too)
    idx.drain_events() -> list[Removal]                 # what nodes must do: delete or demote (keep_events)
    idx.stats() -> IndexStats; idx.node_usage(node_id); idx.eviction_scores(keys); idx.footprint()
    idx.verify() -> list[str]                           # recount the incremental bookkeeping (tests, debug)

Rules:

- **Joint prefix rule.** ``match_prefix`` returns the largest p such that MLA blocks [0, p) are all
  committed and a KDA checkpoint keyed by h_{p-1} is committed (p = 0 always usable); with
  ``require_checkpoint=False`` p is the plain MLA run. Lookups never pin and never change recency unless
  ``touch=True`` says the caller really used the objects (a fetch): probes cannot starve eviction.
- **One kind field.** A block key (``kvstore.keys``: a tag + a 32-byte hash) and its kind agree both ways:
  an MLA or KDA object has its tag, and nothing else may use a block key (``BadObjectError``). So a
  committed ``KDA_TAG + h`` is always a checkpoint that depends on ``MLA_TAG + h``, which is what lets
  ``match_prefix`` read "h has a checkpoint" as one bit of the MLA slot (``SLOT_CKPT``).
- **Dependencies.** An MLA block depends on its ``parent`` (previous MLA block); a KDA checkpoint keyed by
  h_i depends on the MLA block h_i (without it the checkpoint is unusable); a tail/blob depends on its
  ``parent`` if given. ``deps[slot]`` counts live dependents; nothing with dependents is ever *evicted*
  (dropped by pressure), so the cache is always a forest of usable prefixes: leaves and suffixes go first,
  and a checkpoint is always a leaf, so dropping one invalidates nothing else. Explicit removal, TTL
  expiry and node loss may orphan dependents; they stay correct (matching stops at the gap) and are
  re-linked if the missing object comes back.
- **Eviction by bytes**, per (node, tier) pool: when a pool passes ``high_watermark`` x capacity it is
  drained to ``low_watermark`` in policy order (``eviction``). A DRAM pool on a node with an SSD tier
  demotes instead (the object stays indexed with tier SSD, the SSD pool has its own watermark and drops
  leaves). Leased, soft-pinned and pending objects are never candidates. Admission (``admission``, policy
  ``hybrid``) may refuse a new chain's blocks up front.
- **Object cap** (``max_objects``, 0 = none): the index's memory is per object, so past ``high_watermark`` x
  the cap, leaves of any pool are dropped in policy order down to ``low_watermark`` x the cap; an insert
  that would pass the cap with nothing evictable raises :class:`CapacityError`.
- **Quotas**: a tenant whose bytes would exceed its quota drops its own evictable objects first; if that
  is not enough the insert raises :class:`QuotaExceededError`.
- **Pins** (an operator's system prompt, a client's retention hint) are held per (tenant, session) with a
  deadline each; an object stays pinned while any holder holds it. Clients' (session) pins are budgeted so
  they can never starve the cache: a tenant's pinned bytes stay within ``pin_share`` x ``earned`` x its
  quota, all pinned bytes within ``pin_share`` x ``earned`` x the DRAM capacity (an operator's pin counts
  there but is never refused), where ``earned`` (``pin_budget``, 0..1) follows whether pinned objects are
  read as densely as the rest. A session pin past the budget pins nothing and is counted
  (``pins_refused``): a hint is a request, never a reason to fail one. ``end_session`` releases what a
  session (a conversation, an agent run) holds the moment the client says it is over.

Memory: struct-of-arrays (``records.Columns``). Per object: one ``dict`` entry key -> slot (the key bytes
object is shared with the slot's reverse list and with dependents' anchor references), two list pointers,
and 45 bytes of numpy columns. Tenants and node ids are interned to 16-bit ids; children are counted, not
listed.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.eviction import EvictionPolicy, make_policy
from kvpool.kvstore.index.pin_budget import PinBudget
from kvpool.kvstore.index.pin_table import PinTable
from kvpool.kvstore.index.records import (
    DEPTH_MAX,
    MAX_INTERNED,
    MAX_KEY_BYTES,
    PUT_EXISTS,
    PUT_NO_ROOM,
    PUT_NOT_ADMITTED,
    BadObjectError,
    CapacityError,
    Columns,
    DuplicateKeyError,
    IndexStats,
    Lease,
    LocationRow,
    NotAdmittedError,
    ObjectInfo,
    ObjectKind,
    PrefixMatch,
    QuotaExceededError,
    Removal,
    Tier,
    UnknownKeyError,
    UnknownNodeError,
)
from kvpool.kvstore.keys import HASH_BYTES, KDA_TAG, MLA_TAG, block_tag

from tests.oracle.admission import Admission

_TAG_OF_KIND = {ObjectKind.MLA: MLA_TAG, ObjectKind.KDA: KDA_TAG}

# the flags column (the compiled index keeps the same bits as C constants)
SLOT_LIVE = 1
SLOT_PENDING = 2
SLOT_PINNED = 4
SLOT_CKPT = 8  # on a committed slot keyed MLA_TAG + h: the key KDA_TAG + h is committed too (match_prefix)


@dataclass(slots=True)
class NodeUsage:
    node_id: str
    capacity: dict[Tier, int]
    used: dict[Tier, int] = field(default_factory=lambda: {Tier.DRAM: 0, Tier.SSD: 0})


def _positive_size(size: object) -> int:
    """A chain put's size as an int > 0 (an integer of any type), or ``BadObjectError``."""
    try:
        n = operator.index(size)  # type: ignore[call-overload]
    except TypeError:
        raise BadObjectError(f"a size must be an integer, got {type(size).__name__}") from None
    if n <= 0:
        raise BadObjectError(f"size must be > 0, got {n}")
    return n


# Hot paths (insert, eviction, drop) name kinds and tiers through these module constants and write plain
# ints into the numpy columns: an attribute of an enum class, ``Tier(x)``, and any numpy operation given an
# IntEnum (numpy probes the enum class for dunders through ``EnumType.__getattr__``) each cost a few hundred
# ns, paid a million times per simulated trace (the simulator runs this very index).
_MLA, _KDA, _TAIL = ObjectKind.MLA, ObjectKind.KDA, ObjectKind.TAIL
_DRAM, _SSD = Tier.DRAM, Tier.SSD
_MLA_I, _KDA_I, _TAIL_I = int(_MLA), int(_KDA), int(_TAIL)
_TIER_OF: dict[int, Tier] = {int(t): t for t in Tier}  # a tier column value -> its member


INITIAL_SLOTS = 1024


class OracleColumns(Columns):
    """The core's columns and a read-lease count per slot (the core keeps that count in a map of the slots
    leased now: it would cost every indexed object 4 bytes there)."""

    SPEC = (*Columns.SPEC, ("leases", np.uint32))
    leases: np.ndarray


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
        admission: AdmissionConfig | None = None,
        max_objects: int = 0,
        pin_share: float = 0.5,
        pin_budget_step: float = 0.02,
    ) -> None:
        if not 0.0 <= pin_share <= 1.0:
            raise ValueError(f"pin_share must be in [0, 1], got {pin_share}")
        if max_objects < 0:
            raise ValueError("max_objects must be >= 0 (0 = no cap)")
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
        # Object cap (0 = none): the index's own memory is per object, whatever the objects' bytes, so a
        # master bounds it by count too; the watermarks apply as for bytes (evict ahead of the cap)
        self.max_objects = max_objects
        self.lease_ms = lease_ms
        self.pin_share = pin_share
        self._clock = clock
        self._keep_events = keep_events
        self._cols = OracleColumns(INITIAL_SLOTS)
        self._n = 0  # slots ever used; [0, _n) are addressable
        self._free: list[int] = []
        self._keys: list[bytes | None] = []
        self._anchors: list[bytes | None] = []
        self._slot: dict[bytes, int] = {}  # committed objects
        self._pending: dict[bytes, int] = {}  # two-phase puts not yet committed
        self._orphans: dict[bytes, int] = {}  # absent anchor key -> live dependents waiting for it
        self._tenants: list[str] = [""]
        self._tenant_ids: dict[str, int] = {"": 0}
        self._tenant_bytes: dict[int, int] = {}
        self._quota: dict[int, int] = {}
        self._nodes: dict[int, NodeUsage] = {}
        self._capacity_memo: dict[Tier, int] = {}
        self._node_names: list[str] = []
        self._node_ids: dict[str, int] = {}
        self._pins = PinTable()
        self._pins_refused = 0
        self.pin_budget = PinBudget(pin_budget_step)  # the share of ``pin_share`` clients' pins have earned
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
        self._capacity_memo.clear()
        node = self._nodes.get(nid)
        if node is None:
            self._nodes[nid] = NodeUsage(node_id, {Tier.DRAM: dram_bytes, Tier.SSD: ssd_bytes})
        else:
            node.capacity = {Tier.DRAM: dram_bytes, Tier.SSD: ssd_bytes}

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
        self._capacity_memo.clear()
        self._release_storage_if_empty()
        return dropped

    def _release_storage_if_empty(self) -> None:
        """Once the last object is gone (its node lost, everything removed), start the per-object storage
        afresh: columns, slot lists and dicts keep the size of their largest moment otherwise, so a master
        that held 10 M objects would hold their memory forever (freed here, handed back to the OS by the
        master's heap trim)."""
        if self._slot or self._pending or self._leases or self._n <= INITIAL_SLOTS:
            return
        self._cols = OracleColumns(INITIAL_SLOTS)
        self._n = 0
        self._free, self._keys, self._anchors = [], [], []
        self._slot, self._pending, self._orphans = {}, {}, {}
        self._pins, self._ttl, self._ttl_heap = PinTable(), {}, []

    def _place(self, size: int, tier: Tier = Tier.DRAM, avoid: str | None = None) -> str:
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

    def _capacity_of(self, tier: Tier = Tier.DRAM) -> int:
        """Bytes of ``tier`` over all nodes (memoised until a node is added, updated or removed: admission
        and the default policy ask on every put)."""
        cap = self._capacity_memo.get(tier)
        if cap is None:
            cap = self._capacity_memo[tier] = sum(node.capacity[tier] for node in self._nodes.values())
        return cap

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
    def check_object(key: bytes, kind: ObjectKind | int, size: int, ttl_ms: int, checksum: int) -> ObjectKind:
        """The object's kind if its description is valid (key, a kind that agrees with the key's tag, size,
        TTL, checksum), else ``BadObjectError``: the master checks a PutStart with it before anything else."""
        if not key or len(key) > MAX_KEY_BYTES:
            raise BadObjectError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        if type(kind) is not ObjectKind:  # a wire int (a PutStart); a member is already its own kind
            try:
                kind = ObjectKind(kind)
            except ValueError:
                raise BadObjectError(f"unknown object kind {kind}") from None
        tag = _TAG_OF_KIND.get(kind)
        if block_tag(key) != tag:  # the key's tag is the kind's one truth (module docstring)
            if tag is None:
                raise BadObjectError(f"a {kind.name} object cannot use the block key {key[:9].hex()}…")
            raise BadObjectError(f"{kind.name} key must be {tag!r} + {HASH_BYTES}-byte hash")
        if size <= 0:
            raise BadObjectError(f"size must be > 0, got {size}")
        if kind is _TAIL and ttl_ms <= 0:
            raise BadObjectError("a request tail must have a TTL")
        if ttl_ms < 0 or checksum < 0 or checksum >= 1 << 64:
            raise BadObjectError("ttl_ms and checksum must be non-negative (checksum < 2^64)")
        return kind

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
        admit: bool = True,
    ) -> str:
        """Index an object on a node (placed by free space if ``node_id`` is None); returns the node id.

        Makes room first (quota, then pool capacity) and runs the watermark pass after, so the index never
        holds more than a pool's capacity. ``pending=True`` reserves the bytes for a two-phase put.
        ``evict=False`` (adopting a node's inventory) skips quotas and eviction until the caller runs
        :meth:`evict` once the whole inventory is in, so no block is judged a leaf before its children
        have arrived; it still refuses to overfill a pool. ``admit=False``: a client's retention hint covers
        the object, so admission control does not turn it away (the policy still ranks it).
        """
        kind = self.check_object(key, kind, size, ttl_ms, checksum)
        if key in self._slot or key in self._pending:
            raise DuplicateKeyError(key, key in self._pending)
        placed = self._insert(
            key,
            kind,
            size,
            node_id=node_id,
            tier=Tier(tier),  # a plain int is a tier too; the hot paths compare members by identity
            tenant=tenant,
            parent=parent,
            checksum=checksum,
            ttl_ms=ttl_ms,
            pending=pending,
            evict=evict,
            avoid_node=avoid_node,
            admit=admit,
        )
        if placed is None:
            raise NotAdmittedError(f"{kind.name} object {key[:9].hex()}… not admitted")
        return placed

    def insert_chain(
        self,
        hashes: Sequence[bytes],
        sizes: Sequence[int],
        admits: Sequence[bool],
        checkpoints: Iterable[tuple[int, int, bool]] = (),
        *,
        node_id: str,
        tenant: str = "",
    ) -> list[int]:
        """A writer's puts of one request, in order: the MLA blocks ``MLA_TAG + hashes[i]`` (size
        ``sizes[i]``, admission hint ``admits[i]``, parent the block before it: none for the first or for a
        repeat of it), then each checkpoint ``(c, size, admit)``: ``KDA_TAG + hashes[c - 1]``. Each is
        indexed as ``insert`` would, except that a key already committed is refreshed (``put_again``) and a
        refusal by admission or for room puts nothing. One int per put, blocks first: the object's slot, or
        ``-PUT_EXISTS``, ``-PUT_NOT_ADMITTED``, ``-PUT_NO_ROOM``. A malformed chain is ``BadObjectError``
        before anything is put; other errors raise as ``insert``'s, with the objects before it put."""
        n = len(hashes)
        if len(sizes) != n or len(admits) != n:
            raise BadObjectError(
                f"{n} hashes, {len(sizes)} sizes and {len(admits)} admits: one of each per block"
            )
        hs = [bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else None for h in hashes]
        if any(h is None or len(h) != HASH_BYTES for h in hs):
            raise BadObjectError(f"a block hash must be {HASH_BYTES} bytes")
        size_list = [_positive_size(x) for x in sizes]
        cks = []
        for at, size, admit in checkpoints:
            try:
                c = operator.index(at)
            except TypeError:
                raise BadObjectError(
                    f"a checkpoint's block count must be an integer, got {type(at).__name__}"
                ) from None
            if not 0 < c <= n:
                raise BadObjectError(f"a checkpoint closes block 1..{n} of the chain, got {c}")
            cks.append((c, _positive_size(size), admit))
        puts: list[tuple[bytes, ObjectKind, int, bytes, bool]] = []
        prev = b""
        for h, size, admit in zip(hs, size_list, admits, strict=True):
            key = MLA_TAG + h
            puts.append((key, ObjectKind.MLA, size, b"" if prev == key else prev, admit))
            prev = key
        puts += [(KDA_TAG + hs[c - 1], ObjectKind.KDA, size, b"", admit) for c, size, admit in cks]
        out: list[int] = []
        for key, kind, size, parent, admit in puts:
            if key in self._slot:
                self.put_again(key)
                out.append(-PUT_EXISTS)
                continue
            if key in self._pending:
                raise DuplicateKeyError(key, True)
            try:
                placed = self._insert(
                    key,
                    kind,
                    size,
                    node_id=node_id,
                    tier=_DRAM,
                    tenant=tenant,
                    parent=parent,
                    checksum=0,
                    ttl_ms=0,
                    pending=False,
                    evict=True,
                    avoid_node=None,
                    admit=bool(admit),
                )
            except CapacityError:
                out.append(-PUT_NO_ROOM)
                continue
            out.append(-PUT_NOT_ADMITTED if placed is None else self._slot[key])
        return out

    def _insert(
        self,
        key: bytes,
        kind: ObjectKind,
        size: int,
        *,
        node_id: str | None,
        tier: Tier,
        tenant: str,
        parent: bytes,
        checksum: int,
        ttl_ms: int,
        pending: bool,
        evict: bool,
        avoid_node: str | None,
        admit: bool,
    ) -> str | None:
        """``insert`` of a checked object whose key is not indexed: the node id, or None when admission
        turns it away (before anything is reserved)."""
        committed, pending_puts = self._slot, self._pending
        now = self._clock()
        if self._lease_heap or self._pins.deadlines or self._ttl_heap:  # else nothing can be due
            self._retire_due(now)
        learner = self._learner
        if evict and (kind is _MLA or kind is _KDA):
            if learner is not None:
                learner.on_put(key, size, self._capacity_of())  # before admission: LRU would store it
            if admit and self.admission is not None and not self._admit(key, kind, size, parent):
                return None
        tid = self._tenant_ids.get(tenant)
        if tid is None:
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
            node_id = self._place(size, tier, avoid_node)
        nid = self._node_ids.get(node_id)
        node = None if nid is None else self._nodes.get(nid)
        if node is None:
            raise UnknownNodeError(f"unknown node {node_id!r}")
        if size > node.capacity[tier]:
            raise CapacityError(f"object of {size} bytes exceeds {tier.name} capacity of node {node_id!r}")
        # the object cap; an adoption (evict=False) may pass it: evict() trims in policy order once all is in
        if evict and self.max_objects and len(self._slot) + len(self._pending) >= self.max_objects:
            parent_slot = self._slot.get(parent, -1) if parent else -1  # the new object's own anchor stays
            self._evict_objects(int(self.low_watermark * self.max_objects), now, protect=parent_slot)
            if len(self._slot) + len(self._pending) >= self.max_objects:
                raise CapacityError(
                    f"the index holds {self.max_objects} objects (its cap), all pinned, leased, pending or "
                    "anchoring others"
                )
        used = node.used
        if used[tier] + size > node.capacity[tier] and not (evict and self._make_room(nid, tier, size, now)):
            raise CapacityError(
                f"node {node_id!r} {tier.name}: {used[tier]} of {node.capacity[tier]} bytes held by "
                f"pinned/leased/pending objects; cannot fit {size}"
            )
        slot = self._alloc_slot()
        c = self._cols
        kind_i = int(kind)
        c.kind[slot] = kind_i
        c.tier[slot] = int(tier)
        c.flags[slot] = SLOT_LIVE | (SLOT_PENDING if pending else 0)
        c.tenant[slot] = tid
        c.node[slot] = nid
        c.leases[slot] = 0
        c.size[slot] = size
        c.checksum[slot] = checksum
        c.last_use[slot] = now
        c.freq[slot] = 1.0  # a write is the first use, identical under every policy (no per-insert call)
        deps = c.deps[slot] = self._orphans.pop(key, 0)
        a = self._link_anchor(slot, key, kind, parent)
        (pending_puts if pending else committed)[key] = slot
        self._keys[slot] = key
        if learner is not None:
            if a is None and self._anchors[slot] is not None:  # an orphan, unless it hangs on itself now
                a = self._find(self._anchors[slot])  # type: ignore[arg-type]
            learner.on_insert(c, slot, key, kind_i, -1 if a is None else a)
        if not pending:
            self._mark_checkpoint(slot, key, kind_i, deps)
        used[tier] += size
        self._tenant_bytes[tid] = self._tenant_bytes.get(tid, 0) + size
        if ttl_ms:
            self._set_ttl(slot, key, now + ttl_ms / 1000.0)
        if evict:
            if used[tier] > self.high_watermark * node.capacity[tier]:  # _evict_pool's test, inlined
                self._evict_pool(nid, tier, now, protect=slot)
            if (
                self.max_objects
                and len(self._slot) + len(self._pending) > self.high_watermark * self.max_objects
            ):
                self._evict_objects(int(self.low_watermark * self.max_objects), now, protect=slot)
        return node_id

    def _admit(self, key: bytes, kind: ObjectKind, size: int, parent: bytes) -> bool:
        """Whether admission lets the object in. Unticketed objects follow their chain: an MLA block whose
        parent, or a checkpoint whose own block, was refused and is not cached is refused too (it could
        never be part of a usable prefix)."""
        adm = self.admission
        assert adm is not None
        h = key[1:]
        hangs_on = MLA_TAG + h if kind is _KDA else (parent if block_tag(parent) == MLA_TAG else b"")
        return adm.admit(h, size, hangs_on, self._find)

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
        self._mark_checkpoint(slot, key, int(self._cols.kind[slot]), int(self._cols.deps[slot]))
        now = self._clock()
        self._cols.last_use[slot] = now  # recency counts from visibility; the write was the one use
        # never evict what was just written: the writer has not even been told it succeeded
        self._evict_pool(int(self._cols.node[slot]), _TIER_OF[int(self._cols.tier[slot])], now, protect=slot)

    def remove(self, key: bytes, reason: str = "removed") -> bool:
        """Drop an object (committed or pending) regardless of pins; False if it was not indexed."""
        slot = self._find(key)
        if slot is None:
            return False
        self._drop(slot, reason, emit=False)
        self._release_storage_if_empty()
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

    @property
    def _learner(self) -> EvictionPolicy | None:
        """The policy in force if it learns (``learns``: the default): it is told of puts, writers' lookups
        and evictions. It follows ``policy`` when that is set again, as the core's does."""
        return self.policy if getattr(self.policy, "learns", False) else None

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    def __iter__(self) -> Iterator[bytes]:
        """The committed keys, oldest first (do not insert or remove while iterating)."""
        return iter(self._slot)

    def committed_slots(self) -> np.ndarray:
        """The slots of the committed objects, ascending (an int32 array)."""
        return np.array(sorted(self._slot.values()), dtype=np.int32)

    def pending_keys(self) -> list[bytes]:
        """The keys of puts started and not yet committed."""
        return list(self._pending)

    def match_prefix(
        self,
        block_hashes: Sequence[bytes],
        *,
        require_checkpoint: bool = True,
        touch: bool = False,
        resume: bool = False,
    ) -> PrefixMatch:
        """Longest usable prefix of a hash chain (joint rule), the plain MLA run and the checkpoints in it.

        ``touch=True`` marks the usable objects as used (recency/frequency); plain lookups must leave it
        False so that probing never keeps objects alive. A touching lookup is a *writer's* (prefill's fetch:
        it will put what it missed) unless ``resume``: decode reading what prefill just stored for the
        same request. Only a writer's lookup teaches the policy, admission and the pin budget (a return
        observed, tickets, the shadow LRU's score, blocks served through pins); decode's read of a chain
        written a moment ago is none of those, and would credit every fresh pin with a read.
        """
        # One dict probe per block: whether KDA_TAG + h is committed too is the SLOT_CKPT bit of the MLA slot,
        # read as the run is walked (half the key building and hashing of probing both; a scalar read per
        # block costs less than the four array calls of a gather for runs up to about a hundred blocks).
        get, flag = self._slot.get, self._cols.flags.item
        keys: list[bytes] = []
        found: list[int] = []
        checkpoints: list[int] = []  # block counts c whose block h_{c-1} has a committed checkpoint
        for h in block_hashes:
            if len(h) != HASH_BYTES:
                raise BadObjectError(f"block hash must be {HASH_BYTES} bytes, got {len(h)}")
            mk = MLA_TAG + h
            s = get(mk)
            if s is None:
                break
            keys.append(mk)
            found.append(s)
            if flag(s) & SLOT_CKPT:
                checkpoints.append(len(found))
        run = len(keys)
        if require_checkpoint:
            usable = checkpoints[-1] if checkpoints else 0
            ck = KDA_TAG + keys[usable - 1][1:] if usable else None
        else:
            usable, ck = run, None
        used = tuple(k[1:] for k in keys[:usable])  # the usable blocks' hashes (their keys less the tag)
        slots = found[:usable]
        if ck is not None:
            slots.append(self._slot[ck])
        learn = touch and not resume
        # the learners hear the lookup up to its first malformed hash (the walk cannot pass it)
        for i, h in enumerate(block_hashes):
            if not isinstance(h, (bytes, bytearray, memoryview)) or len(h) != HASH_BYTES:
                block_hashes = block_hashes[:i]
                break
        block_hashes = [bytes(h) for h in block_hashes]
        if learn and self._learner is not None:  # before the touch: the read's age is the return time
            self._learner.on_lookup(
                self._cols,
                block_hashes,
                run,
                usable,
                slots[-1] if ck is not None else -1,
                require_checkpoint,
                self._clock(),
                found,
            )
        if learn and self.admission is not None:  # the writer's fetch: it will put what it missed
            if self._learner is not None:
                self.admission.floor = self._learner.admission_floor()
            self.admission.on_lookup(block_hashes, run, self._capacity_of())
        if learn:
            # what pins are worth: the blocks a writer is served through a pinned object or not (the one that
            # makes the hit usable: the checkpoint, or a pure-MLA run's deepest block), against DRAM held,
            # where pins compete (pinned objects are never demoted)
            from_pinned = bool(slots) and self._cols.flags.item(slots[-1]) & SLOT_PINNED != 0
            pinned = self._pins.total_bytes
            dram = sum(node.used[_DRAM] for node in self._nodes.values()) if pinned else 0
            self.pin_budget.lookup(usable, from_pinned, pinned, dram)
        if touch and usable:
            self.policy.touch(self._cols, np.array(slots, dtype=np.int64), self._clock())
        return PrefixMatch(usable, run, tuple(checkpoints), used, ck, tuple(slots))

    def columns(self, slots: Sequence[int]) -> tuple[list[int], list[int], list[int], list[str]]:
        """``(sizes, checksums, tiers, node ids)`` of live slots (a match's ``slots``), in order: what a
        MatchPrefix reply carries, read column-wise in a few vector operations. Never changes recency."""
        c = self._cols
        idx = np.array(slots, dtype=np.int64)
        names = self._node_names
        return (
            c.size[idx].tolist(),
            c.checksum[idx].tolist(),
            c.tier[idx].tolist(),
            [names[n] for n in c.node[idx].tolist()],
        )

    def get(self, key: bytes) -> ObjectInfo | None:
        """Info on a committed or pending object, None if absent. Never changes recency."""
        slot = self._find(key)
        return None if slot is None else self._info(slot)

    def rows(self, keys: Sequence[bytes]) -> list[LocationRow]:
        """Location rows of committed keys (absent keys skipped), built column-wise (the master's
        promotions on a hit read them). Never changes recency."""
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

    def put_again(self, key: bytes) -> bool:
        """A writer put committed ``key`` again: its recency refreshed (not its use count), the learner told
        of the put. Whether ``key`` is committed."""
        slot = self._slot.get(bytes(key))
        if slot is None:
            return False
        c = self._cols
        if int(c.kind[slot]) in (_MLA_I, _KDA_I) and self._learner is not None:
            self._learner.on_put(bytes(key), int(c.size[slot]), self._capacity_of())
        c.last_use[slot] = self._clock()
        return True

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
        self._release_storage_if_empty()  # the index emptied while this lease held some of its slots
        return True

    def pin(self, keys: Iterable[bytes], ttl_ms: int, session: str = "") -> int:
        """Soft-pin the committed objects among ``keys`` for ``ttl_ms`` on behalf of ``session`` (each
        object's tenant's session): they are not evicted while any holder pins them. A session's pin (a
        client's hint) is budgeted, all or nothing: when the newly pinned bytes would pass the pin budget
        (module docstring: ``pin_share`` x what pins earned) nothing is pinned, 0 is returned and
        ``pins_refused`` counts it; an operator's pin (no session) is not. ``ttl_ms=0`` drops this session's
        pins on ``keys``. Returns how many objects were found (and pinned or unpinned)."""
        slots = [s for s in (self._slot.get(k) for k in keys) if s is not None]
        if not ttl_ms:
            for slot in slots:
                self._unpin(slot, session)
            return len(slots)
        c = self._cols
        if session and self._learner is not None:  # granted or not, the hint tells when the chain returns
            self._learner.on_hint(c, slots, ttl_ms)
        new: dict[int, int] = {}  # tenant id -> bytes this call pins that were not pinned
        for slot in dict.fromkeys(slots):
            if slot not in self._pins:
                tid = int(c.tenant[slot])
                new[tid] = new.get(tid, 0) + int(c.size[slot])
        if session and not self._pin_fits(new):
            self._pins_refused += 1
            return 0
        until = self._clock() + ttl_ms / 1000.0
        for slot in slots:
            if self._pins.hold(slot, int(c.tenant[slot]), int(c.size[slot]), session, until):
                c.flags[slot] |= np.uint8(SLOT_PINNED)
        return len(slots)

    def _pin_fits(self, new: dict[int, int]) -> bool:
        """Whether pinning ``new`` more bytes per tenant keeps every budget (module docstring, Pins)."""
        total = sum(new.values())
        if not total:
            return True
        share = self.pin_share * self.pin_budget.earned
        if self._pins.total_bytes + total > share * self._capacity_of(Tier.DRAM):
            return False
        for tid, extra in new.items():
            quota = self._quota.get(tid, 0)
            if quota and self._pins.bytes_by_tenant.get(tid, 0) + extra > share * quota:
                return False
        return True

    def end_session(self, tenant: str, session: str) -> int:
        """Release every pin ``session`` of ``tenant`` holds (objects another holder pins stay pinned);
        returns how many objects it held."""
        tid = self._tenant_ids.get(tenant)
        slots = self._pins.session_slots(tid, session) if tid is not None and session else []
        for slot in slots:
            self._unpin(slot, session)
        return len(slots)

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
            pinned_bytes=self._pins.total_bytes,
            pins_refused=self._pins_refused,
            pin_budget_earned=self.pin_budget.earned,
            evictions=self._evictions,
            evicted_bytes=self._evicted_bytes,
            demotions=self._demotions,
            expired=self._expired,
            bytes_per_tier=tiers,
            bytes_per_tenant={self._tenants[t]: b for t, b in self._tenant_bytes.items() if b},
            policy=self.policy.name,
            orphans=sum(self._orphans.values()),
        )

    def eviction_scores(self, keys: Sequence[bytes]) -> list[float]:
        """The policy's score now of each committed key (lower goes first): how eviction ranks them."""
        slots = np.fromiter(map(self._slot.__getitem__, keys), dtype=np.int64, count=len(keys))
        return self.policy.scores(self._cols, slots, self._clock()).tolist()

    @property
    def allocated_slots(self) -> int:
        """Objects the columns have room for (``reserve`` sizes them exactly for a bulk load)."""
        return self._cols.capacity

    def footprint(self) -> dict[str, int]:
        """Bytes the index holds by structure (what its memory per object is made of). Small objects are
        counted as pymalloc serves them, in 16-byte classes (a 33-byte key, 66 bytes of object, takes 80)."""

        def held(obj: object) -> int:
            size = sys.getsizeof(obj)
            return (size + 15) & ~15 if size <= 512 else size

        return {
            "key_objects": sum(held(k) for k in self._keys if k is not None),
            "slot_ints": sum(held(s) for s in self._slot.values() if s > 256),  # smaller ints are cached
            "dict": sys.getsizeof(self._slot),
            "slot_lists": sys.getsizeof(self._keys) + sys.getsizeof(self._anchors),
            "columns": sum(getattr(self._cols, name).nbytes for name, _ in OracleColumns.SPEC),
        }

    def verify(self) -> list[str]:
        """Recount from the slots everything the index keeps incrementally (pool and tenant bytes, dependent
        and orphan counts, checkpoint bits, the free list) and say what disagrees; empty when consistent.
        O(objects): for tests and for debugging, never on a request path."""
        c, n = self._cols, self._n
        live = [s for s in range(n) if c.flags[s] & SLOT_LIVE]
        out: list[str] = []
        if len(live) != len(self._slot) + len(self._pending):
            out.append(f"{len(live)} live slots for {len(self._slot) + len(self._pending)} keys")
        used: dict[tuple[int, int], int] = {}
        tenants: dict[int, int] = {}
        pinned: dict[int, int] = {}
        deps: dict[int, int] = {}
        orphans: dict[bytes, int] = {}
        for s in live:
            key = self._keys[s]
            if key is None or self._find(key) != s:
                out.append(f"slot {s} is not its key's slot")
                continue
            pool = (int(c.node[s]), int(c.tier[s]))
            used[pool] = used.get(pool, 0) + int(c.size[s])
            tenants[int(c.tenant[s])] = tenants.get(int(c.tenant[s]), 0) + int(c.size[s])
            if s in self._pins:
                pinned[int(c.tenant[s])] = pinned.get(int(c.tenant[s]), 0) + int(c.size[s])
            if bool(c.flags[s] & SLOT_PINNED) != (s in self._pins):
                out.append(f"slot {s}: pinned flag disagrees with the pin table")
            anchor = self._anchors[s]
            if anchor is not None:
                a = self._find(anchor)
                if a is None:
                    orphans[anchor] = orphans.get(anchor, 0) + 1
                else:
                    deps[a] = deps.get(a, 0) + 1
            if block_tag(key) == MLA_TAG and key in self._slot:
                has = bool(c.flags[s] & SLOT_CKPT)
                if has != (KDA_TAG + key[1:] in self._slot):
                    out.append(f"checkpoint bit of {key[:9].hex()} is {has}")
        for nid, node in self._nodes.items():
            for tier in Tier:
                if node.used[tier] != used.get((nid, int(tier)), 0) or node.used[tier] > node.capacity[tier]:
                    out.append(f"node {node.node_id} {tier.name}: {node.used[tier]} bytes counted")
        if {t: b for t, b in self._tenant_bytes.items() if b} != tenants:
            out.append("tenant bytes drifted")
        out.extend(self._pins.problems(pinned))
        if {s: int(c.deps[s]) for s in live if c.deps[s]} != deps:
            out.append("dependent counts drifted")
        if self._orphans != orphans:
            out.append("orphan counts drifted")
        if len(self._free) != len(set(self._free)):
            out.append("a slot was freed twice")
        held = {int(s) for _, slots in self._leases.values() for s in slots}
        if set(self._free) & (set(live) | held):
            out.append("a live or leased slot is on the free list")
        return out

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
            if (
                self.max_objects
                and len(self._slot) + len(self._pending) > self.high_watermark * self.max_objects
            ):
                self._evict_objects(int(self.low_watermark * self.max_objects), now)
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
        for slot, session in self._pins.due(now):
            self._unpin(slot, session)
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
        # Python lists and ints: a pass walks hundreds of slots one by one, and numpy scalars are slow
        # there (the columns are not resized during a pass: nothing is inserted)
        order, scores = candidates[0].tolist(), candidates[1].tolist()
        c, anchors, committed, policy = self._cols, self._anchors, self._slot, self.policy
        flags, leases, deps = c.flags.item, c.leases.item, c.deps.item
        movable = SLOT_LIVE | SLOT_PENDING | SLOT_PINNED
        # the exposed anchor's score, as ``scores`` would give it alone (a policy's scalar path if it has one)
        one = getattr(policy, "score_one", None)
        exposed: list[tuple[float, int]] = []
        i, n = 0, len(order)
        while over():
            if exposed and (i >= n or exposed[0][0] < scores[i]):
                slot = heapq.heappop(exposed)[1]
            elif i < n:
                slot = order[i]
                i += 1
            else:
                return
            if not flags(slot) & SLOT_LIVE:
                continue
            anchor = anchors[slot]
            if not act(slot) or anchor is None:
                continue
            a = committed.get(anchor)
            # the anchor is now an evictable leaf: live, committed, unpinned, unleased, no dependents
            if (
                a is not None
                and (flags(a) & movable) == SLOT_LIVE
                and not leases(a)
                and not deps(a)
                and exposable(a)
            ):
                score = one(c, a, now) if one is not None else float(policy.scores(c, np.array([a]), now)[0])
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
        demote = tier is _DRAM and node.capacity[_SSD] > 0
        tier_i = int(tier)
        mask = (c.node[:n] == nid) & (c.tier[:n] == tier_i)
        if not demote:
            mask &= c.deps[:n] == 0
        if 0 <= protect < n:
            mask[protect] = False
        candidates = self._candidates(mask, now)

        def act(slot: int) -> bool:
            if c.tier.item(slot) != tier_i:
                return False  # already demoted earlier in this pass
            size = c.size.item(slot)
            if demote and c.kind.item(slot) != _TAIL_I and self._make_room(nid, _SSD, size, now):
                if not c.flags.item(slot) & SLOT_LIVE:  # SSD eviction cannot touch DRAM slots, but be safe
                    return False
                c.tier[slot] = int(_SSD)
                node.used[_DRAM] -= size
                node.used[_SSD] += size
                self._demotions += 1
                if self._keep_events:
                    key = self._keys[slot]
                    assert key is not None
                    self._events.append(Removal(key, node.node_id, _DRAM, size, "demoted", True))
                return False
            if c.deps.item(slot):
                return False  # demotion impossible and it still has dependents: keep it
            self._evictions += 1
            self._evicted_bytes += size
            self._learn_eviction(slot, size)
            self._drop(slot, "evicted", emit=True)
            return True

        def exposable(slot: int) -> bool:
            # when demoting, every object in the pool is a candidate already
            return not demote and c.node.item(slot) == nid and c.tier.item(slot) == tier_i and slot != protect

        self._drain(candidates, lambda: node.used[tier] > target, act, exposable, now)

    def _evict_objects(self, target: int, now: float, protect: int = -1) -> None:
        """Bring the object count down to ``target`` (the object cap): leaves of every pool, in policy
        order, as pressure on bytes would drop them (never an object with dependents, a pin or a lease)."""
        c, n = self._cols, self._n
        mask = c.deps[:n] == 0
        if 0 <= protect < n:
            mask[protect] = False
        candidates = self._candidates(mask, now)

        def act(slot: int) -> bool:
            size = c.size.item(slot)
            self._evictions += 1
            self._evicted_bytes += size
            self._learn_eviction(slot, size)
            self._drop(slot, "evicted", emit=True)
            return True

        self._drain(
            candidates,
            lambda: len(self._slot) + len(self._pending) > target,
            act,
            lambda slot: slot != protect,
            now,
        )

    def _learn_eviction(self, slot: int, size: int) -> None:
        """Tell admission and a learning policy an MLA block or checkpoint left by pressure (and whether it
        was ever read)."""
        adm, c, key = self.admission, self._cols, self._keys[slot]
        assert key is not None
        if self._learner is not None:
            self._learner.on_evict(c, slot, key, self._clock())
        if adm is None:
            return
        if c.kind.item(slot) in (_MLA_I, _KDA_I):
            adm.evicted(key[1:], size, self._capacity_of(), unread=c.freq.item(slot) <= 1.0)

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

    def _find(self, key: bytes) -> int | None:
        slot = self._slot.get(key)
        return self._pending.get(key) if slot is None else slot

    def _mark_checkpoint(self, slot: int, key: bytes, kind: int, deps: int) -> None:
        """Keep the SLOT_CKPT bit true as ``key`` (of ``kind``) becomes committed (``deps``: its dependents
        now): set on an MLA block whose checkpoint is committed, or on the committed MLA block of a
        checkpoint.

        A pending or fresh slot never has the bit (insert writes the flags, _drop clears them). The kind
        stands for the key's tag (an MLA or KDA object has its tag, check_object), and a checkpoint depends
        on its MLA block, so a block without dependents has none: the common insert (a new leaf block)
        builds and hashes no second key."""
        flags = self._cols.flags
        if kind == _MLA_I:
            if deps and KDA_TAG + key[1:] in self._slot:
                flags[slot] = flags.item(slot) | SLOT_CKPT
        elif kind == _KDA_I:
            m = self._slot.get(MLA_TAG + key[1:])
            if m is not None:
                flags[m] = flags.item(m) | SLOT_CKPT

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

    def _link_anchor(self, slot: int, key: bytes, kind: ObjectKind, parent: bytes) -> int | None:
        """Record what ``slot`` depends on (its anchor: counted as a dependent, or as an orphan's wait) and
        its depth; returns the anchor's slot (None: a root or an orphan)."""
        # a checkpoint depends on its own MLA block (its key is KDA_TAG + h: kinds agree with key tags),
        # anything else on its parent if it names one
        anchor = MLA_TAG + key[1:] if kind is _KDA else (parent or None)
        c = self._cols
        step = 1 if kind is _MLA else 0
        depth = step
        a = None
        if anchor is not None:
            a = self._slot.get(anchor)
            if a is None:
                a = self._pending.get(anchor)
            if a is None:
                anchor = bytes(anchor)
                self._orphans[anchor] = self._orphans.get(anchor, 0) + 1
                depth = 0  # unknown until the chain is complete; policies treat 0 as 1
            else:
                anchor = self._keys[a]  # share the bytes object
                c.deps[a] = c.deps.item(a) + 1
                depth = min(c.depth.item(a) + step, DEPTH_MAX)
        c.depth[slot] = depth
        self._anchors[slot] = anchor
        return a

    def _set_ttl(self, slot: int, key: bytes, deadline: float) -> None:
        self._ttl[slot] = deadline
        heapq.heappush(self._ttl_heap, (deadline, slot, key))

    def _unpin(self, slot: int, session: str | None = None) -> None:
        """Drop ``session``'s pin on ``slot`` (every holder's when None); the object is unpinned, and its
        bytes leave the pin budget, once no holder is left."""
        c = self._cols
        if self._pins.release(slot, int(c.tenant[slot]), int(c.size[slot]), session):
            c.flags[slot] &= ~np.uint8(SLOT_PINNED)

    def _drop(self, slot: int, reason: str, *, emit: bool, demoted: bool = False) -> Removal:
        """Remove a live slot from every structure; the slot is recycled once no lease refers to it."""
        c = self._cols
        key = self._keys[slot]
        assert key is not None
        committed = self._slot.pop(key, None) is not None
        if not committed:
            self._pending.pop(key, None)
        if committed and c.kind.item(slot) == _KDA_I:  # the kind is the key's tag (check_object)
            m = self._slot.get(MLA_TAG + key[1:])
            if m is not None:
                c.flags[m] = c.flags.item(m) & ~SLOT_CKPT
        anchor = self._anchors[slot]
        if anchor is not None:
            a = self._slot.get(anchor)
            if a is None:
                a = self._pending.get(anchor)
            if a is not None:
                c.deps[a] = c.deps.item(a) - 1
            else:
                left = self._orphans[anchor] - 1
                if left:
                    self._orphans[anchor] = left
                else:
                    del self._orphans[anchor]
        deps = c.deps.item(slot)
        if deps:
            self._orphans[key] = deps
        size = c.size.item(slot)
        tier = _TIER_OF[c.tier.item(slot)]
        nid = c.node.item(slot)
        node = self._nodes.get(nid)
        if node is not None:
            node.used[tier] -= size
        tid = c.tenant.item(slot)
        self._tenant_bytes[tid] -= size
        if slot in self._pins:
            self._unpin(slot)
        self._ttl.pop(slot, None)
        c.flags[slot] = 0
        c.deps[slot] = 0
        self._keys[slot] = None
        self._anchors[slot] = None
        if not c.leases.item(slot):
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
            depth=int(c.depth[slot]),
            dependents=int(c.deps[slot]),
            last_use=float(c.last_use[slot]),
            freq=float(c.freq[slot]),
        )
