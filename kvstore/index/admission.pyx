# cython: language_level=3, boundscheck=True, wraparound=False
"""Admission control for a hybrid cache: which new chains are worth their bytes, learned from ghosts.

Why: on a K3-class model a chain's new objects cost one 429 MiB KDA checkpoint plus 13.5 MiB per MLA
block, and most of them are never read again (on the Mooncake conversation trace two in three checkpoints
are not). Under LRU every write pushes out something older, so at small capacities everything is evicted
before its reuse arrives. Refusing the writes least likely to be reused lets the admitted ones live long
enough to hit.

Mechanism (docs/design/eviction.md, "hybrid"), decided per *chain* at the writer's lookup and applied
per object at its put:

1. **Ghosts.** A bounded LRU set of block hashes (32 bytes each, no object bytes) of what was refused or
   evicted. A lookup that walks past the real MLA run over ghost hashes proves that a chain the cache did
   not keep came back: the new turn of a conversation, a re-sent document.
2. **Verdict at the lookup** (``on_lookup``, the prefill's fetch): the request will write the blocks its
   lookup missed. They are admitted when the chain is a *continuation* (real run + ghost run covers at
   least ``continuation_fraction`` of the looked-up blocks: continued chains are reused about twice as
   often as new ones) or, for new chains, when the chain is *sampled*: the first missing block's hash,
   read as a number in [0, 1), is below the sampling rate ``q``. The verdict is remembered per missing
   block hash (a *ticket*) for ``ticket_ms``, the time a put may follow its lookup.
3. **Verdict at the put** (``admit``): a ticketed block (or the checkpoint keyed by it) gets its ticket's
   verdict. An unticketed object (a reply's blocks, a put without a lookup) follows its chain: refused when
   its parent (MLA) or its own block (checkpoint) was refused and is not cached, admitted otherwise.
4. **Adaptive q** (ARC-style; every signal weighs bytes / capacity): a lookup whose ghost run covers
   *refused* blocks is a hit that admission cost: q grows by ``step`` x their bytes / capacity. One that
   covers *evicted* blocks is a reuse that came too late for what the cache admitted, and an object
   evicted never read after its write was an admission wasted: both shrink q by the factor
   (1 - ``step`` x bytes / capacity). Large caches evict little, so q stays at 1 (admit everything: the
   eviction order alone); small ones settle where refused reuse and wasted writes balance.

Pure and clock-injected like the index that owns it, so the master and the simulator decide alike.

Compiled (``admission.h``) because admission sees every put and every eviction: as OrderedDicts behind a
Python call per block it cost 0.6 s of a 2.5 s simulated point. The index calls the C++ object directly
(``PrefixIndex`` takes its address from ``_address``) with its own clock's time; the methods here are the
same decisions for Python callers. The plain-Python original is the oracle (tests/oracle/admission.py).
"""

import math
from dataclasses import dataclass

from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int32_t, int64_t, uint8_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

from lru_keys cimport LruKeys, lru_items

from kvpool.kvstore.keys import HASH_BYTES


cdef extern from "admission.h" namespace "kvpool":
    cdef struct AdmissionParams:
        double continuation_fraction, initial_rate, min_rate, step
        int64_t ghost_entries
        double ticket_s

    cdef cppclass CAdmission "kvpool::Admission":
        CAdmission(const AdmissionParams& p) except +
        void remember(const uint8_t* h, int64_t size, cbool refused) except +
        void evicted(const uint8_t* h, int64_t size, int64_t capacity, cbool unread) except +
        void on_lookup(const uint8_t* hashes, size_t n, size_t run, int64_t capacity, double now) except +
        cbool admit(const uint8_t* h, int64_t size, double now, const uint8_t* hangs_on, cbool hangs_on_cached) except +
        cbool was_refused(const uint8_t* h)
        int ticket(const uint8_t* h, double* until)
        const LruKeys& ghosts()
        const LruKeys& tickets()
        double rate, floor
        int64_t refused, admitted

