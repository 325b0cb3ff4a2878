# cython: language_level=3, wraparound=False, embedsignature=True
# distutils: language = c++
"""PrefixIndex: the master's in-memory object index, prefix matcher, pin table and byte-based evictor.

Compiled (Cython over ``key_table.h``): every master call and every simulated request goes through this
class, per block, so its data lives in C arrays and its per-block loops run without the interpreter. The
plain-Python index it replaced is kept as the test oracle (``tests/oracle/prefix_index.py``); the
differential test drives both with random operation sequences and requires the same answers, and the
simulator's hit counts on the bundled traces equal the oracle's (docs/design/index_core.md).

Pure and deterministic: no network, no threads, no wall clock (``clock`` is injected), so the master and
the offline trace simulator (``kvpool replay --sim``) run the very same code and agree on hit rates. Not
thread-safe: the master calls it from one event loop.

API (all sizes in bytes, all durations in ms, ``now`` always from ``clock()`` in seconds)::

    idx = PrefixIndex(policy="lru", high_watermark=0.95, low_watermark=0.85, lease_ms=5000, clock=fn)
    idx.add_node(node_id, dram_bytes, ssd_bytes=0)      # capacity per node and tier; re-adding updates it
    idx.remove_node(node_id) -> list[Removal]           # node died: every object on it leaves the index
    idx.insert(key, kind, size, node_id=None, tier=Tier.DRAM, tenant="", parent=b"", checksum=0,
               ttl_ms=0, pending=False, evict=True, avoid_node=None) -> node_id
    idx.insert_chain(hashes, sizes, admits, [(c, size, admit), ...], node_id=..., tenant="") -> list[int]
    idx.commit(key); idx.remove(key, reason="removed") -> bool; idx.promote(key) -> bool
    idx.reserve(objects)                                # size once for a bulk load (a node's inventory)
    idx.match_prefix(block_hashes, require_checkpoint=True, touch=False) -> PrefixMatch
    idx.lookup(keys, touch=False) -> list[ObjectInfo | None]; idx.get(key) -> ObjectInfo | None
    idx.rows(keys) -> list[LocationRow]; idx.columns(slots) -> (sizes, checksums, tiers, node ids)
    iter(idx); idx.pending_keys()                       # in slot order
    idx.acquire(keys, lease_ms=None) -> Lease | None; idx.release(lease_id) -> bool     # read pins
    idx.pin(keys, ttl_ms, session="") -> int           # soft pin within the pin budget; ttl_ms=0 unpins
    idx.end_session(tenant, session) -> int             # release every pin the session holds
    idx.set_quota(tenant, max_bytes)                    # 0 = unlimited
    idx.expire() -> list[Removal]; idx.evict() -> list[Removal]; idx.drain_events() -> list[Removal]
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
  ``match_prefix`` read "h has a checkpoint" as one bit of the MLA slot (``CKPT``).
- **Dependencies.** An MLA block depends on its ``parent`` (previous MLA block); a KDA checkpoint keyed by
  h_i depends on the MLA block h_i; a tail/blob depends on its ``parent`` if given. ``deps[slot]`` counts
  live dependents; nothing with dependents is ever *evicted* (dropped by pressure), so the cache is always
  a forest of usable prefixes: leaves and suffixes go first, and a checkpoint is always a leaf. Explicit
  removal, TTL expiry and node loss may orphan dependents; they stay correct (matching stops at the gap)
  and are re-linked if the missing object comes back (the key table keeps the absent key's entry, with
  its count of waiting dependents, while any waits).
- **Eviction by bytes**, per (node, tier) pool: when a pool passes ``high_watermark`` x capacity it is
  drained to ``low_watermark`` in policy order (``eviction``). A DRAM pool on a node with an SSD tier
  demotes instead (the object stays indexed with tier SSD, the SSD pool has its own watermark and drops
  leaves). Leased, soft-pinned and pending objects are never candidates. Admission (``admission``, policy
  ``hybrid``) may refuse a new chain's blocks up front. Candidates are ranked by the policy's vectorised
  ``scores`` and sorted stably (ties by slot); anchors that become leaves during a pass are merged in by
  score, after the candidates of an equal score.
- **Object cap** (``max_objects``, 0 = none): past ``high_watermark`` x the cap, leaves of any pool are
  dropped in policy order down to ``low_watermark`` x the cap; an insert that would pass the cap with
  nothing evictable raises :class:`CapacityError`.
- **Quotas**: a tenant whose bytes would exceed its quota drops its own evictable objects first; if that
  is not enough the insert raises :class:`QuotaExceededError`.
- **Pins** (``pin_table``, budgeted by ``pin_budget``): held per (tenant, session) with a deadline each; a
  session pin past the budget pins nothing and is counted (``pins_refused``); ``end_session`` releases
  what a session holds.

Memory (docs/design/index_core.md): keys in the C++ key table (one 38-byte entry and 5-11 bytes of 4-byte
buckets per key, no Python object per indexed object), and per slot the numpy columns of ``records.Columns`` (the
policies read them; the slot's key entry and anchor entry are two of them). Tenants and node ids are
interned to 16-bit ids; children are counted, not listed. Read-lease counts are a C++ map of the slots
leased now; pins, leases and TTLs (a few per request, not per block) stay in Python structures.

Errors cross the boundary as the typed exceptions of ``records`` (raised by this module's Python-level
checks before any state changes); the C++ table throws only ``std::length_error``/``std::bad_alloc`` on
impossible sizes, which Cython turns into ``RuntimeError``/``MemoryError``.
"""

import collections
import heapq
import itertools
import operator
import os
import time

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.math cimport fmax, log2
from libc.string cimport memcmp, memcpy
from libcpp cimport bool as cbool
from libcpp.pair cimport pair
from libcpp.set cimport set as cset
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector
from libcpp.algorithm cimport pop_heap, push_heap
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.pycapsule cimport PyCapsule_GetPointer
from cython.operator cimport dereference as deref, preincrement as inc

from lru_keys cimport LruKeys

from kvpool.kvstore.index.admission import CAPSULE as ADMISSION_CAPSULE, Admission, AdmissionConfig
from kvpool.kvstore.index.eviction import DEAD_FIRST, MIN_AGE_S, HybridPolicy, LRUPolicy, make_policy
from kvpool.kvstore.index.lru_map import CAPSULE as TICKETS_CAPSULE, LruMap
from kvpool.kvstore.index.recency_guard import CAPSULE as GUARD_CAPSULE, RecencyGuard
from kvpool.kvstore.index.return_time import BEYOND, GAP, HINT, READ, ReturnTimeModel
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

cdef extern from "key_table.h" namespace "kvpool":
    cdef cppclass KeyTable:
        KeyTable(uint64_t seed) except +
        size_t size()
        cbool valid(int32_t e)
        int32_t find(const uint8_t* key, size_t length)
        void find_many(const uint8_t* keys, size_t n, size_t length, int32_t* out) except +
        int32_t intern(const uint8_t* key, size_t length) except +
        void erase(int32_t e) except +
        int32_t slot(int32_t e)
        void set_slot(int32_t e, int32_t s)
        uint32_t waiting(int32_t e)
        void set_waiting(int32_t e, uint32_t n) except +
        size_t key_len(int32_t e)
        const uint8_t* key_data(int32_t e)
        size_t id_bound()
        size_t room()
        size_t max_entries()
        size_t memory_bytes()
        void clear() except +

cdef extern from "recency_guard.h" namespace "kvpool":
    cdef cppclass CGuard "kvpool::RecencyGuard":
        void put(const uint8_t* key, size_t length, int64_t size, int64_t capacity) except +
        double w

cdef int64_t C_BEYOND = BEYOND, C_GAP = GAP, C_HINT = HINT, C_READ = READ  # return_time's class arithmetic
cdef double C_DEAD_FIRST = DEAD_FIRST
cdef double C_MIN_AGE_S = MIN_AGE_S

cdef extern from "admission.h" namespace "kvpool":
    cdef cppclass CAdmission "kvpool::Admission":
        void evicted(const uint8_t* h, int64_t size, int64_t capacity, cbool unread) except +
        void on_lookup(const uint8_t* hashes, size_t n, size_t run, int64_t capacity, double now) except +
        cbool admit(const uint8_t* h, int64_t size, double now, const uint8_t* hangs_on, cbool hangs_on_cached) except +
        double floor

# the flags column's bits (eviction.SLOT_LIVE mirrors LIVE), kinds and tiers: C constants for per-block code
cdef enum:
    LIVE = 1
    PENDING = 2
    PINNED = 4
    CKPT = 8
    ORDERED = 16  # the slot is in its pool's LRU order (``_order``); never seen outside this module
    TOUCHED = 32  # counted by the touch in progress (``_touch``); clear outside it
    LEASED = 64  # the slot has read leases, counted in ``_lease_count``; never seen outside this module
    MOVABLE = LIVE | PENDING | PINNED
    K_MLA = 1
    K_KDA = 2
    K_TAIL = 3
    T_DRAM = 1
    T_SSD = 2
    N_TIERS = 3  # tier values 1 and 2 index the per-node arrays directly
    # what a drain pass works for
    FOR_POOL = 0
    FOR_OBJECTS = 1
    FOR_TENANT = 2

cdef unsigned char C_MLA_TAG = ord("M")
cdef unsigned char C_KDA_TAG = ord("K")

_TAIL = ObjectKind.TAIL
_TAG_OF_KIND = {ObjectKind.MLA: MLA_TAG, ObjectKind.KDA: KDA_TAG}
_TIERS = (None, Tier.DRAM, Tier.SSD)  # a tier column value -> its member

INITIAL_SLOTS = 1024


def check_object(key, kind, size, ttl_ms, checksum):
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


cdef inline int _block_kind(bytes key, kind, size) except -2:
    """The kind of a plain block object (an MLA block or checkpoint with its key's tag, a positive int size)
    without the Python checks, or -1: then ``check_object`` decides (and words the error). TTL and checksum
    are not looked at: a caller that takes them checks them itself (``insert``). The simulator puts
    hundreds of thousands of these per trace."""
    if type(size) is not int or size <= 0 or len(key) != 33:
        return -1
    cdef int k
    if (type(kind) is int or isinstance(kind, ObjectKind)) and 0 < kind < 256:
        k = kind
    else:
        return -1
    cdef unsigned char tag = (<const unsigned char*><const char*>key)[0]
    if (k == K_MLA and tag == C_MLA_TAG) or (k == K_KDA and tag == C_KDA_TAG):
        return k
    return -1


cdef inline object _as_key(object key):
    """Keys are bytes; a bytes-like key (memoryview, bytearray) is copied once at the boundary; anything else
    is None, which every lookup reads as absent (as a dict lookup of a non-bytes key would find nothing)."""
    if type(key) is bytes:
        return key
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    return None


INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1


cdef inline bint _fits_int64(object n):
    """An int at most 2^63 - 1, without a Python comparison (a put's common case)."""
    cdef int overflow = 0
    PyLong_AsLongLongAndOverflow(n, &overflow)
    return overflow <= 0


