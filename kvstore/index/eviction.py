"""Eviction policies for the prefix index: who goes first among the objects that *may* go.

The index decides which objects are eligible (leaf-first, unpinned, unleased, committed); a policy only
ranks them. Ranking is vectorised over the index's columns (numpy arrays indexed by slot) so one
eviction round over a million objects is a handful of array operations, not a Python loop.

Contract: ``scores(cols, slots, now)`` returns one float per slot, **lower = evicted first**; ties break by
slot order (the index uses a stable sort), so a policy is deterministic for a given clock. ``touch`` is
called when an object is inserted or really used (a fetch, never a probe), and may update ``last_use``
and ``freq`` only. A policy may add ``score_one(cols, slot, now) -> float``, the very value ``scores``
gives that slot alone, without building arrays: the eviction pass scores anchors one at a time as their
last dependent goes.

Policies (pick by name with :func:`make_policy`):

- ``lru``: least recently used. The baseline every cache paper and Mooncake compare against.
- ``lfu``: frequency with exponential aging (half-life ``half_life_s``): a prefix hit 50 times an hour
  ago loses to one hit 3 times a minute ago once enough half-lives have passed, which plain LFU never does.
- ``hybrid`` (the default): dead MLA blocks first, then depth-weighted recency, plus admission control
  (``admission``); see :class:`HybridPolicy`.
- ``cost``: aged frequency x compute saved per byte held ("bytes saved per byte held"). A KDA checkpoint
  at depth d lets prefill skip d blocks, an MLA block one block; dividing by size ranks a 429 MiB
  checkpoint against 13 MiB MLA blocks on what each keeps out of the GPU per byte of DRAM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from kvpool.kvstore.index.recency_guard import RecencyGuard
from kvpool.kvstore.index.return_time import HINT, READ, ReturnTimeModel, hinted_class, request_class

KIND_MLA = 1
SLOT_LIVE = 1  # mirrors the LIVE flag of prefix_index.pyx (this module stays free of the index's imports)
KIND_KDA = 2  # mirrors kvpool.v1.ObjectKind.KDA_CHECKPOINT (kept numeric: this module has no proto import)


class PolicyColumns(Protocol):
    """The per-slot arrays a policy may read (and, in ``touch``, write)."""

    last_use: np.ndarray  # float64 seconds on the index clock
    freq: np.ndarray  # float32 aged hit count, as of last_use
    size: np.ndarray  # uint64 bytes
    depth: np.ndarray  # uint16 blocks from the chain root (1 = first block), saturating
    kind: np.ndarray  # uint8 ObjectKind
    flags: np.ndarray  # uint8 SLOT_* bits (records)
    deps: np.ndarray  # uint32 live dependents (a checkpoint depends on its MLA block)


class EvictionPolicy(Protocol):
    """A ranking of eviction candidates. Implementations are stateless apart from their parameters."""

    name: str

    def touch(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> None: ...

    def scores(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> np.ndarray: ...


class UnknownPolicyError(ValueError):
    """The policy name is not one of :data:`POLICIES`."""


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def touch(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> None:
        cols.last_use[slots] = now
        cols.freq[slots] += 1.0

    def scores(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> np.ndarray:
        return cols.last_use[slots]


class AgedLFUPolicy:
    """Least (exponentially aged) frequency first; the count halves every ``half_life_s`` without use."""

    name = "lfu"

    def __init__(self, half_life_s: float = 600.0) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        self.half_life_s = half_life_s

    def _log_aged(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> np.ndarray:
        # log2 of freq * 2^(-age/H): stays finite for any age, where the product would underflow to 0.
        age = np.maximum(now - cols.last_use[slots], 0.0)
        return np.log2(np.maximum(cols.freq[slots].astype(np.float64), 1e-30)) - age / self.half_life_s

    def touch(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> None:
        aged = np.exp2(np.maximum(self._log_aged(cols, slots, now), -100.0))
        cols.freq[slots] = (aged + 1.0).astype(np.float32)
        cols.last_use[slots] = now

    def scores(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> np.ndarray:
        return self._log_aged(cols, slots, now)


class CostAwarePolicy(AgedLFUPolicy):
    """Lowest aged-frequency x blocks-of-prefill-saved / bytes-held first."""

    name = "cost"

    def scores(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> np.ndarray:
        saved_blocks = np.where(cols.kind[slots] == KIND_KDA, np.maximum(cols.depth[slots], 1), 1)
        per_byte = np.log2(saved_blocks.astype(np.float64)) - np.log2(
            np.maximum(cols.size[slots], 1).astype(np.float64)
        )
        return self._log_aged(cols, slots, now) + per_byte


class DepthRecencyPolicy(LRUPolicy):
    """Dead MLA blocks first, then the lowest *depth-weighted recency*; with admission control (the
    default before return-time prediction, kept as ``depth`` to compare against).

    An MLA block that is a leaf has no checkpoint at its boundary and none after it on its chain: the
    joint rule can never use it (prefill recomputes from the last checkpoint before it), so its bytes are
    dead weight and it goes before anything live. When a checkpoint goes, the MLA blocks back to the
    previous checkpoint become such leaves and follow it at once: a checkpoint is priced together with the
    run it makes usable.

    Among live candidates the score is ``depth_weight x log2(depth) - log2(age)``: a checkpoint closing
    twice as many blocks saves twice the prefill for the same 429 MiB, so it may be 2^(1/depth_weight)
    times older before it goes (with the default 0.5: four times). Scale-free: the ratio of ages, not
    seconds, so a trace replayed at another rate ranks alike. ``admits`` makes the index build an
    ``Admission`` (``index.admission``) with it."""

    name = "depth"
    admits = True

    def __init__(self, half_life_s: float = 600.0, depth_weight: float = 0.5) -> None:
        if not (math.isfinite(depth_weight) and depth_weight >= 0):
            raise ValueError("depth_weight must be finite and >= 0")
        self.depth_weight = depth_weight

    def scores(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> np.ndarray:
        age = np.maximum(now - cols.last_use[slots], MIN_AGE_S)
        s = -np.log2(age)
        kind = cols.kind[slots]
        ck = kind == KIND_KDA
        s[ck] += self.depth_weight * np.log2(np.maximum(cols.depth[slots][ck], 1).astype(np.float64))
        s[(kind == KIND_MLA) & (cols.deps[slots] == 0)] -= DEAD_FIRST
        return s


class HybridPolicy(LRUPolicy):
    """The default: dead MLA blocks first, then checkpoints by *expected reads per second per byte*,
    learned online per request class, mixed with recency by a weight a shadow LRU keeps honest; with
    admission control (docs/design/eviction.md §1.1).

    Score of a live checkpoint (lower goes first), in log2 units of "blocks of prefill saved per byte
    per second"::

        pred = log2 rate(class, age) + depth_weight x log2(depth) - log2(size)
        score = w x pred + (1 - w) x (-log2 age)

    ``rate`` is the ``ReturnTimeModel``'s P(read again) / E[wait] for objects of that class and age (near
    zero once the age is past the class's returns: overdue objects go first), ``depth`` the blocks a read
    lets prefill skip, ``size`` its bytes. ``-log2 age`` is LRU's own ranking in the same units (a rate
    of one read per age). ``w`` is the ``RecencyGuard``'s: it falls towards 0 (LRU order) while a shadow
    LRU of the same capacity would have served more blocks, and rises while the predictions serve more.
    MLA blocks that are not dead (candidates only when demoting to SSD) are priced by recency per byte.
    Until ``min_observations`` returns or censorings are known, the order is plain recency.

    Unlike the other policies it keeps state: the index calls its hooks (``on_put``, ``on_insert``,
    ``on_lookup``, ``on_evict``) so it sees each put, each writer's lookup and each eviction."""

    name = "hybrid"
    admits = True
    learns = True

    def __init__(
        self,
        half_life_s: float = 600.0,
        depth_weight: float = 0.5,
        min_observations: int = 32,
        guard_step: float = 0.05,
        initial_weight: float = 1.0,
        prior: float = 4.0,
    ) -> None:
        if not (math.isfinite(depth_weight) and depth_weight >= 0):
            raise ValueError("depth_weight must be finite and >= 0")
        self.depth_weight = depth_weight
        self.min_observations = min_observations
        self._model = ReturnTimeModel(prior=prior)
        self._guard = RecencyGuard(initial=initial_weight, step=guard_step)
        self._klass = np.zeros(1024, dtype=np.uint16)

    @property
    def model(self) -> ReturnTimeModel:
        """The return-time model (read-only: the index reads its tickets' C++ object from the start)."""
        return self._model

    @property
    def guard(self) -> RecencyGuard:
        """The shadow LRU and the weight ``w`` (read-only: the index holds its C++ object from the start)."""
        return self._guard

    # ------------------------------------------------------------------ hooks (called by the index)

    def on_put(self, key: bytes, size: int, capacity: int) -> None:
        """A writer puts an MLA block or checkpoint (before admission): the shadow LRU stores it."""
        self.guard.put(key, size, capacity)

    def on_insert(self, cols: PolicyColumns, slot: int, key: bytes, kind: int, anchor_slot: int) -> None:
        """An object took ``slot``: give it its class (its ticket's, or its anchor's beyond the prompt).
        The compiled index does the same in C while this is the policy's ``on_insert`` (it reads the
        model's ``tickets`` and writes ``klass_room``'s array), so it is called here only by subclasses'
        overrides and the oracle index."""
        klass = self.klass_room(slot)
        anchor = klass.item(anchor_slot) if 0 <= anchor_slot < len(klass) else None
        klass[slot] = self.model.class_of_put(key[1:], anchor)

    def klass_room(self, slot: int) -> np.ndarray:
        """The class of each slot (uint16), grown by half when ``slot`` is past its end: the one place it
        is replaced, so the index may hold the array it returns until it asks again."""
        if slot >= len(self._klass):
            klass = np.zeros(max(slot + 1, len(self._klass) * 3 // 2), dtype=np.uint16)
            klass[: len(self._klass)] = self._klass
            self._klass = klass
        return self._klass

    def on_lookup(
        self,
        cols: PolicyColumns,
        block_hashes: Sequence[bytes],
        run: int,
        usable: int,
        checkpoint_slot: int,
        joint: bool,
        now: float,
        mla_slots: Sequence[int] = (),
    ) -> None:
        """A writer's lookup (prefill's fetch), before its touch: learn the returns it shows, class the
        request, ticket the blocks it will write, and score it against the shadow LRU (``mla_slots``: the
        slots of the cached MLA run)."""
        model = self.model
        deep, gap = usable, None
        if checkpoint_slot >= 0:
            gap = now - cols.last_use.item(checkpoint_slot)
            model.observe(self._klass.item(checkpoint_slot), gap, True)
        g = model.deepest_ghost(block_hashes, usable)
        if g > usable:
            gap = model.ghost_returned(block_hashes[g - 1], now)
            deep = g
        cls = request_class(deep, len(block_hashes), gap)
        if checkpoint_slot >= 0:
            hint = HINT * (self._klass.item(checkpoint_slot) // HINT)  # a client's hint holds through reads
            self._klass[checkpoint_slot] = self.class_after_read(block_hashes[usable - 1], cls, now) + hint
        model.ticket(block_hashes[run:], cls)
        size = cols.size.item
        held = [size(s) for s in mla_slots]  # O(run) in Python as the guard's own walk, without 3 array calls
        ck_size = size(checkpoint_slot) if checkpoint_slot >= 0 else 0
        self.guard.lookup(block_hashes, usable, joint, held, ck_size)

    def on_hint(self, cols: PolicyColumns, slots: Sequence[int], ttl_ms: int) -> None:
        """A client asked to retain the chains these checkpoints close for ``ttl_ms`` (a session pin,
        granted or refused): their class takes the hint's tier, so the model learns how hinted chains
        return apart from the rest."""
        for slot in slots:
            if slot < len(self._klass) and int(cols.kind[slot]) == KIND_KDA:
                self._klass[slot] = hinted_class(int(self._klass[slot]), ttl_ms)

    def admission_floor(self) -> float:
        """The least sampling rate admission may use. Refusals are predictions too, and they cost hits
        where the cache holds nearly everything: admission may sample new chains only while the cache
        serves at least ``ADMISSION_LEAD`` x the blocks the shadow LRU would (recent lookups); otherwise,
        and as far as the guard has fallen back towards recency, it admits everything."""
        guard = self.guard
        return 1.0 if guard.lead < ADMISSION_LEAD else 1.0 - guard.w

    def class_after_read(self, block_hash: bytes, request_class: int, now: float) -> int:
        """Class of a checkpoint just read by a request of ``request_class``: its next return is that of a
        chain read again (a yardstick overrides it with what it knows)."""
        return request_class + READ

    def on_evict(self, cols: PolicyColumns, slot: int, key: bytes, now: float) -> None:
        """An object left by pressure: a checkpoint becomes a ghost whose return (or not) is observed."""
        if cols.kind.item(slot) == KIND_KDA:
            self.model.ghost(key[1:], self._klass.item(slot), cols.last_use.item(slot), now)

    # ------------------------------------------------------------------ ranking

    def _refresh(self, cols: PolicyColumns, now: float) -> None:
        """Rebuild the model's table with the cached checkpoints as still at risk (one vector pass over
        the columns: live slots of kind KDA)."""
        n = min(len(self._klass), len(cols.kind))
        live = np.flatnonzero(((cols.flags[:n] & SLOT_LIVE) != 0) & (cols.kind[:n] == KIND_KDA))
        self.model.rebuild(now, self._klass[live], now - cols.last_use[live])

    def score_one(self, cols: PolicyColumns, slot: int, now: float) -> float:
        """``scores`` of one slot (the module's contract): the common case, an anchor the eviction pass
        just exposed, is a dead block, scored without the vector path's dozen array operations."""
        if cols.kind.item(slot) != KIND_MLA or cols.deps.item(slot):
            return float(self.scores(cols, np.array([slot]), now)[0])
        # a dead block: the vector path's value, computed with scalars
        rec = -math.log2(max(now - cols.last_use.item(slot), MIN_AGE_S))
        w = self.guard.w
        if w > 0 and self.model.observed >= self.min_observations:
            rec -= w * math.log2(max(cols.size.item(slot), 1))
        return rec - DEAD_FIRST

    def scores(self, cols: PolicyColumns, slots: np.ndarray, now: float) -> np.ndarray:
        w = self.guard.w
        model = self.model
        if len(slots) == 1 and cols.kind[slots[0]] == KIND_MLA and cols.deps[slots[0]] == 0:
            return np.array([self.score_one(cols, int(slots[0]), now)])  # a dead block: score_one's path
        age = np.maximum(now - cols.last_use[slots], MIN_AGE_S)
        rec = -np.log2(age)
        kind = cols.kind[slots]
        if w > 0 and model.observed >= self.min_observations:
            if model.stale(now):
                self._refresh(cols, now)
            ck = kind == KIND_KDA
            size = np.log2(np.maximum(cols.size[slots], 1).astype(np.float64))
            pred = rec - size
            cks = slots[ck]
            pred[ck] = (
                model.log_rates(self._klass[cks], age[ck])
                + self.depth_weight * np.log2(np.maximum(cols.depth[cks], 1).astype(np.float64))
                - size[ck]
            )
            s = w * pred + (1.0 - w) * rec
        else:
            s = rec
        s[(kind == KIND_MLA) & (cols.deps[slots] == 0)] -= DEAD_FIRST
        return s


ADMISSION_LEAD = 1.1  # admission samples new chains only while the cache beats the shadow LRU by 10 %
MIN_AGE_S = 1e-3  # ages below a millisecond rank as a millisecond (log2 stays finite)
DEAD_FIRST = 1e6  # subtracted from a dead block's score: below every live object's

POLICIES: dict[str, type] = {
    "hybrid": HybridPolicy,
    "depth": DepthRecencyPolicy,
    "lru": LRUPolicy,
    "lfu": AgedLFUPolicy,
    "cost": CostAwarePolicy,
}


def make_policy(name: str, **params: float) -> EvictionPolicy:
    """Build the policy called ``name`` (see :data:`POLICIES`) with optional parameters (``half_life_s``
    for lfu and cost, ``depth_weight`` for hybrid)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
    if cls is LRUPolicy:
        return LRUPolicy()
    if cls is HybridPolicy:
        return HybridPolicy(depth_weight=float(params.get("depth_weight", 0.5)))
    if cls is DepthRecencyPolicy:
        return DepthRecencyPolicy(depth_weight=float(params.get("depth_weight", 0.5)))
    half_life = float(params.get("half_life_s", 600.0))
    if not math.isfinite(half_life):
        raise ValueError("half_life_s must be finite")
    return cls(half_life_s=half_life)
