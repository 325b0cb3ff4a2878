"""Shared-memory pool and extent allocator."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from multiprocessing import shared_memory

import pytest
from kvpool.kvstore.errors import CapacityExceededError, ObjectTooLargeError
from kvpool.kvstore.node.pool import ALIGN, Extent, ExtentAllocator, SharedPool


def test_best_fit_and_coalescing():
    a = ExtentAllocator(10 * ALIGN)
    x, y, z = a.allocate(ALIGN), a.allocate(3 * ALIGN), a.allocate(ALIGN)
    assert (x.offset, y.offset, z.offset) == (0, ALIGN, 4 * ALIGN)
    a.free(y)  # hole of 3 at 64, tail of 5 at 320
    assert a.fragmentation == pytest.approx(1 - 5 / 8)
    assert a.allocate(2 * ALIGN).offset == ALIGN  # best fit: the 3-hole, not the 5-tail
    a.free(Extent(ALIGN, 2 * ALIGN))
    a.free(x)
    a.free(z)  # everything coalesces back into one extent
    assert a.free_bytes == 10 * ALIGN and a.fragmentation == 0.0


def test_sizes_round_to_alignment_and_errors_are_typed():
    a = ExtentAllocator(4 * ALIGN)
    e = a.allocate(1)
    assert a.used_bytes == ALIGN and e.size == 1
    assert a.allocate(0) == Extent(0, 0)  # empty objects take no space
    with pytest.raises(ObjectTooLargeError):
        a.allocate(5 * ALIGN)
    a.allocate(3 * ALIGN)
    with pytest.raises(CapacityExceededError):
        a.allocate(1)
    with pytest.raises(ValueError):
        a.free(Extent(ALIGN * 2, 10))  # not an allocated extent


def test_random_churn_keeps_invariants():
    rng = random.Random(3)
    a = ExtentAllocator(1 << 20)
    live: list[Extent] = []
    for _ in range(5000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(a.allocate(rng.randint(1, 20_000)))
            except CapacityExceededError:
                a.free(live.pop(0))
        spans = sorted((e.offset, -(-e.size // ALIGN) * ALIGN) for e in live if e.size)
        assert all(o1 + s1 <= o2 for (o1, s1), (o2, _s2) in itertools.pairwise(spans))  # no overlap
        assert a.used_bytes == sum(s for _o, s in spans)
        assert 0.0 <= a.fragmentation < 1.0
    for e in live:
        a.free(e)
    assert a.fragmentation == 0.0 and a.used_bytes == 0


READER = """
import sys
from multiprocessing import shared_memory
from kvpool.kvstore.protocol.shm_segment import attach_segment
name, offset, plain = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "plain"
shm = shared_memory.SharedMemory(name=name) if plain else attach_segment(name)
sys.stdout.write(bytes(shm.buf[offset : offset + 5]).decode())
shm.close()
"""


def _read_in_other_process(name: str, offset: int, plain: bool = False) -> str:
    out = subprocess.run(
        [sys.executable, "-c", READER, name, str(offset), "plain" if plain else "attach"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def test_reader_process_exit_does_not_unlink_the_pool():
    """Python 3.11's resource_tracker would unlink a segment its process merely attached to."""
    pool = SharedPool(1 << 20)
    try:
        e = pool.allocator.allocate(5)
        pool.view(e)[:] = b"hello"
        assert _read_in_other_process(pool.name, e.offset) == "hello"
        probe = shared_memory.SharedMemory(name=pool.name)  # still there
        probe.close()
        from multiprocessing import resource_tracker

        resource_tracker.unregister(f"/{pool.name}", "shared_memory")
    finally:
        pool.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=pool.name)


def test_plain_attach_in_another_process_would_unlink_it():
    """The control for the test above: without ``attach_segment`` the reader's exit destroys the pool."""
    pool = SharedPool(1 << 16)
    try:
        e = pool.allocator.allocate(5)
        pool.view(e)[:] = b"hello"
        assert _read_in_other_process(pool.name, e.offset, plain=True) == "hello"
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=pool.name)
    finally:
        pool.close()  # tolerates the segment being gone already


def test_reader_mapping_maps_regions_once():
    from kvpool.kvstore.protocol.shm_segment import ReaderMapping

    pool = SharedPool(16 << 20)
    try:
        m = ReaderMapping(pool.name)
        m.prepare(100, 5 << 20)  # touches 2 MiB chunks 0, 1 and 2
        assert list(m.mapped[:4]) == ([1, 1, 1, 0] if m.populate_supported else [0, 0, 0, 0])
        m.buf[100:105] = b"hello"
        assert bytes(pool.buf[100:105]) == b"hello"  # same memory as the owner's
        m.close()
    finally:
        pool.close()
