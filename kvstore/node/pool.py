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
(``shm_stamps``) that let a same-host reader validate a remembered extent without asking the node. Capacity
and fragmentation accounting only ever see ``[0, capacity)``.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import gc
import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

from kvpool.kvstore.errors import BadRequestError, CapacityExceededError, ObjectTooLargeError
from kvpool.kvstore.protocol.shm_stamps import StampReader, StampTable, default_slots, segment_size

ALIGN = 64
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Python 3.11 lacks the constants
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


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
    def free_extents(self) -> int:
        return len(self._free_off)

    @property
    def fragmentation(self) -> float:
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free


class SharedPool:
    """Owner side: creates the named segment, hands out extents, exposes a memoryview; ``close`` unlinks.

    ``stamp_slots``: how many objects can carry a generation stamp at once (default
    ``shm_stamps.default_slots(capacity)``; 0 = no stamp fast path for readers).
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
            _release(self.buf, self._shm)
        except BufferError:
            gc.collect()
            with contextlib.suppress(BufferError):
                _release(self.buf, self._shm)
        self._shm = None


def _release(buf: memoryview, shm: shared_memory.SharedMemory) -> None:
    buf.release()
    shm.close()


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach to a node's pool as a reader; this process's resource_tracker must not unlink it at exit."""
    shm = shared_memory.SharedMemory(name=name, create=False)
    with contextlib.suppress(Exception):  # tracker absent or already unregistered: nothing to undo
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


class ReaderMapping:
    """A reader's view of a node's segment that maps pages in bulk the first time an extent is used.

    Touching a not-yet-mapped page of a shared segment costs a page-fault trap per 4 KiB: a 4 MB copy into
    fresh pages took 3.4 ms against 0.22 ms into mapped ones. One ``madvise(MADV_POPULATE_WRITE)`` over the
    extent maps it in 1.25 ms, and a per-2-MiB bitmap means each region pays that once per reader process
    (populating already-mapped pages still costs a walk, 0.27 ms per 4 MB, so it is not repeated).
    Kernels without MADV_POPULATE (< 5.14) simply fault as before.
    """

    CHUNK = 2 << 20
    BACKGROUND_STEP = 16 << 20  # per madvise call of the background mapper

    def __init__(self, name: str, background: bool = False) -> None:
        self.name = name
        self.shm = attach_segment(name)
        self.buf: memoryview = self.shm.buf
        self.stamps = StampReader.open(self.buf)  # None: the node keeps no stamps (no fast path)
        self._fd: int = self.shm._fd  # type: ignore[attr-defined]
        self._closed = False
        self._mapped = bytearray(-(-len(self.buf) // self.CHUNK))
        self._supported = True
        self._stop = threading.Event()
        self._mapper: threading.Thread | None = None
        if background:
            self._start_mapper()

    def _start_mapper(self) -> None:
        """Map the whole segment in a background thread, so that puts into fresh extents do not pay the
        1.25 ms per 4 MB ``prepare`` on the request path (measured: a fresh-region 4 MB shm put 3.1 ms,
        most of it that madvise). libc's madvise is called through ctypes, which releases the GIL
        (``mmap.madvise`` holds it), so the event loop keeps running; ``prepare`` stays correct for
        regions the mapper has not reached yet. Costs page tables (~2 MiB per GiB of pool) in this process.
        """
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            anchor = ctypes.c_char.from_buffer(self.buf)
            base = ctypes.addressof(anchor)
            del anchor  # no lasting export of the buffer: close() must be able to release it
        except (OSError, AttributeError, TypeError, ValueError):
            return
        total = len(self.buf)
        per = max(1, self.BACKGROUND_STEP // self.CHUNK)

        def run() -> None:
            for first in range(0, len(self._mapped), per):
                if self._stop.is_set():
                    return
                last = min(first + per, len(self._mapped))
                if all(self._mapped[first:last]):
                    continue
                start = first * self.CHUNK
                length = min(last * self.CHUNK, total) - start
                if madvise(base + start, length, MADV_POPULATE_WRITE) != 0:
                    return  # kernel without MADV_POPULATE: prepare() falls back to faulting
                self._mapped[first:last] = b"\x01" * (last - first)

        self._mapper = threading.Thread(target=run, name="kvpool-shm-mapper", daemon=True)
        self._mapper.start()

    def prepare(self, offset: int, size: int) -> None:
        if not self._supported or size <= 0:
            return
        first, last = offset // self.CHUNK, (offset + size - 1) // self.CHUNK
        if all(self._mapped[first : last + 1]):
            return
        start = first * self.CHUNK
        length = min((last + 1) * self.CHUNK, len(self.buf)) - start
        try:
            self.shm._mmap.madvise(MADV_POPULATE_WRITE, start, length)  # type: ignore[union-attr]
        except (OSError, ValueError, AttributeError):
            self._supported = False
            return
        self._mapped[first : last + 1] = b"\x01" * (last + 1 - first)

    def unlinked(self) -> bool:
        """True once the node removed the segment (stopped or killed): its stamps no longer mean anything.
        One ``fstat`` (~0.5 µs); a closed mapping counts as gone."""
        if self._closed:
            return True
        try:
            return os.fstat(self._fd).st_nlink == 0
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self._mapper is not None:
            self._mapper.join(5.0)  # at most one madvise step (~10 ms) is in flight
        if self.stamps is not None:
            self.stamps.close()
        with contextlib.suppress(BufferError):  # a caller still holds a slice: the mapping goes with it
            _release(self.buf, self.shm)
