"""The oracle of the compiled recency guard (``kvstore/index/recency_guard.pyx`` over ``recency_guard.h``):
the plain-Python original, kept as it was, so that tests/test_index_core_guard.py holds the compiled one to
its answers.

The mechanism and its reasons are in the compiled module's docstring (``kvstore/index/recency_guard.pyx``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from kvpool.kvstore.keys import KDA_TAG, MLA_TAG

RECENT = 0.002  # weight of one lookup in the moving sums behind ``lead``


class RecencyGuard:
    """Shadow LRU over keys and sizes, and the learned weight ``w`` of predictions (module docstring)."""

    __slots__ = (
        "_bytes",
        "_capacity",
        "_lru",
        "_mean_n",
        "_recent",
        "fill",
        "lead",
        "ours",
        "shadow",
        "step",
        "w",
    )

    def __init__(self, initial: float = 1.0, step: float = 0.05, fill: float = 0.9) -> None:
        for name, v in (("initial", initial), ("step", step), ("fill", fill)):
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"guard {name} must be in [0, 1], got {v!r}")
        self.w = initial
        self.step = step
        self.fill = fill  # the shadow holds fill x capacity (between the index's watermarks)
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._capacity = 0  # the real cache's, as of the last put
        self._mean_n = 0.0  # moving mean of the blocks a lookup covers
        self._recent = [0.0, 0.0]  # moving sums (about the last 500 lookups) of blocks served: ours, shadow
        self.lead = math.inf  # ours / shadow over the recent lookups (unknown until either serves a block)
        self.ours = 0  # blocks served by the real cache over the lookups scored
        self.shadow = 0  # blocks the shadow LRU would have served

    def put(self, key: bytes, size: int, capacity: int) -> None:
        """A writer puts ``key`` (whether or not the real cache admits it): LRU would store it."""
        self._capacity = capacity
        lru = self._lru
        if key in lru:
            lru.move_to_end(key)  # EXISTS: the store refreshes a present object a writer puts again
            return
        lru[key] = size
        self._bytes += size
        if capacity > 0 and self._bytes > self.fill * capacity:  # _trim's own test, without the call
            self._trim()

    def _trim(self) -> None:
        lru = self._lru
        limit = self.fill * self._capacity if self._capacity > 0 else math.inf
        while self._bytes > limit and lru:
            self._bytes -= lru.popitem(last=False)[1]

    def lookup(
        self,
        block_hashes: Sequence[bytes],
        ours: int,
        joint: bool = True,
        held: Sequence[int] = (),
        checkpoint_size: int = 0,
    ) -> None:
        """A writer's lookup served ``ours`` blocks from the real cache (the compiled ``lookup`` says why
        the shadow takes ``held`` and ``checkpoint_size``)."""
        lru = self._lru
        run = 0
        for h in block_hashes:
            if MLA_TAG + h not in lru:
                break
            run += 1
        usable = 0 if joint else run
        for i in range(run if joint else 0, 0, -1):
            if KDA_TAG + block_hashes[i - 1] in lru:
                usable = i
                break
        # the whole run, not only what it serves: the index never evicts a block with dependents, so a
        # chain's inner blocks live as long as its newest leaf; touching the run is the shadow's stand-in
        for h in block_hashes[:run]:
            lru.move_to_end(MLA_TAG + h)
        if usable and joint:
            lru.move_to_end(KDA_TAG + block_hashes[usable - 1])
        n = len(block_hashes)
        self.ours += ours
        self.shadow += usable
        # normalised by the mean lookup, not this one's length: the sum of the moves follows the blocks
        # (tokens) each side served, which is what the hit rate counts
        self._mean_n += 0.01 * (n - self._mean_n)
        r = self._recent
        r[0] += RECENT * (ours - r[0])
        r[1] += RECENT * (usable - r[1])
        if r[1] > 0:
            self.lead = r[0] / r[1]
        elif r[0] > 0:
            self.lead = math.inf
        if ours != usable:
            self.w = min(1.0, max(0.0, self.w + self.step * (ours - usable) / max(self._mean_n, 1.0)))
        if len(held) > run or (checkpoint_size and ours > usable):
            for j in range(run, len(held)):
                key = MLA_TAG + block_hashes[j]
                if key not in lru:
                    lru[key] = held[j]
                    self._bytes += held[j]
            if checkpoint_size and ours > usable:
                key = KDA_TAG + block_hashes[ours - 1]
                if key not in lru:
                    lru[key] = checkpoint_size
                    self._bytes += checkpoint_size
            self._trim()
