"""The compiled index on inputs the differential test does not draw: numbers past 64 bits, keys that are not
bytes, a parent longer than any key, a node added with an impossible capacity, a policy swapped after the
index was built. Each gets the oracle's answer where the oracle has one, a typed error where the core
refuses on purpose (docs/design/index_core.md §3), and never a crash or a corrupted count.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from kvpool.kvstore.index.eviction import make_policy
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import (
    PUT_NO_ROOM,
    BadObjectError,
    CapacityError,
    ObjectKind,
    QuotaExceededError,
    UnknownNodeError,
)
from kvpool.kvstore.keys import MLA_TAG

from tests.oracle.prefix_index import PrefixIndex as OraclePrefixIndex

MLA, BLOB = ObjectKind.MLA, ObjectKind.BLOB


def _m(i: int) -> bytes:
    return MLA_TAG + hashlib.sha256(bytes([i])).digest()


class Clock:
    t = 10.0

    def __call__(self) -> float:
        return self.t


def _both() -> list[PrefixIndex]:
    out = []
    for cls in (PrefixIndex, OraclePrefixIndex):
        idx = cls(clock=Clock())
        idx.add_node("a", 1000)
        out.append(idx)
    return out


def test_a_capacity_past_63_bits_is_refused_before_the_node_exists() -> None:
    idx = PrefixIndex(clock=Clock())
    with pytest.raises(BadObjectError):
        idx.add_node("a", 100, 2**63)
    with pytest.raises(BadObjectError):
        idx.add_node("a", np.uint64(2**63))
    with pytest.raises(UnknownNodeError):  # no half-added node: the next put finds no node, it does not crash
        idx.insert(_m(0), MLA, 5, node_id="a")
    idx.add_node("a", 100)
    assert idx.insert(_m(0), MLA, 5, node_id="a") == "a" and idx.verify() == []


def test_a_parent_longer_than_any_key_is_refused_and_counts_stay_exact() -> None:
    idx = PrefixIndex(clock=Clock())
    idx.add_node("a", 1000)
    idx.insert(_m(0), MLA, 5)
    with pytest.raises(BadObjectError, match="parent"):
        idx.insert(b"blob-1", BLOB, 5, parent=b"x" * 1025)
    assert idx.verify() == [] and len(idx) == 1 and idx.get(_m(0)).dependents == 0
    assert idx.remove_node("a") and len(idx) == 0


def test_sizes_kinds_ttls_and_quotas_past_63_bits_answer_as_the_oracle() -> None:
    for idx in _both():
        with pytest.raises(CapacityError):
            idx.insert(b"big", BLOB, 2**63, node_id="a")
        assert idx.insert_chain([_m(0)[1:]], [2**63], [True], node_id="a") == [-PUT_NO_ROOM]
        with pytest.raises(BadObjectError):
            idx.insert_chain([_m(0)[1:]], [5], [True], [(1, 2**40 + 0.5, True)], node_id="a")
        assert idx.insert(b"forever", BLOB, 5, node_id="a", ttl_ms=2**63) == "a"
        idx.set_quota("t", 2**63)
        assert idx.insert(b"quota'd", BLOB, 5, node_id="a", tenant="t") == "a"
        idx.set_quota("t", 100)
        with pytest.raises(QuotaExceededError):
            idx.insert(b"too-big", BLOB, 2**64 - 1, node_id="a", tenant="t")
        assert idx.verify() == []


def test_keys_that_are_not_bytes_are_absent_and_cannot_be_put() -> None:
    core, oracle = _both()
    for idx in (core, oracle):
        idx.insert(bytes(5), BLOB, 5)
        assert idx.get(5) is None and idx.remove(5) is False and 5 not in idx
        assert idx.lookup([7]) == [None] and idx.rows([7]) == []
    assert core.get(bytearray(5)) is not None  # bytes-like keys are keys
    with pytest.raises(BadObjectError):
        core.insert("tail", ObjectKind.TAIL, 5, ttl_ms=100)


@pytest.mark.parametrize("bad", [np.zeros((32, 0), np.uint8), list(range(32)), 7])
def test_a_block_hash_that_is_not_bytes_is_a_type_error_when_reached(bad: object) -> None:
    core, _ = _both()
    core.insert(_m(0), MLA, 5)
    h0 = _m(0)[1:]
    with pytest.raises(TypeError):
        core.match_prefix([h0, bad], require_checkpoint=False)
    assert core.match_prefix([hashlib.sha256(b"absent").digest(), bad]).mla_run_blocks == 0  # a miss first


def test_a_policy_set_after_the_index_was_built_ranks_every_later_pass() -> None:
    """An index built as LRU keeps its pools' LRU orders; swapping the policy drops (or rebuilds) them, so
    the new policy's ranking is the one passes use, as on the oracle."""
    victims = []
    for cls in (PrefixIndex, OraclePrefixIndex):
        clock = Clock()
        idx = cls(clock=clock, high_watermark=0.9, low_watermark=0.5)
        idx.add_node("n", 100)
        idx.policy = make_policy("lfu", half_life_s=1000.0)
        idx.insert(b"hot", BLOB, 30)
        for _ in range(5):
            clock.t += 1
            idx.lookup([b"hot"], touch=True)
        clock.t += 1
        idx.insert(b"once", BLOB, 30)
        clock.t += 1
        idx.insert(b"third", BLOB, 35)
        victims.append([ev.key for ev in idx.drain_events()])
        idx.policy = make_policy("lru")
        clock.t += 1
        idx.insert(b"fourth", BLOB, 40)
        victims.append([ev.key for ev in idx.drain_events()])
        assert idx.verify() == []
    assert victims[:2] == victims[2:] and victims[0], victims


def test_a_chain_that_repeats_a_block_is_touched_once_and_counts_as_the_oracle() -> None:
    """A match over [h0, h0, h0] names slot 0 three times: the core's C touch counts one use per distinct
    slot, as the policy's numpy touch (the oracle's) does; a checkpoint count that is no integer, or one
    past any C integer, is a malformed chain on both sides."""
    for policy in ("lru", "depth", "hybrid"):
        got = []
        for cls in (PrefixIndex, OraclePrefixIndex):
            clock = Clock()
            idx = cls(policy, clock=clock)
            idx.add_node("a", 1000)
            h = [_m(i)[1:] for i in range(2)]
            assert min(idx.insert_chain(h, [3, 3], [True, True], [(1, 3, True)], node_id="a")) >= 0
            clock.t += 1.0
            idx.match_prefix([h[0]] * 3, require_checkpoint=False, touch=True)
            got.append((idx.get(_m(0)).freq, idx.get(_m(0)).last_use))
            for bad in (1.5, 2**70, -(2**70), "1"):
                with pytest.raises(BadObjectError):
                    idx.insert_chain(h, [3, 3], [True, True], [(bad, 3, True)], node_id="a")
        assert got[0] == got[1] == (2.0, 11.0), (policy, got)
