"""The node's shared-memory pool segment as both sides see it: which processes may share it (``host_id``), the
generation stamps in its tail (``StampTable`` on the node, ``StampReader`` in readers) and a reader's
attachment (``attach_segment``, ``ReaderMapping``). The node owns the segment (``kvpool.kvstore.node.pool``),
creates and unlinks it; a same-host reader only attaches and maps pages in bulk. Both sides live in the
store's shared protocol package so the client never imports the node process.

Generation stamps: a same-host reader copies a known object with no round trip.

Why: an shm get used to cost a LOCATE control frame (~0.1 ms) before a 0.13 ms copy of 4 MB. A reader that
has seen an object before already knows its extent; what it cannot know without asking is whether the object
is still there. The node answers that question in shared memory instead of on a socket.

Layout (tail of the node's pool segment, after the allocator's ``[0, capacity)``):

    [0, capacity) extents | pad to 4 KiB | slots × 32 B: generation u64, offset u64, size u64, checksum u64
    | 64-byte trailer: magic "KVPSTMP1", table offset u64, slot count u64, slot size u64, zeros

One slot per DRAM-resident object that got one. The node (``StampTable``, on its single asyncio loop) gives an
object a slot and a fresh generation from a node-wide counter the moment it becomes readable in DRAM (put
sealed or landed, promoted from SSD), and writes generation 0 into the slot the moment it stops being
readable (Delete, Demote, drop, corrupt replace) — before its extent can go back to the allocator, and even
when tcp/ucx readers defer that free. Generations are never reused within a segment (and a restarted node
has a new segment), so "slot holds generation G" means "the object that was given G is still readable".
Slots are bounded; an object without one (generation 0) is simply read the old way (LOCATE).

A reader (``StampReader``, any thread of any process on this host) that holds a hint (offset, size, slot, G
from a LOCATE / SEAL reply) does: load stamp == G → copy the extent → verify its xxh3 → load stamp == G again;
only then are the bytes returned.

Ordering argument (x86-64, TSO: stores become visible in program order, loads are not reordered with other
loads; every stamp access is one aligned 8-byte load or store, which x86 performs atomically — numpy scalar
get/set on an aligned uint64 element is a plain 8-byte move, never a byte loop like ``struct``):

* Publish: the payload is complete before the stamp is written (the node verified its checksum after it
  landed; for an shm put the client's copy happened before its SEAL frame reached the node). The node writes
  offset/size/checksum, then the generation. A reader that loads G therefore sees the finished payload.
* Retire: the node stores 0 into the slot, then frees the extent. Any later write into that extent (a new
  put, by the node or by another process told of the extent by a RESERVE reply sent after the free) comes
  after the clear in happens-before order. If one of the reader's copy loads saw such a write, the clear was
  already visible to it, and the reader's second stamp load — issued after every copy load — returns 0 or a
  newer generation, never G. So a second load of G proves the copy read only the object that was given G.
* A torn or stale hint can only fail these checks (stamp mismatch, checksum mismatch): the reader then
  drops the hint and asks the node (LOCATE), which is always correct.
* A node that dies keeps its last stamps in the reader's mapping: readers also refuse a segment that has
  been unlinked (``st_nlink == 0``), which a stopped or killed node's segment is.

Other architectures (weaker ordering) would need explicit fences around these accesses, which Python
cannot issue: there ``READS_TRUSTED`` is False and readers never use stamps (every shm get asks the node
with a LOCATE frame, which is correct everywhere).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import socket
import struct
import threading
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# whether this CPU's memory ordering makes the stamp protocol sound for readers (see above)
READS_TRUSTED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

SLOT_WORDS = 4  # generation, offset, size, checksum (u64 each)
SLOT_SIZE = SLOT_WORDS * 8
TRAILER = struct.Struct("<8sQQQ32x")  # magic, table offset, slots, slot size
TRAILER_SIZE = TRAILER.size  # 64
MAGIC = b"KVPSTMP1"
MAPPER_THREAD = "kvpool-shm-mapper"  # the thread a ReaderMapping maps an attached segment in
PAGE = 4096
BYTES_PER_SLOT = 4096  # default: one slot per 4 KiB of pool ...
EXTRA_SLOTS = 1024  # ... plus this many, so a pool of small objects still gets stamps


def default_slots(capacity: int) -> int:
    """Slot count when the node is not told: ``capacity // 4 KiB + 1024`` (32 B each, ~0.8 % of the pool)."""
    return capacity // BYTES_PER_SLOT + EXTRA_SLOTS


def table_offset(capacity: int) -> int:
    """Where the slots start: the first page boundary at or after the allocator's range."""
    return (capacity + PAGE - 1) // PAGE * PAGE


def segment_size(capacity: int, slots: int) -> int:
    """Bytes of a segment holding ``capacity`` bytes of extents and ``slots`` stamps (plus the trailer)."""
    return table_offset(capacity) + slots * SLOT_SIZE + TRAILER_SIZE


