"""The compiled ``LruMap`` (``kvstore/index/lru_map.pyx`` over ``lru_keys.h``: the return-time model's
tickets) against the plain ``OrderedDict`` loop it replaced: set each key, move it to the newest end, forget
the oldest beyond the bound; keys repeat within a call and across calls. The index's class of a put, which
reads this map in C, is held to the oracle index's Python ``on_insert`` by the differential and
trace-equality tests."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.kvstore.index.lru_map import LruMap


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=8), st.integers(-3, 5)), max_size=25))
def test_the_map_answers_as_the_ordered_dict_loop(calls: list[tuple[list[int], int]]) -> None:
    m, plain = LruMap(6), OrderedDict()
    for ids, value in calls:
        keys = [bytes([i]) * (32 if i % 3 else 5) for i in ids]  # block hashes, and a shorter key
        m.set_newest(keys, value)
        for k in keys:
            plain[k] = value
            plain.move_to_end(k)
        while len(plain) > 6:
            plain.popitem(last=False)
        assert m.items() == list(plain.items()) and len(m) == len(plain)
        for i in range(10):
            k = bytes([i]) * (32 if i % 3 else 5)
            assert m.get(k) == plain.get(k)


def test_bad_keys_and_bounds_are_value_errors_and_odd_lookups_find_nothing() -> None:
    m = LruMap(2)
    with pytest.raises(ValueError, match=r"1\.\.1024 bytes"):
        m.set_newest([b"ok", b""], 1)
    with pytest.raises(ValueError, match=r"1\.\.1024 bytes"):
        m.set_newest([b"x" * 1025], 1)
    with pytest.raises(TypeError):
        m.set_newest(["not bytes"], 1)
    assert m.items() == [(b"ok", 1)]  # what came before the bad key stands
    assert m.get("ok") is None and m.get(b"") is None and m.get(b"x" * 2000, 7) == 7
    with pytest.raises(ValueError, match="at least one entry"):
        LruMap(0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_key_table_under_churn_answers_as_the_ordered_dict(seed: int) -> None:
    """The key table beneath the map (``key_table.h``) at a size where its buckets grow several times and
    every set past the bound deletes (backward shifts through runs whose homes are hashed again, 4-bit
    fingerprints that collide one time in 16): 40,000 sets over 12,000 keys of three lengths (inline,
    short, past the inline bytes) into a map of 3,000, every answer checked against the plain loop."""
    import random

    rng = random.Random(seed)
    universe = [rng.randbytes((33, 5, 40)[i % 3]) for i in range(12_000)]
    m, plain = LruMap(3000), OrderedDict()
    for step in range(40_000):
        key = universe[rng.randrange(len(universe))]
        m.set_newest([key], step)
        plain[key] = step
        plain.move_to_end(key)
        if len(plain) > 3000:
            plain.popitem(last=False)
        probe = universe[rng.randrange(len(universe))]
        assert m.get(probe) == plain.get(probe)
    assert m.items() == list(plain.items())
