"""The storage node's DRAM tier: one named shared-memory segment plus an extent allocator.

Why one segment: a same-host reader (the ``shm`` transport) maps it once and copies objects straight out at
memcpy speed, instead of a segment per object (thousands of fds, slow create/unlink). The node process is the
only owner; it creates and unlinks the segment. Readers attach with :func:`attach_segment`, which takes the
segment away from Python 3.11's resource_tracker — otherwise the tracker of a *reader* unlinks the node's pool
when the reader exits.

The allocator is best-fit over a sorted free list with coalescing on free; extents are 64-byte aligned so
copies stay cache-line aligned. ``fragmentation`` = 1 - largest free extent / total free
(0 = one hole, towards 1 = dust).

The segment is a little longer than the allocator's ``[0, capacity)``: its tail holds the generation stamps
(``protocol/shm_segment``) that let a same-host reader validate a remembered extent without asking the node.
Capacity and fragmentation accounting only ever see ``[0, capacity)``.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory

from kvpool.kvstore.errors import BadRequestError, CapacityExceededError, ObjectTooLargeError
from kvpool.kvstore.protocol.shm_segment import (
    MADV_POPULATE_WRITE,
    StampTable,
    default_slots,
    release_view,
    segment_size,
)

ALIGN = 64


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Extent:
    """A byte range of the pool. Size is the object's size; the reserved span is rounded up to ``ALIGN``."""

    offset: int
    size: int


class ExtentAllocator:
    """Best-fit allocator over ``[0, capacity)`` keeping free extents sorted by offset, coalesced on free."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._free_off: list[int] = [0]  # sorted offsets of free extents
        self._free_len: dict[int, int] = {0: capacity}
        self._used: dict[int, int] = {}  # offset -> reserved span
        self.used_bytes = 0

    def allocate(self, size: int) -> Extent:
        """Reserve ``size`` bytes; ``ObjectTooLargeError`` / ``CapacityExceededError`` when it cannot."""
        if size < 0:
            raise BadRequestError(f"negative size {size}")
        if size == 0:
            return Extent(0, 0)
        span = _round_up(size)
        if span > self.capacity:
            raise ObjectTooLargeError(f"object of {size} B exceeds the pool capacity of {self.capacity} B")
        best = -1
        best_len = 0
        for off in self._free_off:
            length = self._free_len[off]
            if length >= span and (best < 0 or length < best_len):
                best, best_len = off, length
                if length == span:
                    break
        if best < 0:
            raise CapacityExceededError(
                f"no free extent of {span} B (free {self.free_bytes} B, largest {self.largest_free} B)"
            )
        i = bisect.bisect_left(self._free_off, best)
        del self._free_len[best]
        if best_len == span:
            del self._free_off[i]
        else:
            self._free_off[i] = best + span
            self._free_len[best + span] = best_len - span
        self._used[best] = span
        self.used_bytes += span
        return Extent(best, size)

    def free(self, extent: Extent) -> None:
        """Return an extent, merging free neighbours. Freeing an unallocated extent is a bug: ValueError."""
        if extent.size == 0:
            return
        span = self._used.pop(extent.offset, None)
        if span is None:
            raise ValueError(f"extent at {extent.offset} is not allocated")
        self.used_bytes -= span
        off = extent.offset
        i = bisect.bisect_left(self._free_off, off)
        # merge with the next free extent
        if i < len(self._free_off) and self._free_off[i] == off + span:
            span += self._free_len.pop(self._free_off[i])
            del self._free_off[i]
        # merge with the previous free extent
        if i > 0:
            prev = self._free_off[i - 1]
            if prev + self._free_len[prev] == off:
                self._free_len[prev] += span
                return
        self._free_off.insert(i, off)
        self._free_len[off] = span

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max(self._free_len.values(), default=0)

    @property
    def fragmentation(self) -> float:
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free


class SharedPool:
    """Owner side: creates the named segment, hands out extents, exposes a memoryview; ``close`` unlinks.

    ``stamp_slots``: how many objects can carry a generation stamp at once (default
    ``shm_segment.default_slots(capacity)``; 0 = no stamp fast path for readers).
    """

    def __init__(self, capacity: int, name: str | None = None, stamp_slots: int | None = None) -> None:
        self.name = name or f"kvpool-{secrets.token_hex(6)}"
        slots = default_slots(capacity) if stamp_slots is None else stamp_slots
        self._shm = shared_memory.SharedMemory(
            name=self.name, create=True, size=segment_size(capacity, slots)
        )
        self.allocator = ExtentAllocator(capacity)
        self.buf: memoryview = self._shm.buf
        self.capacity = capacity
        self.stamps = StampTable(self.buf, capacity, slots)

    def prefault(self) -> None:
        """Back every page now instead of on first write.

        A fresh tmpfs page costs a fault plus zeroing on first touch: puts into an untouched pool ran at
        ~0.5 GB/s here against ~3 GB/s into touched memory. A serving node commits its capacity up front.
        """
        try:
            self._shm._mmap.madvise(MADV_POPULATE_WRITE)  # type: ignore[union-attr]  # Linux >= 5.14
        except (OSError, AttributeError, ValueError):
            chunk = bytes(min(self.capacity, 64 << 20))
            for off in range(0, self.capacity, len(chunk)):
                n = min(len(chunk), self.capacity - off)
                self.buf[off : off + n] = chunk[:n]

    def view(self, extent: Extent) -> memoryview:
        return self.buf[extent.offset : extent.offset + extent.size]

    def close(self) -> None:
        """Unlink the segment, then release the mapping (idempotent).

        Unlinking first means the name never leaks. Releasing can fail with BufferError while a slice of the
        pool is still referenced (a send or SSD write cut short by shutdown); after one garbage collection
        the mapping is left to process exit rather than failing the shutdown.
        """
        if self._shm is None:
            return
        self.stamps.clear_all()  # a reader's mapping outlives the unlink: it must stop trusting our stamps
        self.stamps.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()
        try:
            release_view(self.buf, self._shm)
        except BufferError:
            gc.collect()
            with contextlib.suppress(BufferError):
                release_view(self.buf, self._shm)
        self._shm = None
