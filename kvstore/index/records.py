"""What the prefix index is made of: object kinds and tiers, its typed errors, the records it returns
(matches, object info, locations, removals, leases, stats) and its column storage.

Kept apart from ``prefix_index`` so readers of the algorithm (matching, eviction, pins) see only the
algorithm, and callers (master, simulator) import the records without the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import numpy as np
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.keys import MLA_TAG

MAX_KEY_BYTES = 1024
MAX_INTERNED = 0xFFFF
DEPTH_MAX = 0xFFFF

# what PrefixIndex.insert_chain answers, negated, for an object it did not index (else the object's slot)
PUT_EXISTS = 1  # already committed: touched (the writer used it), not written again
PUT_NOT_ADMITTED = 2  # admission turned it away (insert raises NotAdmittedError)
PUT_NO_ROOM = 3  # no pool could hold it (insert raises CapacityError)


class ObjectKind(IntEnum):
    """Object kinds; values equal kvpool.v1.ObjectKind."""

    MLA = 1
    KDA = 2
    TAIL = 3
    BLOB = 4


class Tier(IntEnum):
    """Storage tiers; values equal kvpool.v1.Tier."""

    DRAM = 1
    SSD = 2


class StoreIndexError(StoreError):
    """Base class of every error the index raises on purpose (a store error: one hierarchy per boundary)."""


class BadObjectError(StoreIndexError, ValueError):
    """The object description is malformed (key, size, kind, TTL)."""


class DuplicateKeyError(StoreIndexError):
    """The key is already indexed (committed or pending); objects are immutable."""

    def __init__(self, key: bytes, pending: bool) -> None:
        super().__init__(f"key {key[:9].hex()}… already {'pending' if pending else 'committed'}")
        self.key = key
        self.pending = pending


class UnknownKeyError(StoreIndexError, KeyError):
    """The key is not indexed (or not in the state the call needs)."""


class UnknownNodeError(StoreIndexError, KeyError):
    """The node id was never added or has been removed."""


class CapacityError(StoreIndexError):
    """No node/tier can hold the object even after eviction."""


class QuotaExceededError(StoreIndexError):
    """The tenant's quota cannot fit the object even after evicting the tenant's own objects."""


class NotAdmittedError(StoreIndexError):
    """Admission control turned the object away (``index.admission``): not an error for the writer, whose
    request goes on uncached; the master answers it as the typed put status NOT_ADMITTED."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Answer of :meth:`PrefixIndex.match_prefix`."""

    usable_blocks: int  # p under the rule asked for
    mla_run_blocks: int  # longest run of committed MLA blocks from h_0
    checkpoint_blocks: tuple[int, ...]  # every c <= mla_run_blocks with a checkpoint keyed by h_{c-1}
    # the block hashes of blocks [0, usable_blocks), untagged: their keys are built only when asked for
    # (``mla_keys``), since most lookups (probes, the simulator's) need the counts alone
    usable_hashes: tuple[bytes, ...]
    checkpoint_key: bytes | None  # checkpoint closing block usable_blocks-1 (None if p = 0 or not required)
    # the index slots of mla_keys, then of checkpoint_key (for PrefixIndex.columns): where the index keeps
    # them, not what matched, so two equal matches may differ here
    slots: tuple[int, ...] = field(default=(), compare=False)

    @property
    def mla_keys(self) -> tuple[bytes, ...]:
        """MLA keys of blocks [0, usable_blocks)."""
        return tuple([MLA_TAG + h for h in self.usable_hashes])

    @property
    def blocks_lost_to_checkpoint(self) -> int:
        """MLA blocks that exist but cannot be used because no checkpoint closes them (overview §3)."""
        return self.mla_run_blocks - self.usable_blocks


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """Everything the index knows about one object (built on demand; not how it is stored)."""

    key: bytes
    kind: ObjectKind
    size: int
    checksum: int
    tenant: str
    parent: bytes
    node_id: str
    tier: Tier
    ttl_ms: int  # remaining, 0 = no expiry
    committed: bool
    pinned: bool
    leases: int
    depth: int  # MLA blocks from the chain's root to this one (0 = unknown: adopted before its parent)
    dependents: int  # live objects that depend on this one (it is never evicted while > 0)
    last_use: float  # index clock seconds of the last real use (the write counts as one)
    freq: float  # the policy's aged use count


class LocationRow(NamedTuple):
    """What a reply needs about one committed object (see :meth:`PrefixIndex.rows`)."""

    key: bytes
    kind: int
    size: int
    checksum: int
    tenant: str
    tier: int
    node_id: str
    ttl_ms: int


class Removal(NamedTuple):
    """An object left a pool: the owning node must delete it, or move it to SSD when ``demoted``.

    Immutable like the other records, but a named tuple: one is built per eviction (a simulated trace
    evicts a hundred thousand objects), and a frozen dataclass takes three times as long to build."""

    key: bytes
    node_id: str
    tier: Tier  # tier it left
    size: int
    reason: str  # evicted | demoted | expired | quota | removed | node_lost | aborted
    demoted: bool = False


@dataclass(frozen=True, slots=True)
class Lease:
    """A read pin over some objects until ``deadline`` (index clock seconds) or release."""

    lease_id: int
    deadline: float
    keys: tuple[bytes, ...]


@dataclass(slots=True)
class IndexStats:
    objects: int
    pending: int
    bytes: int
    capacity_bytes: int
    nodes: int
    active_leases: int
    soft_pins: int
    pinned_bytes: int
    pins_refused: int
    pin_budget_earned: float  # the share of pin_share new session pins may fill (pin_budget.PinBudget)
    evictions: int
    evicted_bytes: int
    demotions: int
    expired: int
    bytes_per_tier: dict[str, int]
    bytes_per_tenant: dict[str, int]
    policy: str
    orphans: int  # live objects whose parent (or a checkpoint's MLA block) is not indexed


class Columns:
    """Per-slot numpy columns, grown geometrically (x1.25: appends amortised O(1), at most a quarter of the
    columns idle; they are most of the index's memory per object)."""

    SPEC: tuple[tuple[str, type], ...] = (
        ("kind", np.uint8),
        ("tier", np.uint8),
        ("flags", np.uint8),
        ("tenant", np.uint16),
        ("node", np.uint16),
        ("depth", np.uint16),
        ("deps", np.uint32),
        ("freq", np.float32),
        ("size", np.uint64),
        ("checksum", np.uint64),
        ("last_use", np.float64),
        ("entry", np.int32),  # the compiled index: the slot's key in its key table
        ("anchor", np.int32),  # the compiled index: the key entry of what the slot depends on (-1: none)
    )

    kind: np.ndarray
    tier: np.ndarray
    flags: np.ndarray
    tenant: np.ndarray
    node: np.ndarray
    depth: np.ndarray
    deps: np.ndarray
    freq: np.ndarray
    size: np.ndarray
    checksum: np.ndarray
    last_use: np.ndarray
    entry: np.ndarray
    anchor: np.ndarray

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        for name, dtype in self.SPEC:
            setattr(self, name, np.zeros(capacity, dtype=dtype))

    def grow(self, exact: int = 0) -> None:
        """Geometric growth for one-by-one appends; ``exact`` sizes to that for a known bulk load."""
        new = max(exact, self.capacity) if exact else max(1024, self.capacity * 5 // 4)
        for name, dtype in self.SPEC:
            col = np.zeros(new, dtype=dtype)
            col[: self.capacity] = getattr(self, name)
            setattr(self, name, col)
        self.capacity = new
