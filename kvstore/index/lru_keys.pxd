# The Cython declaration of ``LruKeys`` (lru_keys.h), one for every module that reaches one: the index core,
# the recency guard, admission and the LRU map. Declarations and an inline function only: nothing to import
# at run time.
from libc.stdint cimport int32_t, int64_t, uint8_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector


cdef extern from "lru_keys.h" namespace "kvpool":
    cdef cppclass LruKeys:
        LruKeys(unsigned long long seed) except +
        size_t size()
        int32_t find(const uint8_t* key, size_t length)
        int32_t add(const uint8_t* key, size_t length, int64_t value, cbool* added) except +
        void touch(int32_t e)
        int64_t value(int32_t e)
        void set_value(int32_t e, int64_t v)
        int32_t oldest()
        void erase(int32_t e) except +
        void order(vector[int32_t]* out) except +
        size_t key_len(int32_t e)
        const uint8_t* key_data(int32_t e)


cdef inline list lru_items(const LruKeys* keys):
    """``(key, value)`` oldest first."""
    cdef vector[int32_t] order
    keys.order(&order)
    return [((<const char*>keys.key_data(e))[: keys.key_len(e)], keys.value(e)) for e in order]
