"""The master process's C heap and resident memory: keep freed memory from staying resident (glibc
``mallopt`` / ``malloc_trim``), and read the resident set the master exports. Process-wide, and apart from
``MasterCore``, because they act on the whole process, not on the master's state: the master's command
pins the threshold when it starts, the core trims after a bulk adoption.
"""

from __future__ import annotations

import ctypes
import functools
import os

# Keep a bulk load's freed memory from staying resident (glibc ``mallopt`` / ``malloc_trim``). Why the
# master needs it: adopting node inventories (a restarted master re-indexing a million objects)
# parses large ``RegisterNodeRequest`` messages (gRPC receive buffer, protobuf arena, one wrapper per
# object) and grows the index (numpy columns, slot lists, the key dict). Two glibc behaviours then keep
# that freed memory resident (docs/design/store_master.md §7 has the measured cost and the ablation):
#
# * the *dynamic* mmap threshold: freeing one big mmapped block (a 4 MB request, an old dict table) raises
#   the threshold to that size, so later big blocks (columns, lists, the next request) come from the heap,
#   where a freed block returns nothing to the OS and leaves holes. :func:`fix_mmap_threshold` pins the
#   threshold, so blocks above it are always their own mappings, unmapped on free (realloc = mremap);
# * freed blocks inside the heap keep their pages until ``malloc_trim`` (only the heap's top is returned
#   on ``free``). :func:`release_free_heap` returns every whole free page of every arena.
#
# Both are safe for a long-lived server: the threshold only decides where big blocks live (the master's
# per-call messages are far below it), and trimmed pages fault back in only if the heap grows there again.
# Each is a no-op returning False where the C library lacks it (musl, macOS).
_M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)

# The master process pins the threshold here at start (fix_mmap_threshold): above every per-call message of
# the hot paths (a 2,000-block MatchPrefix reply is ~0.2 MB), below the index's columns and key-table
# buckets at scale and below a large inventory message. From the start, not from the first bulk load: an
# index grown by puts outgrows its columns too, and each outgrown column left in the heap kept ~12 B per
# indexed object resident at 10 M objects (docs/measurements/index_core.md).
MASTER_MMAP_THRESHOLD = 1 << 20


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


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def process_rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``; 0 where there is none): the master's memory
    figure, exported so an operator sees it next to the object count it follows."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0