CAPSULE = b"kvpool.Admission"  # the name of ``_address``'s capsule


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Admission tunables (master flags ``--admission-*``)."""

    continuation_fraction: float = 0.8  # real + ghost run share of the lookup that marks a continuation
    initial_rate: float = 1.0  # q at start: admit everything until evictions say otherwise
    min_rate: float = 0.02  # q never drops below this, so new chains can always prove themselves
    step: float = 0.2  # learning rate of q: per signal, bytes / capacity x step
    ghost_entries: int = 1 << 18  # block hashes remembered (~100 bytes each)
    ticket_ms: int = 30_000  # how long a lookup's verdict waits for its puts

    def check(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("continuation_fraction", "initial_rate", "min_rate", "step"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"admission {name} must be in [0, 1], got {v!r}")
        if self.min_rate > self.initial_rate:
            raise ValueError("admission min_rate must not exceed initial_rate")
        if self.ghost_entries < 0 or self.ticket_ms <= 0:
            raise ValueError("admission ghost_entries must be >= 0 and ticket_ms > 0")


cdef const uint8_t* _hash(bytes h) except NULL:
    if len(h) != HASH_BYTES:
        raise ValueError(f"a block hash must be {HASH_BYTES} bytes, got {len(h)}")
    return <const uint8_t*><const char*>h


cdef class Admission:
    """Ghosts, tickets and the adaptive sampling rate of one index (see the module docstring)."""

    cdef CAdmission* _a
    cdef readonly object config
    cdef object _clock

    def __cinit__(self, config, clock):
        config.check()
        cdef AdmissionParams p
        p.continuation_fraction = config.continuation_fraction
        p.initial_rate = config.initial_rate
        p.min_rate = config.min_rate
        p.step = config.step
        p.ghost_entries = min(config.ghost_entries, 1 << 62)
        p.ticket_s = config.ticket_ms / 1000.0
        self._a = new CAdmission(p)
        self.config = config
        self._clock = clock

    def __dealloc__(self):
        del self._a

    def _address(self):
        """The C++ object, for ``PrefixIndex`` (which keeps this object alive while it uses it)."""
        return PyCapsule_New(<void*>self._a, CAPSULE, NULL)

    @property
    def rate(self) -> float:
        """q, the sampling rate of new chains as learned."""
        return self._a.rate

    @property
    def floor(self) -> float:
        """The least sampling rate in force: the default policy raises it as far as its recency guard has
        fallen back towards LRU (1 - w), so a cache where refusals cost hits admits everything."""
        return self._a.floor

    @floor.setter
    def floor(self, double value):
        self._a.floor = value

    @property
    def refused(self) -> int:
        """Objects refused since start."""
        return self._a.refused

    @property
    def admitted(self) -> int:
        """Ticketed objects admitted since start."""
        return self._a.admitted

    def remember(self, bytes block_hash not None, size, *, refused) -> None:
        """Add a block hash to the ghosts (``size`` bytes refused, or evicted), oldest forgotten first."""
        self._a.remember(_hash(block_hash), size, refused)

    def evicted(self, bytes block_hash not None, size, capacity, *, unread) -> None:
        """An MLA block or checkpoint left the cache by pressure; ``unread``: never read after its write,
        so admission spent its bytes for nothing."""
        self._a.evicted(_hash(block_hash), size, capacity, unread)

    def on_lookup(self, block_hashes, Py_ssize_t run, capacity) -> None:
        """A writer's lookup (``run`` MLA blocks cached): learn from its ghost run, then ticket the blocks
        it will write."""
        cdef vector[uint8_t] hashes
        cdef bytes h
        for x in block_hashes:
            h = x
            hashes.insert(hashes.end(), _hash(h), _hash(h) + 32)
        if run < 0:
            raise ValueError(f"a lookup's cached run must be >= 0, got {run}")
        self._a.on_lookup(hashes.data(), hashes.size() // 32, run, capacity, self._clock())

    def admit(self, bytes block_hash not None, size, bytes hangs_on not None, find) -> bool:
        """Whether an MLA block or checkpoint of ``block_hash`` (``size`` bytes) may be written. An
        unticketed object follows its chain: refused when ``hangs_on`` (the key of its parent block, or of
        a checkpoint's own block; b"" for none) was refused and is not cached (``find`` gives None)."""
        cdef const uint8_t* parent = NULL
        if len(hangs_on) == 1 + HASH_BYTES:  # a tag and a block hash: only those can be ghosts
            parent = <const uint8_t*><const char*>hangs_on + 1
        cached = bool(hangs_on) and find(hangs_on) is not None
        return self._a.admit(_hash(block_hash), size, self._clock(), parent, cached)

    def was_refused(self, bytes block_hash not None) -> bool:
        """Whether the latest ghost of ``block_hash`` is a refusal."""
        return len(block_hash) == HASH_BYTES and self._a.was_refused(<const uint8_t*><const char*>block_hash)

    def ghosts(self) -> list:
        """``(block hash, bytes)`` oldest first, bytes > 0 for a refusal (tests compare with the oracle)."""
        return lru_items(&self._a.ghosts())

    def tickets(self) -> dict:
        """``{block hash: (verdict, lapses at)}`` of the tickets held."""
        cdef vector[int32_t] order
        cdef const LruKeys* t = &self._a.tickets()
        cdef double until = 0.0
        cdef int verdict
        t.order(&order)
        out = {}
        for e in order:
            h = t.key_data(e)[:t.key_len(e)]
            verdict = self._a.ticket(<const uint8_t*><const char*>h, &until)
            out[h] = (verdict == 1, until)
        return out
