# cython: language_level=3, boundscheck=True, wraparound=False
"""The default policy's safety net: a shadow LRU cache of keys only, and the weight the policy gives its
predictions against plain recency, learned from how the two caches actually do on the same lookups.

Why: a predictor trained on one traffic mix can be wrong on another (an agent loop re-reads its prefix
every few seconds, a batch job never re-reads), and then it evicts what LRU would have kept. Rather than
a fixed switch, the index runs LRU beside itself on metadata (keys and sizes, no bytes) at the same
capacity, and every writer's lookup scores both: the blocks the real cache serves against the blocks the
shadow LRU would have served (joint rule: MLA run closed by a checkpoint). The weight ``w`` of the
prediction moves by ``step`` x (ours - shadow) / (mean looked-up blocks) per lookup, clipped to [0, 1]:
while the predictions pay, ``w`` rises towards pure prediction; when they stop paying it falls towards
recency, where the policy ranks as LRU does. ``w`` starts at ``initial``.

Compiled (``recency_guard.h``) because the shadow sees every put: as an ``OrderedDict`` behind two Python
calls per block it cost 0.37 s of a 2.5 s simulated point. The index calls the C++ object directly for
each put (``PrefixIndex`` takes its address from ``_address``); the policy calls ``lookup`` once per
writer's lookup. The plain-Python original is the oracle (tests/oracle/recency_guard.py).

Cost: the shadow holds the keys an LRU cache of this capacity would hold (about as many as the index
itself), a 38-byte key-table entry, 5-11 bytes of 4-byte buckets and 16 bytes of order and size each.
"""

from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int32_t, int64_t, uint8_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

from lru_keys cimport LruKeys, lru_items

import math

from kvpool.kvstore.keys import HASH_BYTES, KDA_TAG, MLA_TAG


cdef extern from "recency_guard.h" namespace "kvpool":
    cdef cppclass CGuard "kvpool::RecencyGuard":
        CGuard(double initial, double step, double fill) except +
        void put(const uint8_t* key, size_t length, int64_t size, int64_t capacity) except +
        cbool lookup(const uint8_t* hashes, size_t n, int64_t ours, cbool joint, const int64_t* held,
                     size_t n_held, int64_t ck_size) except +
        size_t size()
        int64_t held_bytes()
        const LruKeys& keys()
        double w, step, fill, lead
        int64_t ours, shadow

cdef extern from "recency_guard.h":
    const uint8_t C_MLA "kvpool::RecencyGuard::MLA"
    const uint8_t C_KDA "kvpool::RecencyGuard::KDA"

if bytes([C_MLA]) != MLA_TAG or bytes([C_KDA]) != KDA_TAG:  # the header spells the tags out
    raise ImportError("recency_guard.h's key tags differ from kvstore/keys.py's")

CAPSULE = b"kvpool.RecencyGuard"  # the name of ``_address``'s capsule


cdef class RecencyGuard:
    """Shadow LRU over keys and sizes, and the learned weight ``w`` of predictions (module docstring)."""

    cdef CGuard* _g

    def __cinit__(self, double initial=1.0, double step=0.05, double fill=0.9):
        for name, v in (("initial", initial), ("step", step), ("fill", fill)):
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"guard {name} must be in [0, 1], got {v!r}")
        self._g = new CGuard(initial, step, fill)

    def __dealloc__(self):
        del self._g

    def _address(self):
        """The C++ object, for ``PrefixIndex`` (which keeps this guard alive while it uses it)."""
        return PyCapsule_New(<void*>self._g, CAPSULE, NULL)

    @property
    def w(self) -> float:
        return self._g.w

    @w.setter
    def w(self, double value):
        self._g.w = value

    @property
    def step(self) -> float:
        return self._g.step

    @property
    def fill(self) -> float:
        return self._g.fill

    @property
    def lead(self) -> float:
        """Blocks ours / shadow over about the last 500 lookups (inf until either serves a block)."""
        return self._g.lead

    @property
    def ours(self) -> int:
        return self._g.ours

    @property
    def shadow(self) -> int:
        return self._g.shadow

    def __len__(self):
        return self._g.size()

    def held_bytes(self) -> int:
        return self._g.held_bytes()

    def keys(self) -> list:
        """``(key, size)`` oldest first: what the shadow holds (tests compare it with the oracle's)."""
        return lru_items(&self._g.keys())

    def put(self, bytes key not None, size, capacity) -> None:
        """A writer puts ``key`` (whether or not the real cache admits it): LRU would store it."""
        self._g.put(<const uint8_t*><const char*>key, len(key), size, capacity)

    def lookup(self, block_hashes, ours, joint=True, held=(), checkpoint_size=0) -> None:
        """A writer's lookup served ``ours`` blocks from the real cache: score the shadow on the same
        blocks (``joint``: an MLA run counts up to its last checkpoint, as the real match does), touch what
        it would have served, and move ``w``.

        ``held``: sizes of the MLA blocks the real cache holds on this chain (its run), ``checkpoint_size``
        of the checkpoint it served. The writer need not put them again (it fetched them), but an LRU cache that
        lacked them would have them written now: the shadow takes them, or it would fall further behind
        with every object the real cache kept and LRU did not (a shadow never rewritten)."""
        cdef vector[uint8_t] hashes
        cdef vector[int64_t] sizes
        cdef bytes h
        for x in block_hashes:
            h = x
            if len(h) != HASH_BYTES:
                raise ValueError(f"a block hash must be {HASH_BYTES} bytes, got {len(h)}")
            hashes.insert(hashes.end(), <const uint8_t*><const char*>h, <const uint8_t*><const char*>h + 32)
        for s in held:
            sizes.push_back(s)
        cdef size_t n = hashes.size() // 32
        if not self._g.lookup(hashes.data(), n, ours, joint, sizes.data(), sizes.size(), checkpoint_size):
            raise ValueError(
                f"a lookup of {n} blocks cannot have served {ours} of them or hold {sizes.size()} of them"
            )
