"""The compiled hash-id chains (``workloads/id_chains.pyx``) against their definition in plain Python, and
its SHA-256 (``workloads/sha256.h``: the CPU's SHA extensions where it has them, and the portable rounds)
against hashlib."""

from __future__ import annotations

import hashlib
import random

import pytest
from kvpool.workloads.id_chains import TRACE_ROOT, TenantIds, sha256_digest


def plain_chains(root: bytes, requests: list[list[int]]) -> list[list[bytes]]:
    """The definition: h_i = SHA-256(h_{i-1} || TRACE_ROOT || le64(id_i)) from the root, memoised per id."""
    memo: dict[int, bytes] = {}
    out = []
    for ids in requests:
        parent, hashes = root, []
        for hid in ids:
            h = memo.get(hid)
            if h is None:
                h = memo[hid] = hashlib.sha256(parent + TRACE_ROOT + hid.to_bytes(8, "little")).digest()
            hashes.append(h)
            parent = h
        out.append(hashes)
    return out


@pytest.mark.parametrize("portable", [False, True])
def test_sha256_equals_hashlib_at_every_padding_length(portable: bool) -> None:
    rng = random.Random(7)
    for n in [*range(0, 200), 447, 448, 1000, 4096, 100_003]:
        data = rng.randbytes(n)
        assert sha256_digest(data, portable) == hashlib.sha256(data).digest(), n


def test_chains_equal_the_plain_definition_with_repeats_and_shared_prefixes() -> None:
    rng = random.Random(3)
    root = hashlib.sha256(b"tenant").digest()
    requests, history = [], [rng.randrange(2**64) for _ in range(40)]
    for _ in range(300):
        k = rng.randrange(len(history) + 1)
        new = [rng.choice([rng.randrange(2**64), rng.randrange(50)]) for _ in range(rng.randrange(8))]
        ids = history[:k] + new
        if ids and rng.random() < 0.1:
            ids.append(ids[0])  # an id repeated within the request: its memoised hash
        requests.append(ids)
    memo = TenantIds(root)
    assert [memo.chain(ids) for ids in requests] == plain_chains(root, requests)
    assert len(memo) == len({i for ids in requests for i in ids})
    assert memo.chain([]) == []


@pytest.mark.parametrize(("bad", "error"), [(-1, OverflowError), (2**64, OverflowError), (1.0, TypeError)])
def test_an_id_out_of_range_is_int_to_bytes_error_and_is_not_memoised(bad: object, error: type) -> None:
    memo = TenantIds(bytes(32))
    with pytest.raises(error):
        memo.chain([5, bad])
    assert len(memo) == 1  # the id before it
    assert memo.chain([5, 6]) == plain_chains(bytes(32), [[5, 6]])[0]


def test_a_root_is_32_bytes() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        TenantIds(b"short")
