"""The compiled prefix index against its oracle: the plain-Python index it replaced (tests/oracle).

Hypothesis drives both with the same random operation sequences (puts one by one and as chains, two-phase
puts, matches with and without touch, lookups, leases, pins and sessions, removals, node loss and return,
quotas, the object cap, TTLs as the clock moves, promotions, watermark passes) under every policy, with bad
inputs mixed in, and requires the same answers, the same typed errors, the same removals and demotions, the
same stats after every step and a clean recount (``verify``) at the end. Slots are compared too: the core
allocates them as the oracle does, so eviction's tie-break by slot is the same.

SELF_PARENT: no object names itself as its parent here. Both indexes accept it and agree on every answer,
but count the object as waiting for itself and as its own dependent at once, which ``verify`` reports.
"""

from __future__ import annotations

import hashlib
from dataclasses import astuple
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import ObjectKind
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG, TAIL_TAG

from tests.oracle.prefix_index import SLOT_LIVE
from tests.oracle.prefix_index import PrefixIndex as OraclePrefixIndex

HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(10)]
NODES = ["a", "b", "c"]
TENANTS = ["", "t1"]
SESSIONS = ["", "s1", "s2"]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _key(kind: int, i: int) -> bytes:
    if kind == ObjectKind.MLA:
        return MLA_TAG + HASHES[i]
    if kind == ObjectKind.KDA:
        return KDA_TAG + HASHES[i]
    return TAIL_TAG + b"req-%d" % i if kind == ObjectKind.TAIL else b"blob-%d" % i


keys = st.builds(_key, st.sampled_from([1, 1, 1, 2, 2, 3, 4]), st.integers(0, 9))
bad_keys = st.sampled_from([b"", b"x" * 1025, MLA_TAG + b"short", KDA_TAG + HASHES[0][:31]])
sizes = st.integers(1, 9)
nodes = st.sampled_from([None, *NODES, "ghost"])
ops = st.one_of(
    st.tuples(
        st.just("insert"),
        st.sampled_from([1, 1, 1, 2, 2, 3, 4]),  # the kind
        st.integers(0, 9),  # its key's index
        st.sampled_from([None] * 12 + [1, 2, 3, 9]),  # mostly the key's own kind; else a mismatch
        st.sampled_from([None] * 12 + [b"", b"x" * 1025, MLA_TAG + b"short"]),  # mostly a good key
        st.one_of(sizes, sizes, sizes, st.sampled_from([0, -1])),
        nodes,
        st.sampled_from([1, 1, 1, 2]),
        st.sampled_from(TENANTS),
        st.one_of(st.just(b""), keys),
        st.sampled_from([0, 0, 0, 500, 5000, -1]),  # TTL (a tail gets 500 ms when 0)
        st.booleans(),  # pending
        st.sampled_from([True, True, True, False]),  # evict
        st.booleans(),  # admit
        st.sampled_from([0, 0, 0, 7, 1 << 64]),  # checksum
    ),
    st.tuples(
        st.just("chain"),
        st.lists(st.tuples(st.integers(0, 9), st.booleans(), sizes, st.booleans()), min_size=1, max_size=6),
        st.sampled_from(["a", "a", "b", "c", None]),  # None: each object placed by free space
        st.sampled_from(TENANTS),
        st.sampled_from([None] * 10 + ["short", "not-bytes", "size-0", "lengths", "checkpoint-0", "past"]),
    ),
    st.tuples(st.just("commit"), st.one_of(keys, bad_keys), st.sampled_from([None, None, 5, 0])),
    st.tuples(
        st.just("match"),
        st.lists(st.integers(0, 9), max_size=8),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.sampled_from([0, 0, 0, 1, 2]),  # 1: a hash of the wrong length in the chain, 2: not bytes
    ),
    st.tuples(st.just("lookup"), st.lists(keys, max_size=4), st.booleans()),
    st.tuples(st.just("get"), keys),
    st.tuples(st.just("put_again"), keys),
    st.tuples(st.just("rows"), st.lists(keys, max_size=4)),
    st.tuples(st.just("acquire"), st.lists(keys, max_size=4), st.sampled_from([None, 200, 3000])),
    st.tuples(st.just("release"), st.integers(0, 6)),
    st.tuples(
        st.just("pin"),
        st.lists(keys, max_size=4),
        st.sampled_from([0, 300, 60_000]),
        st.sampled_from(SESSIONS),
    ),
    st.tuples(st.just("end_session"), st.sampled_from(TENANTS), st.sampled_from(SESSIONS)),
    st.tuples(st.just("remove"), keys),
    st.tuples(st.just("remove_node"), st.sampled_from([*NODES, "ghost"])),
    st.tuples(
        st.just("add_node"),
        st.sampled_from([*NODES, ""]),
        st.sampled_from([0, 12, 20, 40, -1]),
        st.sampled_from([0, 0, 30]),
    ),
    st.tuples(st.just("quota"), st.sampled_from(TENANTS), st.sampled_from([0, 8, 15, 30, -1])),
    st.tuples(st.just("promote"), keys),
    st.tuples(st.just("tick"), st.sampled_from([0.001, 0.1, 0.4, 2.0, 70.0])),
    st.tuples(st.just("expire")),
    st.tuples(st.just("evict")),
    st.tuples(st.just("drain")),
    st.tuples(st.just("scores"), st.lists(keys, max_size=3)),
)