class StampTable:
    """Node side: hands out slots and generations, clears them. Single-threaded (the node's loop)."""

    def __init__(self, buf: memoryview, capacity: int, slots: int) -> None:
        if slots < 0:
            raise ValueError("slot count must be >= 0")
        self.offset = table_offset(capacity)
        self.slots = slots
        need = segment_size(capacity, slots)
        if len(buf) < need:
            raise ValueError(f"segment of {len(buf)} B cannot hold {slots} stamps after {capacity} B")
        # one word array over the whole table; a fresh segment is zero-filled, i.e. every slot empty
        self._words = np.frombuffer(buf, dtype=np.uint64, count=slots * SLOT_WORDS, offset=self.offset)
        TRAILER.pack_into(buf, len(buf) - TRAILER_SIZE, MAGIC, self.offset, slots, SLOT_SIZE)
        self._fresh = 0  # slots [fresh, slots) were never used; recycled ones wait in _free
        self._free: list[int] = []  # (memory grows with peak use, not with the slot count)
        self._next_generation = 1
        self.exhausted = 0  # objects that found no free slot (read via LOCATE)

    def stamp(self, offset: int, size: int, checksum: int) -> tuple[int, int]:
        """A slot and a fresh generation for an object that just became readable; ``(0, 0)`` when full."""
        if self._free:
            slot = self._free.pop()
        elif self._fresh < self.slots:
            slot = self._fresh
            self._fresh += 1
        else:
            self.exhausted += 1
            return 0, 0
        generation = self._next_generation
        self._next_generation += 1
        base = slot * SLOT_WORDS
        words = self._words
        words[base + 1] = offset
        words[base + 2] = size
        words[base + 3] = checksum
        words[base] = generation  # last: a reader that sees it sees the fields (and the payload) before it
        return slot, generation

    def clear(self, slot: int, generation: int) -> None:
        """Retire ``generation`` (no-op for 0): readers stop trusting the slot before the extent is freed."""
        if generation == 0:
            return
        base = slot * SLOT_WORDS
        if int(self._words[base]) != generation:
            raise ValueError(f"slot {slot} holds generation {int(self._words[base])}, not {generation}")
        self._words[base] = 0
        self._free.append(slot)

    def clear_all(self) -> None:
        """Shutdown: no reader may trust a stamp of a segment that is about to go away."""
        self._words[::SLOT_WORDS] = 0

    def close(self) -> None:
        """Drop the array over the segment so the pool's mapping can be released."""
        self._words = np.zeros(0, dtype=np.uint64)


class StampReader:
    """Reader side over a mapped segment; ``None`` from ``open`` when the segment carries no stamp table."""

    def __init__(self, words: np.ndarray, slots: int) -> None:
        self._words = words
        self.slots = slots

    @classmethod
    def open(cls, buf: memoryview) -> StampReader | None:
        if len(buf) < TRAILER_SIZE:
            return None
        magic, offset, slots, slot_size = TRAILER.unpack_from(buf, len(buf) - TRAILER_SIZE)
        if magic != MAGIC or slot_size != SLOT_SIZE or offset % 8 or offset + slots * SLOT_SIZE > len(buf):
            return None
        words = np.frombuffer(buf, dtype=np.uint64, count=slots * SLOT_WORDS, offset=offset)
        return cls(words, slots)

    def generation(self, slot: int) -> int:
        """The slot's current generation: one aligned 8-byte load (0 = empty, or an unknown slot)."""
        if not 0 <= slot < self.slots:
            return 0
        return int(self._words[slot * SLOT_WORDS])

    def fields(self, slot: int) -> tuple[int, int, int]:
        """(offset, size, checksum) as the node wrote them; only meaningful between two equal generations."""
        base = slot * SLOT_WORDS
        offset, size, checksum = self._words[base + 1 : base + SLOT_WORDS].tolist()
        return offset, size, checksum

    def close(self) -> None:
        self._words = np.zeros(0, dtype=np.uint64)
        self.slots = 0


def host_id() -> str:
    """Hostname + kernel boot id + network namespace: equal values mean the same machine, so shared memory
    is reachable. The namespace is part of it because a namespace stands for a host (``kvpool up --netns``
    builds a multi-host cluster on one box): two processes in different namespaces must talk over the
    network, as they would across machines, never through /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "noboot"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "nonetns"
    return f"{socket.gethostname()}/{boot}/{netns}"


def release_view(buf: memoryview, shm: shared_memory.SharedMemory) -> None:
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
        self.mapped = bytearray(-(-len(self.buf) // self.CHUNK))  # per CHUNK: 1 = populated
        self.populate_supported = True  # False: this kernel lacks MADV_POPULATE (pages fault in)
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
            for first in range(0, len(self.mapped), per):
                if self._stop.is_set():
                    return
                last = min(first + per, len(self.mapped))
                if all(self.mapped[first:last]):
                    continue
                start = first * self.CHUNK
                length = min(last * self.CHUNK, total) - start
                if madvise(base + start, length, MADV_POPULATE_WRITE) != 0:
                    return  # kernel without MADV_POPULATE: prepare() falls back to faulting
                self.mapped[first:last] = b"\x01" * (last - first)

        self._mapper = threading.Thread(target=run, name=MAPPER_THREAD, daemon=True)
        self._mapper.start()

    def prepare(self, offset: int, size: int) -> None:
        if not self.populate_supported or size <= 0:
            return
        first, last = offset // self.CHUNK, (offset + size - 1) // self.CHUNK
        if all(self.mapped[first : last + 1]):
            return
        start = first * self.CHUNK
        length = min((last + 1) * self.CHUNK, len(self.buf)) - start
        try:
            self.shm._mmap.madvise(MADV_POPULATE_WRITE, start, length)  # type: ignore[union-attr]
        except (OSError, ValueError, AttributeError):
            self.populate_supported = False
            return
        self.mapped[first : last + 1] = b"\x01" * (last + 1 - first)

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
            release_view(self.buf, self.shm)