cdef Py_ssize_t _checkpoint_at(object at, Py_ssize_t n) except -1:
    """A chain checkpoint's block count, an integer in 1..n, or ``BadObjectError``."""
    try:
        c = operator.index(at)
    except TypeError:
        raise BadObjectError(f"a checkpoint's block count must be an integer, got {type(at).__name__}") from None
    if not 0 < c <= n:
        raise BadObjectError(f"a checkpoint closes block 1..{n} of the chain, got {c}")
    return c


cdef inline bytes _tagged(unsigned char tag, bytes block_hash):
    """``tag + block_hash`` (a checked 32-byte hash): made in place, not by bytes' concatenation, which
    asks both operands for their buffers."""
    cdef bytes key = PyBytes_FromStringAndSize(NULL, 33)
    cdef char* p = PyBytes_AS_STRING(key)
    p[0] = <char>tag
    memcpy(p + 1, <const char*>block_hash, 32)
    return key


cdef inline object _positive_size(object size):
    """A chain put's size as a Python int > 0 (an integer of any type), or ``BadObjectError``."""
    if type(size) is int and size > 0:  # the simulator's every put: no operator.index call
        return size
    try:
        n = operator.index(size)
    except TypeError:
        raise BadObjectError(f"a size must be an integer, got {type(size).__name__}") from None
    if n <= 0:
        raise BadObjectError(f"size must be > 0, got {n}")
    return n


cdef inline object _put_key(object key):
    """A put's key as bytes, or ``BadObjectError``: only bytes-like keys are indexed."""
    k = _as_key(key)
    if k is None:
        raise BadObjectError(f"a key must be bytes, got {type(key).__name__}")
    return k


ctypedef pair[double, int32_t] OrderKey  # (last_use, slot): LRU's score, ties by slot


