# cython: language_level=3
"""The block hashes of hash-id records (Mooncake traces), one tenant's memo, compiled.

Block i of a request is the trace's ``hash_ids[i]`` and its hash is
``h_i = SHA-256(h_{i-1} || TRACE_ROOT || le64(hash_ids[i]))`` from the tenant's root. Trace ids are already
chained (equal id => equal prefix), so ``h_i`` depends only on the tenant and the id and is memoised per id:
a request re-sends a known prefix, then new blocks.

Why compiled: a production trace has tens of millions of new ids, and per id the Python chain cost ~0.6 us
(two concatenations, ``to_bytes``, hashlib's context setup, the memo's dict), a fifth of a simulator point;
here one probe of a C++ map per id and, for a new one, one SHA-256 on the stack (``sha256.h``). The hashes
are the ones ``workloads/chains.py`` computed in Python before (checked against hashlib there:
tests/test_workloads_id_chains.py).

Bad input: an id that is not an integer (``__index__``) is ``TypeError``, one outside [0, 2^64)
``OverflowError``, with nothing memoised for it (the ids before it stay memoised).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.number cimport PyNumber_Index
from cython.operator cimport dereference as deref
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy
from libcpp.unordered_map cimport unordered_map
from libcpp.utility cimport pair


cdef extern from "sha256.h" namespace "kvpool":
    void sha256(const uint8_t* msg, size_t n, uint8_t* out) nogil
    void sha256_portable(const uint8_t* msg, size_t n, uint8_t* out) nogil


TRACE_ROOT = b"kvpool-sim-trace-ids/1|"
cdef bytes C_TRACE_ROOT = TRACE_ROOT
cdef enum:
    ROOT_LEN = 23  # len(TRACE_ROOT)
    MSG_LEN = 32 + ROOT_LEN + 8  # parent, root, le64 id
if len(TRACE_ROOT) != ROOT_LEN:
    raise ImportError("TRACE_ROOT is not ROOT_LEN bytes")


cdef class TenantIds:
    """One tenant's trace id -> block hash memo, and the chain of a request's ids through it."""

    cdef bytes _root  # None until ``__init__``: ``chain`` refuses to run on a memo without a root
    cdef unordered_map[uint64_t, Py_ssize_t] _row  # id -> index of its hash in ``_hashes``
    cdef list _hashes

    def __cinit__(self):
        self._hashes = []

    def __init__(self, root):
        """A memo for the tenant whose chains start at ``root`` (32 bytes); (re)initialised empty."""
        if type(root) is not bytes or len(root) != 32:
            raise ValueError(f"a tenant root is 32 bytes, got {root!r:.80}")
        self._row.clear()
        self._hashes = []
        self._root = root

    def __len__(self):
        return len(self._hashes)

    def __reduce__(self):
        """Pickled as its root and its hashes with their ids, in the order they were made (a sweep's
        workers on another host get the memo a local pool's workers inherit)."""
        ids = [0] * len(self._hashes)
        for entry in self._row:
            ids[entry.second] = entry.first
        return (_restore, (self._root, ids, list(self._hashes)))

    def chain(self, ids):
        """The block hashes of a request's ``ids``, in order (each id's memoised hash, or a new one chained
        from the previous block's)."""
        if self._root is None:
            raise ValueError("TenantIds has no root: call __init__")
        cdef Py_ssize_t n = len(ids), i, row
        cdef int k
        cdef uint64_t hid
        cdef unordered_map[uint64_t, Py_ssize_t].iterator it
        cdef uint8_t msg[MSG_LEN]
        cdef bytes h, parent = self._root
        out = [None] * n
        memcpy(&msg[32], PyBytes_AS_STRING(C_TRACE_ROOT), ROOT_LEN)
        for i in range(n):
            v = ids[i]
            hid = v if type(v) is int else PyNumber_Index(v)  # (a float is no id: TypeError)
            it = self._row.find(hid)
            if it != self._row.end():
                h = self._hashes[deref(it).second]
            else:
                memcpy(msg, PyBytes_AS_STRING(parent), 32)
                for k in range(8):
                    msg[32 + ROOT_LEN + k] = <uint8_t>(hid >> (8 * k))
                h = PyBytes_FromStringAndSize(NULL, 32)
                sha256(msg, MSG_LEN, <uint8_t*>PyBytes_AS_STRING(h))
                row = len(self._hashes)
                self._hashes.append(h)  # first: the map never names a row the list lacks
                self._row.insert(pair[uint64_t, Py_ssize_t](hid, row))
            out[i] = h
            parent = h
        return out


def _restore(root, ids, hashes):
    """A pickled ``TenantIds`` back (``__reduce__``); its hashes are taken as they were made."""
    cdef TenantIds memo = TenantIds(root)
    if len(ids) != len(hashes) or not all(type(h) is bytes and len(h) == 32 for h in hashes):
        raise ValueError("a pickled TenantIds needs one 32-byte hash per id")
    cdef Py_ssize_t row
    for row in range(len(ids)):
        memo._hashes.append(hashes[row])
        memo._row.insert(pair[uint64_t, Py_ssize_t](<uint64_t>ids[row], row))
    if <Py_ssize_t>memo._row.size() != len(ids):
        raise ValueError("a pickled TenantIds names an id twice")
    return memo


def sha256_digest(data, bint portable=False):
    """SHA-256 of ``data`` (bytes) as ``sha256.h`` computes it: the CPU's fastest way, or with ``portable``
    the rounds a CPU without the SHA extensions runs (the tests check both against hashlib)."""
    cdef bytes b = bytes(data)
    out = PyBytes_FromStringAndSize(NULL, 32)
    if portable:
        sha256_portable(<const uint8_t*>PyBytes_AS_STRING(b), len(b), <uint8_t*>PyBytes_AS_STRING(out))
    else:
        sha256(<const uint8_t*>PyBytes_AS_STRING(b), len(b), <uint8_t*>PyBytes_AS_STRING(out))
    return out
