"""Eviction policies for the prefix index: who goes first among the objects that *may* go.

The index decides which objects are eligible (leaf-first, unpinned, unleased, committed); a policy only
ranks them. Ranking is vectorised over the index's columns (numpy arrays indexed by slot) so one
eviction round over a million objects is a handful of array operations, not a Python loop.

Contract: ``scores(cols, slots, now)`` returns one float per slot, **lower = evicted first**; ties break by
slot order (the index uses a stable sort), so a policy is deterministic for a given clock. ``touch`` is
called when an object is inserted or really used (a fetch, never a probe), and may update ``last_use``
and ``freq`` only.

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
from typing import Protocol

import numpy as np

KIND_MLA = 1
KIND_KDA = 2  # mirrors kvpool.v1.ObjectKind.KDA_CHECKPOINT (kept numeric: this module has no proto import)


class PolicyColumns(Protocol):
    """The per-slot arrays a policy may read (and, in ``touch``, write)."""

    last_use: np.ndarray  # float64 seconds on the index clock
    freq: np.ndarray  # float32 aged hit count, as of last_use
    size: np.ndarray  # uint64 bytes
    depth: np.ndarray  # uint16 blocks from the chain root (1 = first block), saturating
    kind: np.ndarray  # uint8 ObjectKind
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


class HybridPolicy(LRUPolicy):
    """Dead MLA blocks first, then the lowest *depth-weighted recency*; with admission control.

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

    name = "hybrid"
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


MIN_AGE_S = 1e-3  # ages below a millisecond rank as a millisecond (log2 stays finite)
DEAD_FIRST = 1e6  # subtracted from a dead block's score: below every live object's

POLICIES: dict[str, type] = {
    "hybrid": HybridPolicy,
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
    half_life = float(params.get("half_life_s", 600.0))
    if not math.isfinite(half_life):
        raise ValueError("half_life_s must be finite")
    return cls(half_life_s=half_life)
