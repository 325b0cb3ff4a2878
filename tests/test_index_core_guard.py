"""The compiled recency guard (``kvstore/index/recency_guard.pyx`` over ``recency_guard.h``) against its
oracle, the plain-Python guard it replaced (tests/oracle/recency_guard.py).

Hypothesis drives both with the same random puts (MLA blocks and checkpoints of a few chains, sizes against
capacities that make the shadow trim) and writers' lookups (runs served, joint or not, held blocks and a
served checkpoint the shadow takes), and requires the same weight ``w``, ``lead``, tallies, held bytes and
shadow contents in LRU order after every step: the arithmetic is the oracle's, bit for bit. The default
policy's own tests (test_store_index_return_time.py) and the trace-equality test run on the compiled one.
"""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from kvpool.kvstore.index.recency_guard import RecencyGuard
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG

from tests.oracle.recency_guard import RecencyGuard as OracleGuard

HASHES = [hashlib.sha256(b"guard-%d" % i).digest() for i in range(12)]

puts = st.tuples(
    st.just("put"),
    st.sampled_from([MLA_TAG, MLA_TAG, KDA_TAG, b"T-a-longer-tail-key-"]),
    st.integers(0, 11),
    st.integers(1, 40),  # size
    st.sampled_from([0, 50, 120, 400]),  # the real cache's capacity (0: no node yet)
)
lookups = st.tuples(
    st.just("lookup"),
    st.integers(0, 8),  # first block of the chain looked up
    st.integers(0, 4),  # blocks looked up
    st.integers(0, 4),  # blocks the real cache served (clipped to the lookup)
    st.booleans(),  # joint
    st.integers(0, 4),  # blocks it holds (clipped)
    st.sampled_from([0, 0, 7]),  # its served checkpoint's size
    st.booleans(),  # the chain repeats its first block
)


def _same(g: RecencyGuard, o: OracleGuard) -> None:
    for name in ("w", "lead", "ours", "shadow"):
        a, b = getattr(g, name), getattr(o, name)
        assert a == b or (math.isnan(a) and math.isnan(b)), (name, a, b)
    assert g.held_bytes() == o._bytes
    assert g.keys() == list(o._lru.items())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(puts, lookups), max_size=60), st.sampled_from([0.0, 0.5, 1.0]))
def test_the_compiled_guard_answers_as_its_oracle(ops: list[tuple], initial: float) -> None:
    g, o = RecencyGuard(initial=initial, step=0.3, fill=0.9), OracleGuard(initial=initial, step=0.3, fill=0.9)
    for op in ops:
        note(repr(op))
        if op[0] == "put":
            _, tag, i, size, capacity = op
            g.put(tag + HASHES[i], size, capacity)
            o.put(tag + HASHES[i], size, capacity)
        else:
            _, first, n, ours, joint, held, ck, repeat = op
            chain = HASHES[first : first + n]
            if repeat and chain:
                chain.insert(1, chain[0])
            ours, held_sizes = min(ours, len(chain)), [5 + j for j in range(min(held, len(chain)))]
            g.lookup(chain, ours, joint, held_sizes, ck)
            o.lookup(chain, ours, joint, held_sizes, ck)
        _same(g, o)


def test_bad_lookups_and_parameters_are_value_errors_that_change_nothing() -> None:
    g = RecencyGuard()
    g.put(MLA_TAG + HASHES[0], 3, 100)
    before = (g.w, g.ours, g.shadow, g.keys())
    with pytest.raises(ValueError, match="cannot have served 2"):
        g.lookup(HASHES[:1], 2)  # served more blocks than it looked up
    with pytest.raises(ValueError, match="hold 3"):
        g.lookup(HASHES[:2], 0, True, [1, 1, 1])
    with pytest.raises(ValueError, match="32 bytes"):
        g.lookup([b"short"], 0)
    with pytest.raises(TypeError):
        g.lookup(["not bytes"], 0)
    assert (g.w, g.ours, g.shadow, g.keys()) == before
    with pytest.raises(ValueError, match="guard fill"):
        RecencyGuard(fill=1.5)
    with pytest.raises(ValueError, match="guard initial"):
        RecencyGuard(initial=math.nan)