def _apply(idx: Any, op: tuple, leases: list[int]) -> Any:
    """Run one operation; the answer in a comparable form (slots included)."""
    name = op[0]
    if name == "insert":
        _, kind, i, declared, bad, size, node, tier, tenant, parent, ttl, pending, evict, admit, cksum = op
        key = _key(kind, i) if bad is None else bad
        if kind == ObjectKind.TAIL and ttl == 0:
            ttl = 500
        kind = kind if declared is None else declared
        parent = b"" if parent == key else parent  # SELF_PARENT
        return idx.insert(
            key, kind, size, node_id=node, tier=tier, tenant=tenant, parent=parent, ttl_ms=ttl,
            pending=pending, evict=evict, admit=admit, checksum=cksum,
        )  # fmt: skip
    if name == "chain":
        _, items, node, tenant, bad = op
        hashes: list[Any] = [HASHES[h] for h, _, _, _ in items]
        chain_sizes: list[Any] = [size for _, _, size, _ in items]
        admits = [admit for _, _, _, admit in items]
        checkpoints = [(i + 1, size + 3, admit) for i, (_, ckpt, size, admit) in enumerate(items) if ckpt]
        if bad == "short":
            hashes[-1] = hashes[-1][:31]
        elif bad == "not-bytes":
            hashes[0] = 7
        elif bad == "size-0":
            chain_sizes[-1] = 0
        elif bad == "lengths":
            admits.append(True)
        elif bad is not None:
            checkpoints.append((0 if bad == "checkpoint-0" else len(items) + 1, 4, True))
        return idx.insert_chain(hashes, chain_sizes, admits, checkpoints, node_id=node, tenant=tenant)
    if name == "commit":
        return idx.commit(op[1], op[2])
    if name == "match":
        _, hs, require, touch, resume, bad = op
        hashes = [HASHES[i] for i in hs]
        if bad:  # raised only if the walk reaches it
            hashes.insert(len(hashes) // 2, b"short" if bad % 2 else 7)
        m = idx.match_prefix(hashes, require_checkpoint=require, touch=touch, resume=resume)
        return (*astuple(m), m.slots)
    if name == "lookup":
        return idx.lookup(op[1], touch=op[2])
    if name == "get":
        return idx.get(op[1])
    if name == "put_again":
        return idx.put_again(op[1])
    if name == "rows":
        return idx.rows(op[1])
    if name == "acquire":
        lease = idx.acquire(op[1], op[2])
        if lease is not None:
            leases.append(lease.lease_id)
        return lease
    if name == "release":
        return idx.release(leases[op[1]] if op[1] < len(leases) else 999)
    if name == "pin":
        return idx.pin(op[1], op[2], session=op[3])
    if name == "end_session":
        return idx.end_session(op[1], op[2])
    if name == "remove":
        return idx.remove(op[1])
    if name == "remove_node":
        return idx.remove_node(op[1])
    if name == "add_node":
        return idx.add_node(op[1], op[2], op[3])
    if name == "quota":
        return idx.set_quota(op[1], op[2])
    if name == "promote":
        return idx.promote(op[1])
    if name == "expire":
        return idx.expire()
    if name == "evict":
        return idx.evict()
    if name == "drain":
        return idx.drain_events()
    if name == "scores":
        return idx.eviction_scores([k for k in op[1] if k in idx])
    raise AssertionError(name)


def _outcome(idx: Any, op: tuple, leases: list[int]) -> tuple[str, Any]:
    try:
        return "ok", _apply(idx, op, leases)
    except Exception as exc:  # the very point: the same typed error on both sides
        return "error", type(exc).__name__


def _state(idx: Any) -> tuple:
    usage = {}
    for n in NODES:
        try:
            usage[n] = idx.node_usage(n)
        except Exception as exc:
            usage[n] = type(exc).__name__
    # verify(): the same recount (a node whose capacity was cut below what it holds reports so on both
    # sides until a pass brings it down), and the core's own structures (key entries, waiting counts, the
    # LRU order) clean, after every step
    # the default policy's class of each indexed object: the core decides it in C (``_class_of_put``), the
    # oracle in HybridPolicy.on_insert
    klass, flags = getattr(idx.policy, "_klass", None), idx._cols.flags
    live = None if klass is None else np.flatnonzero(flags[: min(len(klass), len(flags))] & SLOT_LIVE)
    classes = None if klass is None else list(zip(live.tolist(), klass[live].tolist(), strict=True))
    return (idx.stats(), usage, sorted(idx), sorted(idx.pending_keys()), len(idx), idx.verify(), classes)


def _pair(policy: str, max_objects: int) -> tuple[Any, Any, Clock]:
    clock = Clock()
    made = []
    for cls in (PrefixIndex, OraclePrefixIndex):
        admission = AdmissionConfig() if policy == "lru+admission" else None
        idx = cls(
            policy.split("+")[0], clock=clock, lease_ms=1000, max_objects=max_objects, admission=admission,
            high_watermark=0.9, low_watermark=0.7,
        )  # fmt: skip
        idx.add_node("a", 30)
        idx.add_node("b", 20, 30)
        made.append(idx)
    return made[0], made[1], clock


@pytest.mark.parametrize("policy", ["lru", "lfu", "cost", "depth", "hybrid", "lru+admission"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(ops, min_size=1, max_size=70), max_objects=st.sampled_from([0, 0, 9]))
def test_the_core_answers_as_the_oracle(policy: str, program: list[tuple], max_objects: int) -> None:
    core, oracle, clock = _pair(policy, max_objects)
    core_leases: list[int] = []
    oracle_leases: list[int] = []
    for step, op in enumerate(program):
        note(f"{step}: {op}")
        if op[0] == "tick":
            clock.t += op[1]
            continue
        got = _outcome(core, op, core_leases)
        want = _outcome(oracle, op, oracle_leases)
        assert got == want, f"step {step}: {op}"
        assert _state(core) == _state(oracle), f"after step {step}: {op}"
    assert core.drain_events() == oracle.drain_events()
