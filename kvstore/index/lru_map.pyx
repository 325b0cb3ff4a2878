# cython: language_level=3, boundscheck=True, wraparound=False
"""Bytes keys to int values in least-recently-set order, bounded: ``LruKeys`` (``lru_keys.h``) for Python
callers that set many keys at once.

Why: the default policy's return-time model tickets every block a writer's lookup misses with the
request's class (``return_time.ReturnTimeModel.ticket``), a bounded map where each key set moves to the
newest end and the oldest go first, and every put is given the class of its ticket. In C++ the index
reads a put's ticket itself (``PrefixIndex`` takes the map's address from ``_address``) and classes the
put without calling the policy: no Python call per block.
"""

from cpython.pycapsule cimport PyCapsule_New

from libc.stdint cimport int32_t, int64_t, uint8_t
from libcpp cimport bool as cbool

from lru_keys cimport LruKeys, lru_items


MAX_KEY_BYTES = 1024  # key_table.h's bound
CAPSULE = b"kvpool.LruKeys"  # the name of ``_address``'s capsule


cdef class LruMap:
    """At most ``entries`` keys (bytes, 1 to 1,024 of them) with an int64 value each, oldest set first."""

    cdef LruKeys* _k
    cdef readonly Py_ssize_t entries

    def __cinit__(self, Py_ssize_t entries):
        if entries <= 0:
            raise ValueError(f"an LruMap holds at least one entry, got {entries}")
        self._k = new LruKeys(0xD6E8FEB86659FD93)
        self.entries = entries

    def __dealloc__(self):
        del self._k

    def __len__(self):
        return self._k.size()

    def _address(self):
        """The C++ object, for ``PrefixIndex`` (which keeps this map alive while it uses it)."""
        return PyCapsule_New(<void*>self._k, CAPSULE, NULL)

    def set_newest(self, keys, int64_t value) -> None:
        """Set each key to ``value`` and move it to the newest end, in turn (a key given twice stands where
        it last appears); then forget the oldest beyond ``entries``."""
        cdef bytes k
        cdef cbool added
        cdef int32_t e
        try:
            for x in keys:
                k = x
                if not 0 < len(k) <= MAX_KEY_BYTES:
                    raise ValueError(f"an LruMap key is 1..{MAX_KEY_BYTES} bytes, got {len(k)}")
                e = self._k.add(<const uint8_t*><const char*>k, len(k), value, &added)
                if not added:
                    self._k.set_value(e, value)
                    self._k.touch(e)
        finally:  # what was set before a bad key stands, within the bound
            while <Py_ssize_t>self._k.size() > self.entries:
                self._k.erase(self._k.oldest())

    def get(self, key, default=None):
        """The value of ``key`` (bytes), or ``default``; never moves it."""
        if type(key) is not bytes:
            return default
        cdef bytes k = key
        cdef int32_t e = self._k.find(<const uint8_t*><const char*>k, len(k))
        return self._k.value(e) if e >= 0 else default

    def items(self) -> list:
        """``(key, value)`` oldest first."""
        return lru_items(self._k)
