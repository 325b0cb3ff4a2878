"""The default policy's return-time model and its recency guard: what is learned from reads and ghosts,
how (class, age) ranks, and when the policy falls back towards LRU order."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool.kvstore.index.eviction import HybridPolicy
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.recency_guard import RecencyGuard
from kvpool.kvstore.index.records import ObjectKind
from kvpool.kvstore.index.return_time import (
    BEYOND,
    BINS,
    CLASSES,
    HINT,
    READ,
    ReturnTimeModel,
    hinted_class,
    request_class,
)
from kvpool.kvstore.keys import kda_key, mla_key

from tests.harness.chains import chain
from tests.harness.clock import Clock

MLA, KDA = ObjectKind.MLA, ObjectKind.KDA


def rates(m: ReturnTimeModel, cls: int, ages: list[float]) -> list[float]:
    m.rebuild(10_000.0, np.zeros(0, dtype=np.int64), np.zeros(0))
    return m.log_rates(np.full(len(ages), cls), np.array(ages)).tolist()


def test_a_class_that_returns_at_think_time_outranks_one_that_never_returns() -> None:
    m = ReturnTimeModel(prior=1.0)
    back, never = 0, 2
    for _ in range(50):
        m.observe(back, 60.0, returned=True)  # read again a minute after its last use
        m.observe(never, 3000.0, returned=False)  # gone unread for 50 minutes
    fresh_back, fresh_never = rates(m, back, [5.0])[0], rates(m, never, [5.0])[0]
    assert fresh_back > fresh_never + 5  # far more reads per second expected
    # overdue: past every observed return, a "returning" object is worth less than a fresh one
    young, overdue = rates(m, back, [5.0, 600.0])
    assert overdue < young - 5


def test_censoring_keeps_long_waits_from_looking_like_sure_returns() -> None:
    # 10 objects returned at 100 s; 90 more are still unread ghosts: P(read) must reflect the 90
    m = ReturnTimeModel(prior=1.0)
    for i in range(90):
        m.ghost(bytes([i]) * 32, 0, last_use=0.0, now=200.0)
    for _ in range(10):
        m.observe(0, 100.0, returned=True)
    censored = rates(m, 0, [1.0])[0]
    m2 = ReturnTimeModel(prior=1.0)
    for _ in range(10):
        m2.observe(0, 100.0, returned=True)
    assert censored < rates(m2, 0, [1.0])[0] - 2  # about 10x fewer reads expected


def test_a_ghost_on_the_lookup_path_is_a_return_and_forgotten_ghosts_are_censored() -> None:
    m = ReturnTimeModel(ghost_entries=2)
    hs = [bytes([i]) * 32 for i in range(4)]
    m.ghost(hs[1], 3, last_use=10.0, now=20.0)
    assert m.deepest_ghost(hs, 0) == 2 and m.deepest_ghost(hs, 2) == 0
    assert m.ghost_returned(hs[1], now=50.0) == 40.0
    assert m.observed == 1
    for i in range(3):  # bound of 2: the first of three is forgotten (censored)
        m.ghost(hs[i], 0, last_use=0.0, now=1.0)
    assert m.observed == 2


def test_request_classes_and_inheritance() -> None:
    assert request_class(0, 10) == 2 * 3  # new chain, 10 new blocks (bucket 8-15)
    assert request_class(9, 10, gap_s=60.0) % 2 == 1  # continuation
    assert request_class(9, 10, gap_s=5.0) != request_class(9, 10, gap_s=60.0)
    m = ReturnTimeModel()
    m.ticket([b"h" * 32], 5)
    assert m.class_of_put(b"h" * 32, None) == 5
    assert m.class_of_put(b"x" * 32, 5 + READ) == 5 + BEYOND  # a reply's block: its anchor's, beyond


def test_guard_falls_towards_recency_when_lru_would_serve_more_and_recovers() -> None:
    g = RecencyGuard(initial=1.0, step=0.5)
    hs = [bytes([i]) * 32 for i in range(4)]
    for h in hs:
        g.put(mla_key(h), 1, capacity=100)
    g.put(kda_key(hs[3]), 1, capacity=100)
    for _ in range(4):
        g.lookup(hs, ours=0)  # the shadow LRU serves 4 blocks, the real cache none
    assert g.w == 0.0 and g.shadow == 16
    g.lookup(hs, ours=4)
    assert g.w == 0.0  # a tie does not move it
    g.lookup([*hs, b"z" * 32], ours=5)  # the real cache serves more than the shadow could
    assert g.w > 0.0


def test_guard_evicts_its_shadow_by_recency_at_the_capacity() -> None:
    g = RecencyGuard(fill=1.0)
    hs = [bytes([i]) * 32 for i in range(3)]
    for h in hs:
        g.put(mla_key(h), 40, capacity=100)  # the third pushes the first out
    g.lookup(hs[:1], ours=0, joint=False)
    assert g.shadow == 0
    g.lookup(hs[1:], ours=0, joint=False)
    assert g.shadow == 2


def _index(cap: int) -> tuple[PrefixIndex, Clock, HybridPolicy]:
    clock = Clock(100.0)
    policy = HybridPolicy(min_observations=8)
    idx = PrefixIndex(policy, clock=clock, high_watermark=0.9, low_watermark=0.8)
    idx.add_node("n", cap)
    return idx, clock, policy


def _put(idx: PrefixIndex, hs: list[bytes]) -> None:
    parent = b""
    for h in hs:
        if mla_key(h) not in idx:
            idx.insert(mla_key(h), MLA, 1, node_id="n", parent=parent)
        parent = mla_key(h)
    if kda_key(hs[-1]) not in idx:
        idx.insert(kda_key(hs[-1]), KDA, 10, node_id="n")


def test_index_learns_that_continued_chains_return_and_keeps_them_over_newer_one_offs() -> None:
    idx, clock, policy = _index(cap=100_000)
    # training: conversations (short new part on a continued chain) come back 30 s later; one-off
    # prompts (many new blocks, never continued) do not
    for i in range(30):
        conv = chain(24, f"conv{i}")
        idx.match_prefix(conv[:20], touch=True)
        _put(idx, conv[:20])
        one = chain(20, f"one{i}")
        idx.match_prefix(one, touch=True)
        _put(idx, one)
        clock.t += 30.0
        idx.match_prefix(conv[:22], touch=True)  # the next turn reads the first checkpoint...
        _put(idx, conv[:22])
        clock.t += 30.0
        idx.match_prefix(conv, touch=True)  # ...and the one after reads the continuation's
        _put(idx, conv)
        clock.t += 1.0
    assert policy.model.observed >= 60
    # a continuation's checkpoint written 20 s ago against a one-off's written just now
    conv = chain(24, "conv-new")
    idx.match_prefix(conv[:20], touch=True)
    _put(idx, conv[:20])
    clock.t += 30.0
    idx.match_prefix(conv[:22], touch=True)
    _put(idx, conv[:22])
    clock.t += 20.0
    one = chain(22, "one-new")
    idx.match_prefix(one, touch=True)
    _put(idx, one)
    clock.t += 1.0
    cont_score, one_score = idx.eviction_scores([kda_key(conv[21]), kda_key(one[-1])])
    assert one_score < cont_score  # LRU would evict the continuation (older) first
    assert idx.verify() == []


def test_an_untrained_policy_ranks_by_recency() -> None:
    idx, clock, _ = _index(cap=100_000)
    a, b = chain(4, "a"), chain(8, "b")
    _put(idx, b)
    clock.t += 5
    _put(idx, a)
    clock.t += 1
    sa, sb = idx.eviction_scores([kda_key(a[-1]), kda_key(b[-1])])
    assert sb < sa  # older goes first, whatever its depth


@pytest.mark.parametrize("bad", [{"prior": 0.0}, {"ghost_entries": 0}])
def test_bad_model_settings(bad: dict) -> None:
    with pytest.raises(ValueError):
        ReturnTimeModel(**bad)


def test_admission_samples_new_chains_only_while_the_cache_beats_the_shadow_lru() -> None:
    policy = HybridPolicy()
    assert policy.admission_floor() == 1.0 - policy.guard.w  # nothing served yet: admission as learned
    hs = [bytes([i]) * 32 for i in range(2)]
    for h in hs:
        policy.guard.put(mla_key(h), 1, capacity=100)
    policy.guard.put(kda_key(hs[1]), 1, capacity=100)
    policy.guard.lookup(hs, ours=2)  # a tie with LRU: refusals would only cost hits
    assert policy.guard.lead == 1.0 and policy.admission_floor() == 1.0
    for _ in range(50):
        policy.guard.lookup([*hs, b"z" * 32], ours=3)  # the cache serves 1.5x what LRU would
    assert policy.guard.lead > 1.1 and policy.admission_floor() == pytest.approx(1.0 - policy.guard.w)


class _Cols:
    """Two checkpoints of 429 MiB as the policy reads them (the worked example of eviction.md §1.1)."""

    def __init__(self, now: float) -> None:
        self.last_use = np.array([now - 40.0, now - 5.0])
        self.freq = np.ones(2, dtype=np.float32)
        self.size = np.full(2, 429 << 20, dtype=np.uint64)
        self.depth = np.array([20, 30], dtype=np.uint16)
        self.kind = np.full(2, KDA, dtype=np.uint8)
        self.deps = np.zeros(2, dtype=np.uint32)
        self.flags = np.ones(2, dtype=np.uint8)


@pytest.mark.parametrize(("w", "first"), [(1.0, 1), (0.5, 1), (0.2, 0)])
def test_the_worked_example_of_the_design_note(w: float, first: int) -> None:
    policy = HybridPolicy(min_observations=0)
    policy._klass[:2] = (1, 8)  # A: continuation with <= 1 new block; B: new chain, 16+ new blocks
    rate = {1: np.log2(0.5 / 50.0), 8: np.log2(0.1 / 200.0)}
    policy.model.log_rates = lambda classes, ages: np.array([rate[int(c)] for c in classes])  # type: ignore
    policy.guard.w = w
    scores = policy.scores(_Cols(1000.0), np.array([0, 1]), 1000.0)
    expect_a = w * (np.log2(0.01) + 0.5 * np.log2(20) - np.log2(429 << 20)) + (1 - w) * -np.log2(40.0)
    assert scores[0] == pytest.approx(expect_a)
    assert int(np.argmin(scores)) == first


def test_a_clients_hint_classes_its_checkpoint_granted_or_refused_and_holds_through_reads() -> None:
    """A retention hint is evidence about the chain's return: the checkpoint it names takes the hinted
    class of its TTL tier whether the pin is granted or refused (pin budget 0), keeps it when a later turn
    reads it, and a put classed from it as its anchor (a reply's block) does not inherit it."""
    assert hinted_class(5, 300_000) == 5 + HINT and hinted_class(5 + HINT, 3_600_000) == 5 + 2 * HINT
    assert hinted_class(5 + 2 * HINT, 300_000) == 5 + HINT, "the latest hint is the client's current word"
    m = ReturnTimeModel()
    assert m.class_of_put(b"x" * 32, 5 + 2 * HINT) == 5 + BEYOND
    clock = Clock(100.0)
    policy = HybridPolicy(min_observations=8)
    idx = PrefixIndex(policy, clock=clock, pin_share=0.0)
    idx.add_node("n", 100_000)
    hs = chain(6, "conv")
    idx.match_prefix(hs[:4], touch=True)
    _put(idx, hs[:4])
    ck = kda_key(hs[3])
    slot = idx.match_prefix(hs[:4]).slots[-1]  # the checkpoint closing the match
    assert idx.match_prefix(hs[:4]).checkpoint_key == ck
    before = int(policy._klass[slot])
    assert before < HINT
    keys = [mla_key(h) for h in hs[:4]] + [ck]
    assert idx.pin(keys, 300_000, session="s") == 0 and idx.stats().pins_refused == 1
    assert int(policy._klass[slot]) == before + HINT, "a refused pin still tells when the chain returns"
    clock.t += 30.0
    assert idx.match_prefix(hs, touch=True).usable_blocks == 4  # the next turn reads it
    assert int(policy._klass[slot]) // HINT == 1, "the hint holds through the read"
    idx.pin(keys, 3_600_000, session="s")
    assert int(policy._klass[slot]) // HINT == 2
    granting = HybridPolicy(min_observations=8)
    granted = PrefixIndex(granting, clock=clock, pin_share=0.5)
    granted.add_node("n", 100_000)
    granted.match_prefix(hs[:4], touch=True)
    _put(granted, hs[:4])
    assert granted.pin(keys, 300_000, session="s") == 5, "within the budget: granted"
    granted_slot = granted.match_prefix(hs[:4]).slots[-1]
    assert int(granting._klass[granted_slot]) == before + HINT, "a granted pin's hint is evidence too"


@pytest.mark.parametrize("seen", [0, 1, 7, 60, CLASSES - 1, CLASSES])
def test_the_table_built_from_the_seen_classes_equals_every_class_computed_row_by_row(seen: int) -> None:
    """The rebuild computes the classes with observations and one empty class (copied to the others): the
    same floats, bit for bit, as the rates of every class computed in full."""
    rng = np.random.default_rng(seen)
    ends, events = np.zeros((CLASSES, BINS)), np.zeros((CLASSES, BINS))
    rows = rng.choice(CLASSES, size=seen, replace=False)
    ends[rows] = rng.integers(0, 30, size=(seen, BINS))
    events[rows] = np.minimum(ends[rows], rng.integers(0, 4, size=(seen, BINS)))
    if seen:  # a class with returns counted and no ends (the model never makes one; the table must not care)
        ends[rows[0]], events[rows[0], 3] = 0.0, 2.0
    m = ReturnTimeModel()
    assert m._build(ends, events).tobytes() == m._rates(ends, events).tobytes()
