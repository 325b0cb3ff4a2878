"""Keep a bulk load's freed memory from staying resident (glibc ``mallopt`` / ``malloc_trim``).

Why the master needs it: adopting node inventories (a restarted master re-indexing a million objects)
parses large ``RegisterNodeRequest`` messages (gRPC receive buffer, protobuf arena, one wrapper per
object) and grows the index (numpy columns, slot lists, the key dict). Two glibc behaviours then keep
freed memory resident, ~30-45 B per indexed object at 1 M objects, up to ~150 B at 200 k:

* the *dynamic* mmap threshold: freeing one big mmapped block (a 4 MB request, an old dict table) raises
  the threshold to that size, so later big blocks (columns, lists, the next request) come from the heap,
  where a freed block returns nothing to the OS and leaves holes. :func:`fix_mmap_threshold` pins the
  threshold, so blocks above it are always their own mappings, unmapped on free (realloc = mremap);
* freed blocks inside the heap keep their pages until ``malloc_trim`` (only the heap's top is returned
  on ``free``). :func:`release_free_heap` returns every whole free page of every arena.

Both are safe for a long-lived server: the threshold only decides where big blocks live (the master's
per-call messages are far below it), and trimmed pages fault back in only if the heap grows there again.
Each is a no-op returning False where the C library lacks it (musl, macOS).
"""

from __future__ import annotations

import ctypes
import functools

_M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve every allocation of at least ``nbytes`` from its own mapping from now on (process-wide;
    turns off glibc's dynamic threshold). True if the C library took it."""
    libc = _libc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, nbytes) == 1


def release_free_heap() -> bool:
    """Give the OS back every whole free page of the C heap. True if the C library can (glibc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
