"""The compiled hash-id chains (``workloads/id_chains.pyx``) against their definition in plain Python, and
its SHA-256 (``workloads/sha256.h``: the CPU's SHA extensions where it has them, and the portable rounds)
against hashlib."""

from __future__ import annotations

import hashlib
import pickle
import random

import pytest
from kvpool.workloads.chains import ChainBuilder
from kvpool.workloads.id_chains import TRACE_ROOT, TenantIds, sha256_digest
from kvpool.workloads.trace import Request


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
    for bad in (b"short", bytearray(32), None):
        with pytest.raises(ValueError, match="32 bytes"):
            TenantIds(bad)


def test_the_simulators_chains_are_the_ones_it_always_had_and_tenants_never_share_one() -> None:
    """Pinned: the hashes the simulator gave a Mooncake request before the chains were compiled (623f09f),
    one tenant's chain differing from another's for the same ids."""
    builder = ChainBuilder("k3", 512)
    last = {}
    for tenant in ("acme", ""):
        req = Request(request_id=tenant, arrival_ms=0, input_length=1536, output_length=1, hash_ids=[7, 8, 9])
        req.tenant = tenant
        last[tenant] = builder.chain(req).hashes[-1].hex()
    assert last == {
        "acme": "2953069c2befbc355418409a19c0a89325a118d829202d3163ad38e3c1c3e595",
        "": "fc049d2fe955d619fecd778dc7c63f535ffd47e848d41b274d9c2d014d349b1b",
    }


def test_a_memo_pickles_whole_and_initialises_empty_or_refuses_to_run() -> None:
    """A sweep's workers on other hosts get the memo by pickle; a memo made again is empty; one never
    initialised (``__new__`` alone) refuses to chain instead of reading a root it does not have."""
    memo = TenantIds(bytes(32))
    first = memo.chain([3, 1, 4, 1, 5])
    copy = pickle.loads(pickle.dumps(memo))
    assert len(copy) == len(memo) == 4
    assert copy.chain([3, 1, 4, 1, 5]) == first and len(copy) == 4  # every id found, none hashed again
    memo.__init__(bytes(32))
    assert len(memo) == 0 and memo.chain([3, 1]) == first[:2]
    with pytest.raises(ValueError, match="no root"):
        TenantIds.__new__(TenantIds).chain([1])


def test_an_id_that_empties_its_own_list_is_an_index_error_not_a_crash() -> None:
    class Shrinking:
        def __init__(self, ids: list[object]) -> None:
            self.ids = ids

        def __index__(self) -> int:
            self.ids.clear()
            return 5

    ids: list[object] = [1, 2]
    ids += [Shrinking(ids), 9]
    with pytest.raises(IndexError):
        TenantIds(bytes(32)).chain(ids)