cdef class PrefixIndex:
    """Object index + prefix matcher + pins + eviction. See the module docstring for the rules."""

    cdef KeyTable* _table
    # Under plain LRU, each pool's evictable leaves in eviction order, kept as they change (``_reorder``),
    # so a pass walks the few it drops instead of scanning and sorting every slot (an evict-to-fit
    # simulation runs one pass per put); anything else ranks by scanning (``_candidates``).
    cdef bint _ordered
    cdef bint _recency_touch  # the policy's touch is LRUPolicy's: a match touches in C (``_touch``)
    cdef vector[cset[OrderKey]] _order  # per pool: nid * N_TIERS + tier
    cdef int _walking  # the pool a pass is walking (-1: none): leaves it exposes join after the pass
    cdef vector[int32_t] _held_back
    cdef vector[int32_t] _free
    # columns (numpy, read by the policies) and their typed views (rebound whenever the columns grow)
    cdef readonly object _cols
    cdef uint8_t[::1] _kind, _tier, _flags
    cdef uint16_t[::1] _tenant, _node, _depth
    cdef uint32_t[::1] _deps
    # read leases per slot, only for the slots leased now (a few per fetch in flight): a column would cost
    # every indexed object 4 bytes for what almost none of them has at any moment
    cdef unordered_map[int32_t, uint32_t] _lease_count
    cdef float[::1] _freq
    cdef uint64_t[::1] _size, _checksum
    cdef double[::1] _last_use
    cdef int32_t[::1] _entry, _anchor
    # per node: capacity and used bytes per tier ([nid, tier], tier 1 = DRAM, 2 = SSD)
    cdef int64_t[:, ::1] _cap, _used
    cdef uint8_t[::1] _node_present
    cdef list _node_order  # node ids present, in the order they were (re)added (placement tie-break)
    cdef list _node_names
    cdef dict _node_ids
    cdef dict _capacity_memo
    cdef Py_ssize_t _n
    cdef Py_ssize_t _capacity  # the columns' (``Columns.capacity``, read per insert without Python)
    cdef Py_ssize_t _n_committed, _n_pending, _n_orphans
    cdef list _tenants
    cdef dict _tenant_ids
    cdef int64_t[::1] _tenant_used, _quota  # per tenant id: bytes indexed (all tiers, pending too), quota
    cdef object _pins
    cdef Py_ssize_t _pins_refused
    cdef dict _ttl
    cdef list _ttl_heap
    cdef uint64_t _ttl_gen
    cdef dict _leases_by_id
    cdef list _lease_heap
    cdef object _lease_ids
    cdef list _events
    cdef bint _keep_events
    cdef object _clock
    cdef object _learner
    cdef object _guard_owner  # the learner's RecencyGuard, kept alive while ``_guard`` points into it
    cdef CGuard* _guard
    cdef bint _dead_scores  # the policy's score_one is HybridPolicy's: a dead block is scored in C
    cdef bint _evicts_checkpoints_only  # the policy's on_evict is HybridPolicy's: called for checkpoints only
    cdef bint _classes_in_c  # the policy's on_insert is HybridPolicy's: a put is classed here (``_class_of_put``)
    cdef object _tickets_owner  # the policy model's ticket map, kept alive while ``_tickets`` points into it
    cdef LruKeys* _tickets
    cdef uint16_t[::1] _klass  # the policy's class column (``klass_room``), asked for again when it grows
    cdef bint _observed_enough  # the learner's model has seen min_observations (it never unlearns them)
    cdef readonly Py_ssize_t _evictions
    cdef Py_ssize_t _evicted_bytes, _demotions, _expired
    cdef object _policy
    cdef readonly object admission
    cdef CAdmission* _adm  # admission's C++ object (NULL: every put is admitted); ``admission`` owns it
    cdef public object pin_budget
    cdef public double high_watermark, low_watermark, pin_share
    cdef public Py_ssize_t max_objects, lease_ms

    def __cinit__(self, *args, **kwargs):
        self._table = new KeyTable(int.from_bytes(os.urandom(8), "little"))

    def __dealloc__(self):
        del self._table

    def __init__(
        self,
        policy="lru",
        *,
        high_watermark=0.95,
        low_watermark=0.85,
        lease_ms=5000,
        clock=time.monotonic,
        keep_events=True,
        admission=None,
        max_objects=0,
        pin_share=0.5,
        pin_budget_step=0.02,
    ):
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
        self._walking = -1
        self._ordered = False
        self._set_columns(Columns(INITIAL_SLOTS))
        self._n = 0
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        if admission is None and getattr(self.policy, "admits", False):
            admission = AdmissionConfig()
        # None: every put is admitted (the policy only orders evictions)
        self.admission = None if admission is None else Admission(admission, clock)
        self._adm = NULL
        if self.admission is not None:
            self._adm = <CAdmission*>PyCapsule_GetPointer(self.admission._address(), ADMISSION_CAPSULE)
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.max_objects = max_objects
        self.lease_ms = lease_ms
        self.pin_share = pin_share
        self._clock = clock
        self._keep_events = keep_events
        self._n_committed = self._n_pending = self._n_orphans = 0
        self._tenants = [""]
        self._tenant_ids = {"": 0}
        self._tenant_used = np.zeros(16, dtype=np.int64)
        self._quota = np.zeros(16, dtype=np.int64)
        self._cap = np.zeros((16, N_TIERS), dtype=np.int64)
        self._used = np.zeros((16, N_TIERS), dtype=np.int64)
        self._node_present = np.zeros(16, dtype=np.uint8)
        self._node_order = []
        self._node_names = []
        self._node_ids = {}
        self._capacity_memo = {}
        self._pins = PinTable()
        self._pins_refused = 0
        self.pin_budget = PinBudget(pin_budget_step)  # the share of ``pin_share`` clients' pins have earned
        self._ttl = {}  # slot -> (expiry deadline, generation of the TTL set)
        self._ttl_heap = []
        self._ttl_gen = 0
        self._leases_by_id = {}
        self._lease_heap = []
        self._lease_ids = itertools.count(1)
        self._events = []
        self._evictions = 0
        self._evicted_bytes = 0
        self._demotions = 0
        self._expired = 0

    @property
    def policy(self):
        """The eviction policy (``eviction``): it ranks candidates; the index decides who may go."""
        return self._policy

    @policy.setter
    def policy(self, policy):
        """A new ranking: under plain LRU the pools' orders are (re)built from the slots, else dropped."""
        cdef Py_ssize_t s
        cdef size_t i
        self._policy = policy
        self._recency_touch = getattr(type(policy), "touch", None) is LRUPolicy.touch
        # a learning policy (``learns``: the default) is told of puts, writers' lookups and evictions
        self._learner = policy if getattr(policy, "learns", False) else None
        # its shadow LRU takes each put straight from here when the policy's on_put is HybridPolicy's (which
        # only hands the put to it): one C++ call per put instead of two Python calls
        guard = getattr(policy, "guard", None)
        self._guard_owner = guard if (
            self._learner is not None and type(guard) is RecencyGuard
            and getattr(type(policy), "on_put", None) is HybridPolicy.on_put
        ) else None
        self._guard = NULL
        if self._guard_owner is not None:
            self._guard = <CGuard*>PyCapsule_GetPointer(guard._address(), GUARD_CAPSULE)
        cls = type(policy)
        self._dead_scores = self._guard != NULL and getattr(cls, "score_one", None) is HybridPolicy.score_one
        self._evicts_checkpoints_only = getattr(cls, "on_evict", None) is HybridPolicy.on_evict
        tickets = getattr(getattr(policy, "model", None), "tickets", None)
        self._classes_in_c = (
            self._learner is not None and type(tickets) is LruMap
            and getattr(cls, "on_insert", None) is HybridPolicy.on_insert
            and getattr(cls, "klass_room", None) is HybridPolicy.klass_room
            and getattr(type(policy.model), "class_of_put", None) is ReturnTimeModel.class_of_put
        )
        self._tickets_owner = tickets if self._classes_in_c else None
        self._tickets = NULL
        if self._classes_in_c:
            self._tickets = <LruKeys*>PyCapsule_GetPointer(tickets._address(), TICKETS_CAPSULE)
            self._klass = policy.klass_room(0)
        self._observed_enough = False
        self._ordered = False
        for i in range(self._order.size()):
            self._order[i].clear()
        for s in range(self._n):
            self._flags[s] &= ~ORDERED
        if type(policy) is LRUPolicy:
            self._ordered = True
            for s in range(self._n):
                self._reorder(s)

    # ----------------------------------------------------------------------------------------- storage

    cdef _set_columns(self, cols):
        self._cols = cols
        self._kind, self._tier, self._flags = cols.kind, cols.tier, cols.flags
        self._tenant, self._node, self._depth = cols.tenant, cols.node, cols.depth
        self._deps, self._freq = cols.deps, cols.freq
        self._size, self._checksum, self._last_use = cols.size, cols.checksum, cols.last_use
        self._entry, self._anchor = cols.entry, cols.anchor
        self._capacity = cols.capacity

    cdef inline bytes _key_of_entry(self, int32_t e):
        cdef const uint8_t* p = self._table.key_data(e)
        if p == NULL:
            return None
        return (<const char*>p)[: self._table.key_len(e)]

    cdef inline bint _is_key(self, int32_t e, bytes key):
        """Whether entry ``e`` is live and holds ``key`` (a remembered entry id may have been freed and
        reused since)."""
        cdef size_t n = len(key)
        return (
            self._table.valid(e) and self._table.key_len(e) == n
            and memcmp(self._table.key_data(e), <const char*>key, n) == 0
        )

    cdef inline bytes _key(self, Py_ssize_t slot):
        return self._key_of_entry(self._entry[slot])

    cdef inline int32_t _find(self, bytes key):
        """The slot of a committed or pending ``key`` (None: not a key), or -1."""
        if key is None:
            return -1
        cdef int32_t e = self._table.find(<const uint8_t*><const char*>key, len(key))
        return self._table.slot(e) if e >= 0 else -1

    cdef inline int32_t _committed(self, bytes key):
        """The slot of a committed ``key``, or -1."""
        cdef int32_t s = self._find(key)
        if s >= 0 and self._flags[s] & PENDING:
            return -1
        return s

    cdef inline int32_t _pending_slot(self, bytes key):
        cdef int32_t s = self._find(key)
        if s >= 0 and not self._flags[s] & PENDING:
            return -1
        return s

    cdef inline void _forget_if_unused(self, int32_t e):
        """Erase a key entry that names no object and has no dependents waiting for it."""
        if e >= 0 and self._table.slot(e) < 0 and self._table.waiting(e) == 0:
            self._table.erase(e)

    cdef inline bint _evictable_leaf(self, Py_ssize_t s):
        return (self._flags[s] & (MOVABLE | LEASED)) == LIVE and not self._deps[s]

    cdef inline uint32_t _leased(self, Py_ssize_t s):
        """The read leases slot ``s`` is under (the ``LEASED`` bit says whether there are any: no probe of
        the map for the slots that have none, which is almost all of them)."""
        if not self._flags[s] & LEASED:
            return 0
        it = self._lease_count.find(<int32_t>s)
        return 0 if it == self._lease_count.end() else deref(it).second

    cdef void _reorder(self, Py_ssize_t s):
        """Put ``s`` in or take it out of its pool's LRU order as it is now an evictable leaf or not. Call
        after any change of its flags, leases or dependents; around a change of its last use, tier or node,
        ``_unorder`` before and ``_reorder`` after. A leaf the walking pass exposes waits for its end."""
        if not self._ordered:
            return
        cdef int pool = self._node[s] * N_TIERS + self._tier[s]
        if self._evictable_leaf(s):
            if not self._flags[s] & ORDERED:
                if pool == self._walking:
                    self._held_back.push_back(s)
                    return
                # a new leaf is the newest use: the hint makes its insert at the end constant time (an
                # exposed anchor or an unpinned slot is older: the hint is wrong, and the insert O(log n))
                self._order[pool].insert(self._order[pool].end(), OrderKey(self._last_use[s], s))
                self._flags[s] |= ORDERED
        elif self._flags[s] & ORDERED:
            self._erase_order(pool, s)

    cdef void _unorder(self, Py_ssize_t s):
        if self._flags[s] & ORDERED:
            self._erase_order(self._node[s] * N_TIERS + self._tier[s], s)

    cdef inline void _erase_order(self, int pool, Py_ssize_t s):
        """Take ordered slot ``s`` out of its pool's order: found once (erasing by value would descend the
        tree twice, for the range of equal keys)."""
        cdef cset[OrderKey].iterator it = self._order[pool].find(OrderKey(self._last_use[s], s))
        if it != self._order[pool].end():
            self._order[pool].erase(it)
        self._flags[s] &= ~ORDERED

    cdef void _touch(self, list slots, bint in_c=False) except *:
        """The policy's touch of really used objects (their order moves with their last use). With ``in_c``
        (a match's or a lookup's slots) under a recency touch (``LRUPolicy.touch``: lru, depth, hybrid) the touch is done
        here in C, as its numpy assignment does it: one use per distinct slot, however often a chain that
        repeats a block names it (the TOUCHED bit marks the slots counted)."""
        cdef Py_ssize_t s
        cdef double now
        if self._ordered:
            for s in slots:
                self._unorder(s)
        if in_c and self._recency_touch:
            now = self._clock()
            for s in slots:
                self._last_use[s] = now
                if not self._flags[s] & TOUCHED:
                    self._flags[s] |= TOUCHED
                    self._freq[s] += 1.0
            for s in slots:
                self._flags[s] &= ~TOUCHED
        else:
            self.policy.touch(self._cols, np.array(slots, dtype=np.int64), self._clock())
        if self._ordered:
            for s in slots:
                self._reorder(s)

    cdef Py_ssize_t _alloc_slot(self) except -1:
        cdef Py_ssize_t s
        if not self._free.empty():
            s = self._free.back()
            self._free.pop_back()
            return s
        if self._n == self._capacity:
            self._cols.grow()
            self._set_columns(self._cols)
        self._n += 1
        return self._n - 1

    def reserve(self, objects):
        """Make room for ``objects`` more inserts at once (a node's inventory: its size is known up front).

        Why: one-by-one growth (x1.25 columns, each step copying and freeing the old arrays) leaves up to
        a quarter of a column of slack and a trail of freed blocks in the C heap; sized exactly once, a bulk
        adoption allocates every column a single time. Recycled slots count."""
        need = self._n + max(0, objects - <Py_ssize_t>self._free.size())
        if need > self._cols.capacity:
            self._cols.grow(exact=need)
            self._set_columns(self._cols)

    def _release_storage_if_empty(self):
        """Once the last object is gone (its node lost, everything removed), start the per-object storage
        afresh: columns and the key table keep the size of their largest moment otherwise, so a master
        that held 10 M objects would hold their memory forever (freed here, handed back to the OS by the
        master's heap trim)."""
        if self._n_committed or self._n_pending or self._leases_by_id or self._n <= INITIAL_SLOTS:
            return
        self._set_columns(Columns(INITIAL_SLOTS))
        self._n = 0
        vector[int32_t]().swap(self._free)
        self._table.clear()
        self._n_orphans = 0
        for i in range(self._order.size()):
            self._order[i].clear()
        self._lease_count.clear()  # (empty already: no lease is open)
        self._pins, self._ttl, self._ttl_heap = PinTable(), {}, []

    @property
    def allocated_slots(self):
        """Objects the columns have room for (``reserve`` sizes them exactly for a bulk load)."""
        return self._cols.capacity

    def footprint(self):
        """Bytes the index holds by structure (what its memory per object is made of)."""
        return {
            "key_table": self._table.memory_bytes(),
            "free_list": self._free.capacity() * 4,
            "columns": sum(getattr(self._cols, name).nbytes for name, _ in Columns.SPEC),
        }

    # ------------------------------------------------------------------------------------------- nodes

    def add_node(self, node_id, dram_bytes, ssd_bytes=0):
        """Add a node or update its capacities (objects stay)."""
        if not node_id:
            raise BadObjectError("node id must be non-empty")
        if dram_bytes < 0 or ssd_bytes < 0:
            raise BadObjectError("capacities must be >= 0")
        if dram_bytes > INT64_MAX or ssd_bytes > INT64_MAX:  # before any state changes (a node half added)
            raise BadObjectError("capacities must be below 2^63 bytes")
        cdef int64_t dram = dram_bytes, ssd = ssd_bytes
        nid = self._node_ids.get(node_id)
        if nid is None:
            if len(self._node_names) > MAX_INTERNED:
                raise CapacityError("too many node ids")
            nid = len(self._node_names)
            self._node_names.append(node_id)
            self._node_ids[node_id] = nid
            if nid >= self._cap.shape[0]:
                rows = max(16, 2 * self._cap.shape[0])
                cap, used = np.zeros((rows, N_TIERS), np.int64), np.zeros((rows, N_TIERS), np.int64)
                present = np.zeros(rows, np.uint8)
                cap[: self._cap.shape[0]] = self._cap
                used[: self._used.shape[0]] = self._used
                present[: self._node_present.shape[0]] = self._node_present
                self._cap, self._used, self._node_present = cap, used, present
        if self._order.size() < <size_t>((nid + 1) * N_TIERS):
            self._order.resize((nid + 1) * N_TIERS)
        self._capacity_memo.clear()
        if not self._node_present[nid]:
            self._node_present[nid] = 1
            self._node_order.append(nid)
            self._used[nid, T_DRAM] = 0
            self._used[nid, T_SSD] = 0
        self._cap[nid, T_DRAM] = dram
        self._cap[nid, T_SSD] = ssd

    cdef int _nid(self, node_id) except -2:
        """The interned id of a present node, or -1."""
        nid = self._node_ids.get(node_id)
        if nid is None or not self._node_present[nid]:
            return -1
        return nid

    def node_usage(self, node_id):
        """(used, capacity) bytes per tier."""
        cdef int nid = self._nid(node_id)
        if nid < 0:
            raise UnknownNodeError(f"unknown node {node_id!r}")
        return {t: (int(self._used[nid, t]), int(self._cap[nid, t])) for t in Tier}

    def remove_node(self, node_id):
        """Drop the node and every object on it (reason ``node_lost``); returns what was dropped."""
        cdef int nid = self._nid(node_id)
        if nid < 0:
            raise UnknownNodeError(node_id)
        cdef Py_ssize_t s
        dropped = []
        for s in range(self._n):
            if self._node[s] == nid and self._flags[s] & LIVE:
                dropped.append(self._drop(s, "node_lost", False, False))
        self._node_present[nid] = 0
        self._node_order.remove(nid)
        self._capacity_memo.clear()
        self._release_storage_if_empty()
        return dropped

    cdef str _place(self, int64_t size, int tier, avoid):
        """The node with the most free bytes in ``tier`` whose capacity can hold ``size``; ``avoid`` is
        chosen only when no other node can hold it."""
        cdef int best = -1
        cdef bint best_ok = False, ok
        cdef int64_t best_free = -1, free, cap
        for nid in self._node_order:
            cap = self._cap[nid, tier]
            ok = self._node_names[nid] != avoid
            free = cap - self._used[nid, tier]
            if cap >= size and (ok > best_ok or (ok == best_ok and free > best_free)):
                best, best_ok, best_free = nid, ok, free
        if best < 0:
            raise CapacityError(f"no node has {Tier(tier).name} capacity for an object of {size} bytes")
        return self._node_names[best]

    cdef int64_t _capacity_of(self, int tier=T_DRAM):
        """Bytes of ``tier`` over all nodes (memoised until a node is added, updated or removed: admission
        and the default policy ask on every put)."""
        cap = self._capacity_memo.get(tier)
        if cap is None:
            cap = self._capacity_memo[tier] = sum(int(self._cap[nid, tier]) for nid in self._node_order)
        return cap

    cdef int _tenant_id(self, tenant) except -1:
        tid = self._tenant_ids.get(tenant)
        if tid is None:
            if len(self._tenants) > MAX_INTERNED:
                raise QuotaExceededError("too many tenants")
            tid = len(self._tenants)
            self._tenants.append(tenant)
            self._tenant_ids[tenant] = tid
            if tid >= self._quota.shape[0]:
                used, quota = np.zeros(2 * tid, np.int64), np.zeros(2 * tid, np.int64)
                used[:tid] = self._tenant_used
                quota[:tid] = self._quota
                self._tenant_used, self._quota = used, quota
        return tid

    check_object = staticmethod(check_object)

    # ------------------------------------------------------------------------------------------ insert

    def insert(
        self,
        key,
        kind,
        size,
        *,
        node_id=None,
        tier=Tier.DRAM,
        tenant="",
        parent=b"",
        checksum=0,
        ttl_ms=0,
        pending=False,
        evict=True,
        avoid_node=None,
        admit=True,
    ):
        """Index an object on a node (placed by free space if ``node_id`` is None); returns the node id.

        Makes room first (quota, then pool capacity) and runs the watermark pass after, so the index never
        holds more than a pool's capacity. ``pending=True`` reserves the bytes for a two-phase put.
        ``evict=False`` (adopting a node's inventory) skips quotas and eviction until the caller runs
        :meth:`evict` once the whole inventory is in, so no block is judged a leaf before its children
        have arrived; it still refuses to overfill a pool. ``admit=False``: a client's retention hint covers
        the object, so admission control does not turn it away (the policy still ranks it).
        """
        # a master's common put (a block with its tag, no TTL, a checksum in range) checked in C; anything
        # else by ``check_object``, which words the error
        cdef int kind_i = _block_kind(key, kind, size) if type(key) is bytes else -1
        if kind_i < 0 or not (
            type(ttl_ms) is int and ttl_ms == 0 and type(checksum) is int and 0 <= checksum <= UINT64_MAX
        ):
            kind_i = check_object(key, kind, size, ttl_ms, checksum)
        key = _put_key(key)
        cdef int32_t s = self._find(key)
        if s >= 0:
            raise DuplicateKeyError(key, bool(self._flags[s] & PENDING))
        cdef int tier_i = tier if type(tier) in (int, Tier) and (tier == 1 or tier == 2) else Tier(tier)
        parent = self._parent_key(parent)
        self._check_size(size, tenant, evict)
        cdef Py_ssize_t slot = self._insert(
            key, kind_i, size, node_id, tier_i, tenant, parent, checksum, ttl_ms, bool(pending), bool(evict),
            avoid_node, bool(admit), -1, self._clock(),
        )
        if slot < 0:
            raise NotAdmittedError(f"{ObjectKind(kind_i).name} object {key[:9].hex()}… not admitted")
        return self._node_names[self._node[slot]]

    def insert_chain(self, hashes, sizes, admits, checkpoints=(), *, node_id, tenant=""):
        """A writer's puts of one request, in order: the MLA blocks ``MLA_TAG + hashes[i]`` (size
        ``sizes[i]``, admission hint ``admits[i]``, parent the block before it: none for the first or for a
        repeat of it), then each checkpoint ``(c, size, admit)``: ``KDA_TAG + hashes[c - 1]``. Each is
        indexed as ``insert(key, kind, size, node_id=node_id, tenant=tenant, parent=..., admit=...)`` would
        (the same eviction before and after each), except that the answers a writer counts rather than
        fails on are answers: a key already committed is refreshed (``put_again``), and a refusal by
        admission or for room puts nothing.

        Returns one int per put, blocks first: the slot the object now has (>= 0), or ``-PUT_EXISTS``,
        ``-PUT_NOT_ADMITTED``, ``-PUT_NO_ROOM``. A malformed chain (a hash not 32 bytes, a size not a
        positive int, lengths that differ, a checkpoint past the chain) is ``BadObjectError`` before
        anything is put; a pending key, a quota or an unknown node raise as ``insert`` does, with the
        objects before it put.

        The whole chain is put at one instant: the clock is read once per call.

        Why columns: the simulator stores a whole request per call (tens of millions of puts per
        production trace); a slot per put lets it keep its own per-object tallies in arrays."""
        cdef Py_ssize_t n = len(hashes), i, c, j
        if len(sizes) != n or len(admits) != n:
            raise BadObjectError(
                f"{n} hashes, {len(sizes)} sizes and {len(admits)} admits: one of each per block"
            )
        hs = [_as_key(h) for h in hashes]
        if len(hs) != n:  # (a hash whose __bytes__ changed the list)
            raise BadObjectError(f"{len(hs)} hashes where there were {n}: the list changed while it was read")
        for h in hs:  # exactly bytes of 32 (``_tagged`` copies 32 of them; a bytes subclass may lie about its size)
            if type(h) is not bytes or PyBytes_GET_SIZE(h) != HASH_BYTES:
                raise BadObjectError(f"a block hash must be {HASH_BYTES} bytes")
        size_list = [_positive_size(x) for x in sizes]
        cks = []
        for item in checkpoints:
            at, size, admit = item
            cks.append((_checkpoint_at(at, n), _positive_size(size), admit))
        out = []
        cdef bytes key, prev = b""
        cdef int32_t answer, prev_entry = -1
        cdef double now = self._clock()
        cdef int ids[2]  # the node's and the tenant's ids, once a put of this call has looked them up
        ids[0] = ids[1] = -1
        for i in range(n):
            key = _tagged(C_MLA_TAG, hs[i])
            if len(prev) == 33 and memcmp(<const char*>prev, <const char*>key, 33) == 0:  # a block repeated
                prev, prev_entry = b"", -1
            answer = self._put_of_chain(
                key, K_MLA, size_list[i], node_id, tenant, prev, prev_entry, admits[i], now, ids
            )
            out.append(answer)
            prev = key
            # the block's entry, the next block's anchor (checked again there: an eviction may drop it)
            prev_entry = self._entry[answer] if answer >= 0 else -1
        for c, size, admit in cks:
            key = _tagged(C_KDA_TAG, hs[c - 1])
            out.append(self._put_of_chain(key, K_KDA, size, node_id, tenant, b"", -1, admit, now, ids))
        return out

    cdef int32_t _put_of_chain(
        self, bytes key, int kind, size, node_id, tenant, bytes parent, int32_t parent_entry, admit, double now,
        int* ids,
    ) except? -9:
        """One put of ``insert_chain``: its answer (a slot, or minus an outcome). ``ids``: the node's and
        the tenant's ids (-1 until a put has looked them up; set from the first object put). A chain put
        with ``node_id=None`` places each object by free space, as ``insert`` does: no node id is kept."""
        cdef int32_t s = self._find(key)
        if s >= 0:
            if not self._flags[s] & PENDING:
                self._put_again(s, key, now)
                return -PUT_EXISTS
            raise DuplicateKeyError(key, True)
        cdef Py_ssize_t slot
        try:
            self._check_size(size, tenant, True)
            slot = self._insert(
                key, kind, size, node_id, T_DRAM, tenant, parent, 0, 0, False, True, None, bool(admit), parent_entry,
                now, ids[0], ids[1],
            )
        except CapacityError:
            return -PUT_NO_ROOM
        if slot < 0:
            return -PUT_NOT_ADMITTED
        if node_id is not None:
            ids[0] = self._node[slot]
        ids[1] = self._tenant[slot]
        return slot

    def put_again(self, key):
        """A writer put ``key`` again and the store answers EXISTS: refresh it as :meth:`insert_chain` does.
        Returns whether ``key`` is committed (else nothing changes)."""
        key = _as_key(key)
        cdef int32_t s = self._committed(key) if key is not None else -1
        if s < 0:
            return False
        self._put_again(s, key, self._clock())
        return True

    cdef void _put_again(self, int32_t s, bytes key, double now) except *:
        """A writer put committed slot ``s`` again: it used it (prefill re-sends the chain it computed), so
        its recency is refreshed, the rule under which the store's LRU is one recency order for every
        capacity (docs/design/workloads.md §3b). Not its use count: a put is no read, and admission learns
        whether a block was ever read from it. The learner hears the put as any put (its shadow LRU
        refreshes a key it holds)."""
        cdef int kind_i = self._kind[s]
        if kind_i == K_MLA or kind_i == K_KDA:
            if self._guard != NULL:
                self._guard.put(<const uint8_t*><const char*>key, len(key), self._size[s], self._capacity_of(T_DRAM))
            elif self._learner is not None:
                self._learner.on_put(key, self._size[s], self._capacity_of(T_DRAM))
        self._unorder(s)
        self._last_use[s] = now
        self._reorder(s)

    cdef bytes _parent_key(self, parent):
        """A put's parent as bytes (b"": none). A parent longer than any key is refused, not kept waiting:
        no object could ever be put under it."""
        if not parent:
            return b""
        p = _put_key(parent)
        if len(p) > MAX_KEY_BYTES:
            raise BadObjectError(f"a parent key must be at most {MAX_KEY_BYTES} bytes, got {len(p)}")
        return p

    cdef void _check_size(self, size, tenant, bint evict) except *:
        """Sizes past 2^63 - 1 (the wire allows 2^64 - 1) get the answer any size too big for every node
        gets: the tenant's quota first, as in ``_insert``, then capacity."""
        if (_fits_int64(size) if type(size) is int else size <= INT64_MAX):
            return
        tid = self._tenant_ids.get(tenant)
        if evict and tid is not None and self._quota[tid]:
            raise QuotaExceededError(f"object of {size} bytes exceeds tenant {tenant!r} quota {self._quota[tid]}")
        raise CapacityError(f"no node has capacity for an object of {size} bytes")

    cdef Py_ssize_t _insert(
        self, bytes key, int kind_i, int64_t size, node_id, int tier, tenant, bytes parent, uint64_t checksum,
        ttl_ms, bint pending, bint evict, avoid_node, bint admit, int32_t parent_entry, double now,
        int nid_known=-1, int tid_known=-1,
    ) except -2:
        """``insert`` of a checked object whose key is not indexed, at time ``now``: its slot, or -1 when
        admission turns it away (before anything is reserved). ``parent_entry``: the parent's key entry if
        the caller knows it (-1: look it up). ``nid_known`` / ``tid_known``: ``node_id``'s and ``tenant``'s
        ids when the caller has them from an earlier put of the same call (-1: look them up; a tenant is
        interned by its first put, never before)."""
        if self._lease_heap or self._ttl_heap or self._pins.deadlines:  # else nothing can be due
            self._retire_due(now)
        learner = self._learner
        if evict and (kind_i == K_MLA or kind_i == K_KDA):
            if self._guard != NULL:  # before admission: LRU would store it
                self._guard.put(<const uint8_t*><const char*>key, len(key), size, self._capacity_of(T_DRAM))
            elif learner is not None:
                learner.on_put(key, size, self._capacity_of(T_DRAM))
            if admit and self._adm != NULL and not self._admit(key, kind_i, size, parent, now):
                return -1
        cdef int tid = tid_known
        if tid < 0:
            tid_o = self._tenant_ids.get(tenant)
            tid = self._tenant_id(tenant) if tid_o is None else tid_o
        cdef int64_t quota = self._quota[tid] if evict else 0
        if quota:
            if size > quota:
                raise QuotaExceededError(f"object of {size} bytes exceeds tenant {tenant!r} quota {quota}")
            if size > quota - self._tenant_used[tid]:
                self._evict_tenant(tid, quota - size, now)
                if size > quota - self._tenant_used[tid]:
                    raise QuotaExceededError(
                        f"tenant {tenant!r} holds {self._tenant_used[tid]} of {quota} bytes, "
                        f"all pinned or in use; cannot fit {size}"
                    )
        cdef int nid = nid_known
        if nid < 0:
            if node_id is None:
                node_id = self._place(size, tier, avoid_node)
            nid = self._nid(node_id)
            if nid < 0:
                raise UnknownNodeError(f"unknown node {node_id!r}")
        tier_name = Tier(tier).name if size > self._cap[nid, tier] else ""
        if size > self._cap[nid, tier]:
            raise CapacityError(f"object of {size} bytes exceeds {tier_name} capacity of node {node_id!r}")
        cdef int32_t parent_slot
        # the object cap; an adoption (evict=False) may pass it: evict() trims in policy order once all is in
        if evict and self.max_objects and self._n_committed + self._n_pending >= self.max_objects:
            parent_slot = self._committed(parent) if parent else -1  # the new object's own anchor stays
            self._evict_objects(<int64_t>(self.low_watermark * self.max_objects), now, parent_slot)
            if self._n_committed + self._n_pending >= self.max_objects:
                raise CapacityError(
                    f"the index holds {self.max_objects} objects (its cap), all pinned, leased, pending or "
                    "anchoring others"
                )
        if size > self._cap[nid, tier] - self._used[nid, tier] and not (
            evict and self._make_room(nid, tier, size, now)
        ):
            raise CapacityError(
                f"node {node_id!r} {Tier(tier).name}: {self._used[nid, tier]} of {self._cap[nid, tier]} "
                f"bytes held by pinned/leased/pending objects; cannot fit {size}"
            )
        if self._table.room() < 2:  # the key and its anchor's key, before any of the slot's state is set
            raise CapacityError(f"the index's key table holds its maximum of {self._table.max_entries()} keys")
        cdef Py_ssize_t slot = self._alloc_slot()
        cdef int32_t e = self._table.intern(<const uint8_t*><const char*>key, len(key))
        self._kind[slot] = kind_i
        self._tier[slot] = tier
        self._flags[slot] = LIVE | (PENDING if pending else 0)
        self._tenant[slot] = tid
        self._node[slot] = nid
        self._size[slot] = size
        self._checksum[slot] = checksum
        self._last_use[slot] = now
        self._freq[slot] = 1.0  # a write is the first use, identical under every policy (no per-insert call)
        cdef uint32_t deps = self._table.waiting(e)  # dependents that waited for this key
        self._deps[slot] = deps
        self._table.set_waiting(e, 0)
        self._n_orphans -= deps
        self._entry[slot] = e
        cdef int32_t a = self._link_anchor(slot, key, kind_i, parent, parent_entry)
        self._table.set_slot(e, slot)
        if pending:
            self._n_pending += 1
        else:
            self._n_committed += 1
        if learner is not None:
            if a < 0 and self._anchor[slot] >= 0:  # an orphan, unless it hangs on itself now
                a = self._table.slot(self._anchor[slot])
            if self._classes_in_c:
                self._class_of_put(slot, key, a)
            else:
                learner.on_insert(self._cols, slot, key, kind_i, a)
        if not pending:
            self._mark_checkpoint(slot, key, kind_i, deps)
        self._used[nid, tier] += size
        self._tenant_used[tid] += size
        self._reorder(slot)
        if ttl_ms:
            self._set_ttl(slot, now + ttl_ms / 1000.0)
        if evict:
            if self._used[nid, tier] > self.high_watermark * self._cap[nid, tier]:  # _evict_pool's test
                self._evict_pool(nid, tier, now, slot)
            if self.max_objects and self._n_committed + self._n_pending > self.high_watermark * self.max_objects:
                self._evict_objects(<int64_t>(self.low_watermark * self.max_objects), now, slot)
        return slot

    cdef int _class_of_put(self, Py_ssize_t slot, bytes key, int32_t anchor_slot) except -1:
        """``HybridPolicy.on_insert`` in C: the object in ``slot`` takes the class of its ticket (the
        model's ``tickets``, keyed by the key less its tag), else its anchor's beyond the prompt
        (``ReturnTimeModel.class_of_put``), else BEYOND."""
        if slot >= self._klass.shape[0]:
            self._klass = self._policy.klass_room(slot)
        cdef const uint8_t* k = <const uint8_t*><const char*>key
        cdef int32_t e = self._tickets.find(k + 1, len(key) - 1)
        cdef int64_t cls, base
        if e >= 0:
            cls = self._tickets.value(e)
        elif 0 <= anchor_slot < self._klass.shape[0]:
            base = self._klass[anchor_slot] % C_HINT  # a hint names its own checkpoints: not the reply's
            cls = (base % C_READ) + C_BEYOND + C_GAP * (base // C_GAP)
        else:
            cls = C_BEYOND
        if not 0 <= cls <= 0xFFFF:
            raise OverflowError(f"request class {cls} does not fit the class column")
        self._klass[slot] = <uint16_t>cls
        return 0

    cdef bint _admit(self, bytes key, int kind, int64_t size, bytes parent, double now) except -1:
        """Whether admission lets the block key ``key`` in. Unticketed objects follow their chain: an MLA
        block whose parent, or a checkpoint whose own block, was refused and is not cached is refused too
        (it could never be part of a usable prefix)."""
        cdef const uint8_t* k = <const uint8_t*><const char*>key
        cdef uint8_t hangs_on[33]
        cdef const uint8_t* hangs = NULL
        if kind == K_KDA:  # its own MLA block
            hangs_on[0] = C_MLA_TAG
            memcpy(&hangs_on[1], k + 1, 32)
            hangs = hangs_on
        elif len(parent) == 33 and parent[0] == C_MLA_TAG:  # its parent block (a tag and a block hash)
            hangs = <const uint8_t*><const char*>parent
        cdef int32_t e = self._table.find(hangs, 33) if hangs != NULL else -1
        cdef bint cached = e >= 0 and self._table.slot(e) >= 0  # committed or pending (``_find``)
        return self._adm.admit(k + 1, size, now, hangs + 1 if hangs != NULL else NULL, cached)

    cdef int32_t _link_anchor(self, Py_ssize_t slot, bytes key, int kind, bytes parent, int32_t parent_entry) except -2:
        """Record what ``slot`` depends on (its anchor: counted as a dependent, or as an orphan's wait) and
        its depth; returns the anchor's slot (-1: a root or an orphan)."""
        # a checkpoint depends on its own MLA block (its key is KDA_TAG + h: kinds agree with key tags),
        # anything else on its parent if it names one
        cdef uint8_t buf[33]
        cdef int step = 1 if kind == K_MLA else 0
        cdef int depth = step
        cdef int32_t a = -1, e = -1
        if kind == K_KDA:
            buf[0] = C_MLA_TAG
            memcpy(&buf[1], <const char*>key + 1, 32)
            e = self._table.intern(buf, 33)
        elif parent:
            if parent_entry >= 0 and self._is_key(parent_entry, parent):
                e = parent_entry  # a chain's previous block, still under its key: no probe
            else:
                e = self._table.intern(<const uint8_t*><const char*>parent, len(parent))
        if e >= 0:
            a = self._table.slot(e)
            if a < 0:
                self._table.set_waiting(e, self._table.waiting(e) + 1)
                self._n_orphans += 1
                depth = 0  # unknown until the chain is complete; policies treat 0 as 1
            else:
                self._deps[a] += 1
                self._reorder(a)  # no longer a leaf
                depth = min(self._depth[a] + step, DEPTH_MAX)
        self._depth[slot] = depth
        self._anchor[slot] = e
        return a

    cdef void _mark_checkpoint(self, Py_ssize_t slot, bytes key, int kind, uint32_t deps):
        """Keep the CKPT bit true as ``key`` (of ``kind``) becomes committed (``deps``: its dependents
        now): set on an MLA block whose checkpoint is committed, or on the committed MLA block of a
        checkpoint. A block without dependents has no checkpoint (a checkpoint depends on its block), so
        the common insert (a new leaf block) looks nothing up."""
        cdef uint8_t buf[33]
        cdef int32_t e, m
        if (kind != K_MLA or not deps) and kind != K_KDA:
            return
        buf[0] = C_KDA_TAG if kind == K_MLA else C_MLA_TAG
        memcpy(&buf[1], <const char*>key + 1, 32)
        e = self._table.find(buf, 33)
        m = self._table.slot(e) if e >= 0 else -1
        if m < 0 or self._flags[m] & PENDING:
            return
        if kind == K_MLA:
            self._flags[slot] |= CKPT
        else:
            self._flags[m] |= CKPT

    def commit(self, key, checksum=None):
        """Make a pending object visible (second phase of a put); ``checksum`` when the writer declares it
        only now (it hashed the bytes while copying them)."""
        if checksum is not None and not 0 < checksum < 1 << 64:
            raise BadObjectError("a checksum declared at commit must be in 1 .. 2^64-1")
        key = _as_key(key)
        cdef int32_t slot = self._pending_slot(key)
        if slot < 0:
            raise UnknownKeyError(f"no pending put for key {key[:9].hex()}…")
        if checksum is not None:
            self._checksum[slot] = checksum
        self._flags[slot] &= ~PENDING
        self._n_pending -= 1
        self._n_committed += 1
        self._mark_checkpoint(slot, key, self._kind[slot], self._deps[slot])
        cdef double now = self._clock()
        self._last_use[slot] = now  # recency counts from visibility; the write was the one use
        self._reorder(slot)
        # never evict what was just written: the writer has not even been told it succeeded
        self._evict_pool(self._node[slot], self._tier[slot], now, slot)

    def remove(self, key, reason="removed"):
        """Drop an object (committed or pending) regardless of pins; False if it was not indexed."""
        cdef int32_t slot = self._find(_as_key(key))
        if slot < 0:
            return False
        self._drop(slot, reason, False, False, False)
        self._release_storage_if_empty()
        return True

    def set_quota(self, tenant, max_bytes):
        """Cap a tenant's indexed bytes (all tiers, pending included); 0 removes the cap.

        A tenant already above the new cap loses its own evictable objects now (as far as they go)."""
        if max_bytes < 0:
            raise BadObjectError("quota must be >= 0")
        tid = self._tenant_id(tenant)
        self._quota[tid] = min(max_bytes, INT64_MAX)  # a quota past any size held is no limit at all
        if max_bytes and self._tenant_used[tid] > max_bytes:
            now = self._clock()
            self._retire_due(now)
            self._evict_tenant(tid, max_bytes, now)

    def promote(self, key):
        """Move a committed SSD object back to DRAM on its node (promotion on a real hit), demoting or
        dropping colder DRAM objects to make room. False if it is not on SSD or DRAM cannot take it."""
        cdef int32_t slot = self._committed(_as_key(key))
        if slot < 0 or self._tier[slot] != T_SSD:
            return False
        cdef int nid = self._node[slot]
        cdef int64_t size = self._size[slot]
        if size > self._cap[nid, T_DRAM]:
            return False
        now = self._clock()
        self._unorder(slot)
        self._tier[slot] = T_DRAM
        self._reorder(slot)
        self._used[nid, T_SSD] -= size
        self._used[nid, T_DRAM] += size
        self._evict_pool(nid, T_DRAM, now, slot)
        if self._used[nid, T_DRAM] > self._cap[nid, T_DRAM]:  # everything else pinned: undo
            self._unorder(slot)
            self._tier[slot] = T_SSD
            self._reorder(slot)
            self._used[nid, T_DRAM] -= size
            self._used[nid, T_SSD] += size
            return False
        return True

    # ------------------------------------------------------------------------------------------- reads

    def __len__(self):
        return self._n_committed

    def __contains__(self, key):
        return self._committed(_as_key(key)) >= 0

    def is_pending(self, key):
        return self._pending_slot(_as_key(key)) >= 0

    def __iter__(self):
        """The committed keys in slot order (do not insert or remove while iterating)."""
        cdef Py_ssize_t s
        for s in range(self._n):
            if self._flags[s] & (LIVE | PENDING) == LIVE:
                yield self._key(s)

    def committed_slots(self):
        """The slots of the committed objects, ascending (an int32 array): with the slots ``insert_chain``
        answers, what lets a caller keep per-object tallies in arrays of its own and settle them once."""
        flags = np.asarray(self._flags)[: self._n]
        return np.flatnonzero((flags & (LIVE | PENDING)) == LIVE).astype(np.int32)

    def pending_keys(self):
        """The keys of puts started and not yet committed, in slot order."""
        cdef Py_ssize_t s
        return [self._key(s) for s in range(self._n) if self._flags[s] & (LIVE | PENDING) == LIVE | PENDING]

    def match_prefix(self, block_hashes, *, require_checkpoint=True, touch=False, resume=False):
        """Longest usable prefix of a hash chain (joint rule), the plain MLA run and the checkpoints in it.

        ``touch=True`` marks the usable objects as used (recency/frequency); plain lookups must leave it
        False so that probing never keeps objects alive. A touching lookup is a *writer's* (prefill's fetch:
        it will put what it missed) unless ``resume``: decode reading what prefill just stored for the
        same request. Only a writer's lookup teaches the policy, admission and the pin budget (a return
        observed, tickets, the shadow LRU's score, blocks served through pins); decode's read of a chain
        written a moment ago is none of those, and would credit every fresh pin with a read.
        """
        # One probe per block, all of the chain's at once (``find_many``); whether KDA_TAG + h is committed
        # too is the CKPT bit of the MLA slot
        cdef vector[uint8_t] keys
        cdef vector[int32_t] entries
        cdef int32_t s
        cdef Py_ssize_t i, n
        cdef bytes hb
        hashes = []
        bad = None  # a malformed hash is an error only if the walk reaches it (a miss before it ends the walk)
        for h in block_hashes:
            try:
                hb = _as_key(h)
                if hb is None:
                    raise TypeError(f"can't concat {type(h).__name__} to bytes")
                if len(hb) != HASH_BYTES:
                    raise BadObjectError(f"block hash must be {HASH_BYTES} bytes, got {len(hb)}")
            except Exception as exc:
                bad = exc
                break
            hashes.append(hb)
            keys.push_back(C_MLA_TAG)
            keys.insert(keys.end(), <const uint8_t*><const char*>hb, <const uint8_t*><const char*>hb + 32)
        n = len(hashes)
        entries.resize(n)
        if n:
            self._table.find_many(keys.data(), n, 33, entries.data())
        found = []
        checkpoints = []  # block counts c whose block h_{c-1} has a committed checkpoint
        for i in range(n):
            s = self._table.slot(entries[i]) if entries[i] >= 0 else -1
            if s < 0 or self._flags[s] & PENDING:
                break
            found.append(s)
            if self._flags[s] & CKPT:
                checkpoints.append(i + 1)
        cdef Py_ssize_t run = len(found), usable
        if bad is not None and run == n:
            raise bad
        if require_checkpoint:
            usable = checkpoints[-1] if checkpoints else 0
            ck = KDA_TAG + hashes[usable - 1] if usable else None
        else:
            usable, ck = run, None
        used = tuple(hashes[:usable])  # their keys only when asked for (``PrefixMatch.mla_keys``)
        slots = found[:usable]
        if ck is not None:
            slots.append(self._committed(ck))
        learn = touch and not resume
        # the learners hear the lookup up to its first malformed hash (the walk cannot pass it)
        if learn and self._learner is not None:  # before the touch: the read's age is the return time
            self._learner.on_lookup(
                self._cols, hashes, run, usable, slots[-1] if ck is not None else -1,
                require_checkpoint, self._clock(), found,
            )
        cdef vector[uint8_t] plain  # the lookup's hashes end to end, without their tags, for admission
        if learn and self._adm != NULL:  # the writer's fetch: it will put what it missed
            if self._learner is not None:
                self._adm.floor = self._learner.admission_floor()
            plain.resize(32 * n)
            for i in range(n):
                memcpy(&plain[32 * i], &keys[33 * i + 1], 32)
            self._adm.on_lookup(plain.data(), n, run, self._capacity_of(T_DRAM), self._clock())
        if learn:
            # what pins are worth: the blocks a writer is served through a pinned object or not (the one that
            # makes the hit usable: the checkpoint, or a pure-MLA run's deepest block), against DRAM held,
            # where pins compete (pinned objects are never demoted)
            from_pinned = bool(slots) and self._flags[slots[-1]] & PINNED != 0
            pinned = self._pins.total_bytes
            dram = sum(int(self._used[nid, T_DRAM]) for nid in self._node_order) if pinned else 0
            self.pin_budget.lookup(usable, from_pinned, pinned, dram)
        if touch and usable:
            self._touch(slots, True)
        return PrefixMatch(usable, run, tuple(checkpoints), used, ck, tuple(slots))

    def columns(self, slots):
        """``(sizes, checksums, tiers, node ids)`` of live slots (a match's ``slots``), in order: what a
        MatchPrefix reply carries. Never changes recency."""
        cdef Py_ssize_t s
        sizes, sums, tiers, nodes = [], [], [], []
        names = self._node_names
        for s in slots:
            if not 0 <= s < self._n:
                raise IndexError(f"slot {s} out of range")
            sizes.append(self._size[s])
            sums.append(self._checksum[s])
            tiers.append(self._tier[s])
            nodes.append(names[self._node[s]])
        return sizes, sums, tiers, nodes

    def get(self, key):
        """Info on a committed or pending object, None if absent. Never changes recency."""
        cdef int32_t slot = self._find(_as_key(key))
        return None if slot < 0 else self._info(slot)

    def rows(self, keys):
        """Location rows of committed keys (absent keys skipped). Never changes recency."""
        cdef int32_t s
        out = []
        names, tnames, ttl = self._node_names, self._tenants, self._ttl
        now = self._clock() if ttl else 0.0
        for key in keys:
            key = _as_key(key)
            s = self._committed(key)
            if s < 0:
                continue
            t = ttl.get(s)
            out.append(
                LocationRow(
                    key, self._kind[s], self._size[s], self._checksum[s], tnames[self._tenant[s]],
                    self._tier[s], names[self._node[s]], max(1, int((t[0] - now) * 1000)) if t else 0,
                )
            )
        return out

    def lookup(self, keys, *, touch=False):
        """Info on committed objects in order (None where absent); ``touch`` as in match_prefix."""
        cdef int32_t slot
        out = []
        used = []
        for key in keys:
            slot = self._committed(_as_key(key))
            if slot < 0:
                out.append(None)
            else:
                used.append(slot)
                out.append(self._info(slot))
        if touch and used:
            self._touch(used, True)
        return out

    def _slots_of(self, keys):
        """(key, slot) of the committed keys among ``keys``, in order."""
        cdef int32_t s
        found = []
        for k in keys:
            k = _as_key(k)
            s = self._committed(k)
            if s >= 0:
                found.append((k, s))
        return found

    # ---------------------------------------------------------------------------------- leases and pins

    def acquire(self, keys, lease_ms=None):
        """Read-pin the committed objects among ``keys`` until released or the deadline; None if none."""
        found = self._slots_of(keys)
        if not found:
            return None
        ms = lease_ms or self.lease_ms
        slots = np.unique(np.array([s for _, s in found], dtype=np.int64))
        for s in slots.tolist():
            self._lease_count[<int32_t>s] += 1
            self._flags[s] |= LEASED
            self._reorder(s)
        lease_id = next(self._lease_ids)
        deadline = self._clock() + ms / 1000.0
        self._leases_by_id[lease_id] = (deadline, slots)
        heapq.heappush(self._lease_heap, (deadline, lease_id))
        return Lease(lease_id, deadline, tuple(k for k, _ in found))

    def release(self, lease_id):
        """End a lease early (the fetch finished); False if unknown or already expired."""
        entry = self._leases_by_id.pop(lease_id, None)
        if entry is None:
            return False
        cdef Py_ssize_t s
        for s in entry[1].tolist():
            it = self._lease_count.find(<int32_t>s)
            if it != self._lease_count.end():  # always found: a lease's slots are counted until it ends
                if deref(it).second <= 1:
                    self._lease_count.erase(it)
                    self._flags[s] &= ~LEASED
                else:
                    self._lease_count[<int32_t>s] = deref(it).second - 1
            if self._flags[s] & LIVE:
                self._reorder(s)
            # a slot whose object was dropped while leased is reusable once the last lease lets go
            elif not self._leased(s):
                self._free.push_back(s)
        self._release_storage_if_empty()  # the index emptied while this lease held some of its slots
        return True

    def pin(self, keys, ttl_ms, session=""):
        """Soft-pin the committed objects among ``keys`` for ``ttl_ms`` on behalf of ``session`` (each
        object's tenant's session): they are not evicted while any holder pins them. A session's pin (a
        client's hint) is budgeted, all or nothing: when the newly pinned bytes would pass the pin budget
        (module docstring) nothing is pinned, 0 is returned and ``pins_refused`` counts it; an operator's
        pin (no session) is not. ``ttl_ms=0`` drops this session's pins on ``keys``. Returns how many
        objects were found (and pinned or unpinned)."""
        slots = [s for _, s in self._slots_of(keys)]
        if not ttl_ms:
            for slot in slots:
                self._unpin(slot, session)
            return len(slots)
        if session and self._learner is not None:  # granted or not, the hint tells when the chain returns
            self._learner.on_hint(self._cols, slots, ttl_ms)
        new = {}  # tenant id -> bytes this call pins that were not pinned
        for slot in dict.fromkeys(slots):
            if slot not in self._pins:
                tid = self._tenant[slot]
                new[tid] = new.get(tid, 0) + self._size[slot]
        if session and not self._pin_fits(new):
            self._pins_refused += 1
            return 0
        until = self._clock() + ttl_ms / 1000.0
        for slot in slots:
            if self._pins.hold(slot, self._tenant[slot], self._size[slot], session, until):
                self._flags[slot] |= PINNED
                self._reorder(slot)
        return len(slots)

    def _pin_fits(self, new):
        """Whether pinning ``new`` more bytes per tenant keeps every budget (module docstring, Pins)."""
        total = sum(new.values())
        if not total:
            return True
        share = self.pin_share * self.pin_budget.earned
        if self._pins.total_bytes + total > share * self._capacity_of(T_DRAM):
            return False
        for tid, extra in new.items():
            quota = self._quota[tid]
            if quota and self._pins.bytes_by_tenant.get(tid, 0) + extra > share * quota:
                return False
        return True

    def end_session(self, tenant, session):
        """Release every pin ``session`` of ``tenant`` holds (objects another holder pins stay pinned);
        returns how many objects it held."""
        tid = self._tenant_ids.get(tenant)
        slots = self._pins.session_slots(tid, session) if tid is not None and session else []
        for slot in slots:
            self._unpin(slot, session)
        return len(slots)

    cdef _unpin(self, Py_ssize_t slot, session=None):
        """Drop ``session``'s pin on ``slot`` (every holder's when None); the object is unpinned, and its
        bytes leave the pin budget, once no holder is left."""
        if self._pins.release(slot, self._tenant[slot], self._size[slot], session):
            self._flags[slot] &= ~PINNED
            self._reorder(slot)

    cdef _set_ttl(self, Py_ssize_t slot, double deadline):
        self._ttl_gen += 1
        self._ttl[slot] = (deadline, self._ttl_gen)
        heapq.heappush(self._ttl_heap, (deadline, slot, self._ttl_gen))

    # ----------------------------------------------------------------------------------- stats, checks

    def stats(self):
        n = self._n
        c = self._cols
        live = (c.flags[:n] & LIVE) != 0
        tiers = {t.name: int(c.size[:n][live & (c.tier[:n] == t)].sum()) for t in Tier}
        return IndexStats(
            objects=self._n_committed,
            pending=self._n_pending,
            bytes=int(c.size[:n][live].sum()),
            capacity_bytes=sum(int(self._cap[nid, t]) for nid in self._node_order for t in Tier),
            nodes=len(self._node_order),
            active_leases=len(self._leases_by_id),
            soft_pins=len(self._pins),
            pinned_bytes=self._pins.total_bytes,
            pins_refused=self._pins_refused,
            pin_budget_earned=self.pin_budget.earned,
            evictions=self._evictions,
            evicted_bytes=self._evicted_bytes,
            demotions=self._demotions,
            expired=self._expired,
            bytes_per_tier=tiers,
            bytes_per_tenant={
                self._tenants[t]: self._tenant_used[t] for t in range(len(self._tenants)) if self._tenant_used[t]
            },
            policy=self.policy.name,
            orphans=self._n_orphans,
        )

    def eviction_scores(self, keys):
        """The policy's score now of each committed key (lower goes first): how eviction ranks them."""
        slots = []
        cdef int32_t s
        for k in keys:
            s = self._committed(_as_key(k))
            if s < 0:
                raise KeyError(k)
            slots.append(s)
        return self.policy.scores(self._cols, np.array(slots, dtype=np.int64), self._clock()).tolist()

    def verify(self):
        """Recount from the slots everything the index keeps incrementally (pool and tenant bytes, dependent
        and waiting counts, checkpoint bits, key entries, the free list) and say what disagrees; empty when
        consistent. O(objects): for tests and for debugging, never on a request path."""
        cdef Py_ssize_t s, n = self._n
        cdef int32_t e, a
        live = [s for s in range(n) if self._flags[s] & LIVE]
        out = []
        committed = sum(1 for s in live if not self._flags[s] & PENDING)
        if committed != self._n_committed or len(live) - committed != self._n_pending:
            out.append(f"{len(live)} live slots for {self._n_committed + self._n_pending} keys")
        used = {}
        tenants = {}
        pinned = {}
        deps = {}
        waiting = {}
        for s in live:
            e = self._entry[s]
            if not self._table.valid(e) or self._table.slot(e) != s:
                out.append(f"slot {s} is not its key's slot")
                continue
            key = self._key(s)
            pool = (self._node[s], self._tier[s])
            used[pool] = used.get(pool, 0) + self._size[s]
            tenants[self._tenant[s]] = tenants.get(self._tenant[s], 0) + self._size[s]
            if s in self._pins:
                pinned[self._tenant[s]] = pinned.get(self._tenant[s], 0) + self._size[s]
            if bool(self._flags[s] & PINNED) != (s in self._pins):
                out.append(f"slot {s}: pinned flag disagrees with the pin table")
            e = self._anchor[s]
            if e >= 0:
                if not self._table.valid(e):
                    out.append(f"slot {s}: anchor entry {e} is not in the key table")
                    continue
                a = self._table.slot(e)
                if a < 0:
                    waiting[e] = waiting.get(e, 0) + 1
                else:
                    deps[a] = deps.get(a, 0) + 1
            if block_tag(key) == MLA_TAG and not self._flags[s] & PENDING:
                has = bool(self._flags[s] & CKPT)
                if has != (self._committed(KDA_TAG + key[1:]) >= 0):
                    out.append(f"checkpoint bit of {key[:9].hex()} is {has}")
        for nid in self._node_order:
            for tier in Tier:
                t = int(tier)
                if self._used[nid, t] != used.get((nid, t), 0) or self._used[nid, t] > self._cap[nid, t]:
                    out.append(f"node {self._node_names[nid]} {tier.name}: {self._used[nid, t]} bytes counted")
        if {t: self._tenant_used[t] for t in range(len(self._tenants)) if self._tenant_used[t]} != tenants:
            out.append("tenant bytes drifted")
        out.extend(self._pins.problems(pinned))
        if {s: self._deps[s] for s in live if self._deps[s]} != deps:
            out.append("dependent counts drifted")
        table_waiting = {}
        entries = 0
        for e in range(<int32_t>self._table.id_bound()):
            if not self._table.valid(e):
                continue
            entries += 1
            if self._table.waiting(e):
                table_waiting[e] = self._table.waiting(e)
            if self._table.slot(e) < 0 and not self._table.waiting(e):
                out.append(f"key entry {e} names nothing and nobody waits for it")
        if table_waiting != waiting or sum(waiting.values()) != self._n_orphans:
            out.append("orphan counts drifted")
        if entries != self._table.size():
            out.append("key table size drifted")
        if self._ordered:
            ordered = sum(self._order[i].size() for i in range(self._order.size()))
            if ordered != sum(1 for s in live if self._flags[s] & ORDERED) or any(
                bool(self._flags[s] & ORDERED) != self._evictable_leaf(s) for s in live
            ):
                out.append("the LRU order drifted")
        free = [self._free[i] for i in range(self._free.size())]
        if len(free) != len(set(free)):
            out.append("a slot was freed twice")
        held = {int(s) for _, slots in self._leases_by_id.values() for s in slots}
        if set(free) & (set(live) | held):
            out.append("a live or leased slot is on the free list")
        counts = collections.Counter(int(s) for _, slots in self._leases_by_id.values() for s in slots)
        if dict(counts) != {int(kv.first): int(kv.second) for kv in self._lease_count}:
            out.append("the read-lease counts drifted from the open leases")
        if any(bool(self._flags[s] & LEASED) != (s in counts) for s in range(n)):
            out.append("a LEASED bit disagrees with the lease counts")
        if set(range(n)) - set(live) - set(free) - set(counts):
            out.append("a slot is neither live, free nor leased (leaked)")
        return out

    # -------------------------------------------------------------------------------- expiry, eviction

    def expire(self):
        """Retire everything due now (leases, soft pins, TTLs); returns the objects dropped by TTL."""
        before = len(self._events)
        removed = self._retire_due(self._clock())
        if not self._keep_events:
            del self._events[before:]
        return removed

    def evict(self):
        """Run the watermark pass on every pool; returns the removals/demotions it made."""
        now = self._clock()
        self._retire_due(now)
        start = len(self._events)
        keep = self._keep_events
        self._keep_events = True
        try:
            for nid in list(self._node_order):
                for tier in (T_DRAM, T_SSD):
                    if self._cap[nid, tier]:
                        self._evict_pool(nid, tier, now, -1)
            if self.max_objects and self._n_committed + self._n_pending > self.high_watermark * self.max_objects:
                self._evict_objects(<int64_t>(self.low_watermark * self.max_objects), now, -1)
            out = self._events[start:]
        finally:
            self._keep_events = keep
        if not keep:
            del self._events[start:]
        return out

    def drain_events(self):
        """Removals/demotions since the last drain that the owning nodes must carry out."""
        out, self._events = self._events, []
        return out

    cdef list _retire_due(self, double now):
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._lease_heap)
            self.release(lease_id)
        for slot, session in self._pins.due(now):
            self._unpin(slot, session)
        removed = []
        heap = self._ttl_heap
        cdef Py_ssize_t slot_i
        while heap and heap[0][0] <= now:
            deadline, slot_i, gen = heapq.heappop(heap)
            if self._ttl.get(slot_i) != (deadline, gen):
                continue  # stale entry: object gone, slot reused or TTL set again
            if self._leased(slot_i):
                self._set_ttl(slot_i, now + 0.05)  # being read: expire after the fetch
                continue
            self._expired += 1
            removed.append(self._drop(slot_i, "expired", True, False))
        return removed

    cdef tuple _candidates(self, int mode, int nid, int tier, bint leaves, int tid, Py_ssize_t protect, double now):
        """Slots that may go now for a pass (``mode``: a pool, the object cap, a tenant), in policy order
        (stable: ties by slot), with their scores as float64."""
        cdef Py_ssize_t s, k = 0, n = self._n
        cand_a = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] cand = cand_a
        for s in range(n):
            if (self._flags[s] & (MOVABLE | LEASED)) != LIVE or s == protect:
                continue
            if leaves and self._deps[s]:
                continue
            if mode == FOR_POOL and (self._node[s] != nid or self._tier[s] != tier):
                continue
            if mode == FOR_TENANT and self._tenant[s] != tid:
                continue
            cand[k] = s
            k += 1
        cand_a = cand_a[:k]
        scores = np.asarray(self.policy.scores(self._cols, cand_a, now))
        order = np.argsort(scores, kind="stable")
        return cand_a[order], scores[order].astype(np.float64, copy=False)

    cdef void _evict_pool(self, int nid, int tier, double now, Py_ssize_t protect) except *:
        cdef int64_t cap = self._cap[nid, tier]
        if self._used[nid, tier] <= self.high_watermark * cap:
            return
        self._shrink_pool(nid, tier, <int64_t>(self.low_watermark * cap), now, protect)

    cdef bint _make_room(self, int nid, int tier, int64_t size, double now) except -1:
        cdef int64_t cap = self._cap[nid, tier]
        if size <= cap - self._used[nid, tier]:
            return True
        self._shrink_pool(nid, tier, min(<int64_t>(self.low_watermark * cap), cap - size), now, -1)
        return size <= cap - self._used[nid, tier]

    cdef void _shrink_pool(self, int nid, int tier, int64_t target, double now, Py_ssize_t protect) except *:
        """Bring a pool's used bytes down to ``target``: demote DRAM->SSD when the node has SSD, else drop
        leaves (an object with dependents is never dropped by pressure)."""
        cdef bint demote = tier == T_DRAM and self._cap[nid, T_SSD] > 0
        if self._ordered and not demote:  # the pool's LRU order is its candidates, already sorted
            self._drain(None, None, FOR_POOL, nid, tier, 0, target, False, protect, now)
            return
        cand, scores = self._candidates(FOR_POOL, nid, tier, not demote, 0, protect, now)
        self._drain(cand, scores, FOR_POOL, nid, tier, 0, target, demote, protect, now)

    cdef void _evict_objects(self, int64_t target, double now, Py_ssize_t protect) except *:
        """Bring the object count down to ``target`` (the object cap): leaves of every pool, in policy
        order, as pressure on bytes would drop them (never an object with dependents, a pin or a lease)."""
        cand, scores = self._candidates(FOR_OBJECTS, 0, 0, True, 0, protect, now)
        self._drain(cand, scores, FOR_OBJECTS, 0, 0, 0, target, False, protect, now)

    cdef void _evict_tenant(self, int tid, int64_t target, double now) except *:
        """Drop the tenant's own evictable leaves (any pool) until it holds at most ``target`` bytes."""
        cand, scores = self._candidates(FOR_TENANT, 0, 0, True, tid, -1, now)
        self._drain(cand, scores, FOR_TENANT, 0, 0, tid, target, False, -1, now)

    cdef bint _over(self, int mode, int nid, int tier, int tid, int64_t target):
        if mode == FOR_POOL:
            return self._used[nid, tier] > target
        if mode == FOR_OBJECTS:
            return self._n_committed + self._n_pending > target
        return self._tenant_used[tid] > target

    cdef void _drain(
        self, cand_a, scores_a, int mode, int nid, int tier, int tid, int64_t target, bint demote,
        Py_ssize_t protect, double now,
    ) except *:
        """Walk candidates in policy order, merging in anchors that become leaves as their last dependent
        goes (after the candidates of an equal score), until the pass's target is met.

        ``cand_a`` None: the pool's LRU order is the candidates (plain LRU, a pool that drops). The order at
        the start of the pass is the scan's snapshot (every evictable leaf by last use, ties by slot;
        ``protect`` is skipped), and a leaf the pass exposes is held back from the order until the pass
        ends (``_reorder``), so it is merged here as the scan's pass merges it."""
        cdef bint walk = cand_a is None, more
        cdef int64_t[::1] order
        cdef double[::1] scores
        cdef cset[OrderKey]* lru = NULL
        cdef cset[OrderKey].iterator it
        cdef Py_ssize_t i = 0, n = 0, slot, k
        cdef int32_t e, a
        cdef double next_score = 0.0
        cdef int outer = self._walking
        cdef size_t held_from = self._held_back.size()
        if walk:
            self._walking = nid * N_TIERS + tier
            lru = &self._order[self._walking]
            it = lru.begin()
        else:
            order, scores = cand_a, scores_a
            n = order.shape[0]
        cdef double score
        policy = one = None  # (a pass over the LRU order scores nothing: looked up at the first anchor)
        # the anchors exposed so far, a heap of (-score, -slot): its front is the least (score, slot), the
        # order a heap of (score, slot) tuples would pop them in
        cdef vector[OrderKey] exposed
        try:
            while self._over(mode, nid, tier, tid, target):
                more = it != lru.end() if walk else i < n
                if more:
                    next_score = deref(it).first if walk else scores[i]
                if not exposed.empty() and (not more or -exposed.front().first < next_score):
                    slot = -exposed.front().second
                    pop_heap(exposed.begin(), exposed.end())
                    exposed.pop_back()
                elif more and walk:
                    slot = deref(it).second
                    inc(it)  # before the drop erases it
                    if slot == protect:
                        continue
                elif more:
                    slot = order[i]
                    i += 1
                else:
                    return
                if not self._flags[slot] & LIVE:
                    continue
                e = self._anchor[slot]
                if not self._act(slot, mode, nid, tier, demote, now) or e < 0:
                    continue
                a = self._table.slot(e)
                # the anchor is now an evictable leaf (live, committed, unpinned, unleased, no dependents)
                # of what this pass drains
                if (
                    a >= 0
                    and a != protect
                    and self._evictable_leaf(a)
                    and (
                        mode == FOR_OBJECTS
                        or (mode == FOR_TENANT and self._tenant[a] == tid)
                        or (mode == FOR_POOL and not demote and self._node[a] == nid and self._tier[a] == tier)
                    )
                ):
                    if walk:
                        score = self._last_use[a]
                    elif self._dead_scores and self._kind[a] == K_MLA and self._deps[a] == 0:
                        score = self._dead_score(a, now)
                    else:
                        if policy is None:
                            policy = self._policy
                            one = getattr(policy, "score_one", None)  # its score alone, as ``scores`` gives it
                        if one is not None:
                            score = one(self._cols, a, now)
                        else:
                            score = float(policy.scores(self._cols, np.array([a]), now)[0])
                    exposed.push_back(OrderKey(-score, -a))
                    push_heap(exposed.begin(), exposed.end())
        finally:
            if walk:
                self._walking = outer
                for k in range(held_from, self._held_back.size()):
                    self._reorder(self._held_back[k])
                self._held_back.resize(held_from)

    cdef double _dead_score(self, Py_ssize_t slot, double now) except? -1.0:
        """``HybridPolicy.score_one`` of a dead MLA block (what an exposed anchor is), in C with the same
        libm calls: recency, less the weighted log of its size once the model has learned enough."""
        cdef double rec = -log2(fmax(now - self._last_use[slot], C_MIN_AGE_S))
        cdef double w = self._guard.w
        if w > 0 and not self._observed_enough:
            policy = self._policy
            self._observed_enough = policy.model.observed >= policy.min_observations
        if w > 0 and self._observed_enough:
            rec -= w * log2(<double>max(self._size[slot], 1))
        return rec - C_DEAD_FIRST

    cdef bint _act(self, Py_ssize_t slot, int mode, int nid, int tier, bint demote, double now) except -1:
        """Evict (or, in a DRAM pool over an SSD tier, demote) one candidate; True if it was dropped."""
        cdef int64_t size = self._size[slot]
        if mode != FOR_POOL:
            self._evictions += 1
            self._evicted_bytes += size
            if mode == FOR_OBJECTS:
                self._learn_eviction(slot, size)
                self._drop(slot, "evicted", True, False, False)
            else:
                self._drop(slot, "quota", True, False, False)
            return True
        if self._tier[slot] != tier:
            return False  # already demoted earlier in this pass
        if demote and self._kind[slot] != K_TAIL and self._make_room(nid, T_SSD, size, now):
            if not self._flags[slot] & LIVE:  # SSD eviction cannot touch DRAM slots, but be safe
                return False
            self._unorder(slot)
            self._tier[slot] = T_SSD
            self._reorder(slot)
            self._used[nid, T_DRAM] -= size
            self._used[nid, T_SSD] += size
            self._demotions += 1
            if self._keep_events:
                self._events.append(Removal(self._key(slot), self._node_names[nid], Tier.DRAM, size, "demoted", True))
            return False
        if self._deps[slot]:
            return False  # demotion impossible and it still has dependents: keep it
        self._evictions += 1
        self._evicted_bytes += size
        self._learn_eviction(slot, size)
        self._drop(slot, "evicted", True, False, False)
        return True

    cdef void _learn_eviction(self, Py_ssize_t slot, int64_t size) except *:
        """Tell admission and a learning policy an MLA block or checkpoint left by pressure (and whether it
        was ever read)."""
        # HybridPolicy's on_evict learns from checkpoints only (a ghost): it is not called for the rest
        if self._learner is not None and (self._kind[slot] == K_KDA or not self._evicts_checkpoints_only):
            self._learner.on_evict(self._cols, slot, self._key(slot), self._clock())
        cdef int32_t e = self._entry[slot]
        if (
            self._adm != NULL and (self._kind[slot] == K_MLA or self._kind[slot] == K_KDA)
            and self._table.key_len(e) == 33
        ):
            # a block key: the tag, then the 32-byte hash admission remembers
            self._adm.evicted(
                self._table.key_data(e) + 1, size, self._capacity_of(T_DRAM), self._freq[slot] <= 1.0
            )

    cdef object _drop(self, Py_ssize_t slot, reason, bint emit, bint demoted, bint want=True):
        """Remove a live slot from every structure; the slot is recycled once no lease refers to it. The
        removal is returned when ``want`` (else None, unless it is emitted: an eviction's caller has no
        use for it)."""
        cdef int32_t e = self._entry[slot], ea = self._anchor[slot], m, a
        cdef uint8_t buf[33]
        cdef bint answer = want or (emit and self._keep_events)
        key = self._key(slot) if answer else None  # (a pass that only evicts makes no bytes per object)
        cdef bint committed = not self._flags[slot] & PENDING
        self._table.set_slot(e, -1)
        if committed:
            self._n_committed -= 1
        else:
            self._n_pending -= 1
        if committed and self._kind[slot] == K_KDA:  # the kind is the key's tag (check_object)
            buf[0] = C_MLA_TAG
            memcpy(&buf[1], self._table.key_data(e) + 1, 32)
            m = self._table.find(buf, 33)
            m = self._table.slot(m) if m >= 0 else -1
            if m >= 0 and not self._flags[m] & PENDING:
                self._flags[m] &= ~CKPT
        if ea >= 0:
            a = self._table.slot(ea)
            if a >= 0:
                self._deps[a] -= 1
                self._reorder(a)
            else:
                self._table.set_waiting(ea, self._table.waiting(ea) - 1)
                self._n_orphans -= 1
                if ea != e:
                    self._forget_if_unused(ea)
        cdef uint32_t deps = self._deps[slot]
        if deps:  # its dependents now wait for the key to come back
            self._n_orphans += deps - self._table.waiting(e)
            self._table.set_waiting(e, deps)
        self._forget_if_unused(e)
        cdef int64_t size = self._size[slot]
        cdef int tier_i = self._tier[slot]
        cdef int nid = self._node[slot]
        if self._node_present[nid]:
            self._used[nid, self._tier[slot]] -= size
        self._tenant_used[self._tenant[slot]] -= size
        if self._flags[slot] & PINNED:  # the bit is the pin table's membership (verify)
            self._unpin(slot)
        if self._ttl:
            self._ttl.pop(slot, None)
        self._unorder(slot)  # after the unpin, which may have ordered it (it was live until now)
        self._flags[slot] &= LEASED  # a leased slot is recycled when its last lease ends (``release``)
        self._deps[slot] = 0
        self._entry[slot] = -1
        self._anchor[slot] = -1
        if not self._leased(slot):
            self._free.push_back(slot)
        if not answer:
            return None
        event = tuple.__new__(Removal, (key, self._node_names[nid], _TIERS[tier_i], size, reason, demoted))
        if emit and self._keep_events:
            self._events.append(event)
        return event

    cdef object _info(self, Py_ssize_t slot):
        key = self._key(slot)
        kind = ObjectKind(self._kind[slot])
        t = self._ttl.get(slot)
        remaining = max(1, int((t[0] - self._clock()) * 1000)) if t is not None else 0
        parent = b""
        if kind != ObjectKind.KDA and self._anchor[slot] >= 0:
            parent = self._key_of_entry(self._anchor[slot])
        return ObjectInfo(
            key=key,
            kind=kind,
            size=self._size[slot],
            checksum=self._checksum[slot],
            tenant=self._tenants[self._tenant[slot]],
            parent=parent,
            node_id=self._node_names[self._node[slot]],
            tier=Tier(self._tier[slot]),
            ttl_ms=remaining,
            committed=not self._flags[slot] & PENDING,
            pinned=slot in self._pins,
            leases=self._leased(slot),
            depth=self._depth[slot],
            dependents=self._deps[slot],
            last_use=self._last_use[slot],
            freq=self._freq[slot],
        )
