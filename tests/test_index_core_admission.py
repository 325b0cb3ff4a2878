"""The compiled admission control (``kvstore/index/admission.pyx`` over ``admission.h``) against its oracle,
the plain-Python admission it replaced (tests/oracle/admission.py).

The index's differential and trace-equality tests run the oracle index on the oracle admission, so they
hold the compiled one to its answers through the index; here Hypothesis drives the two directly with
random refusals, evictions, writers' lookups over ghost runs, and puts with and without tickets as the
clock moves past their lapse, and requires the same rate, counts, ghosts in LRU order and tickets after
every step (a small ghost bound makes them forget).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from kvpool.kvstore.index.admission import Admission, AdmissionConfig
from kvpool.kvstore.keys import MLA_TAG

from tests.oracle.admission import Admission as OracleAdmission

HASHES = [hashlib.sha256(b"admission-%d" % i).digest() for i in range(12)]


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


ops = st.one_of(
    st.tuples(st.just("remember"), st.integers(0, 11), st.integers(1, 50), st.booleans()),
    st.tuples(st.just("evicted"), st.integers(0, 11), st.integers(1, 50), st.booleans()),
    st.tuples(st.just("lookup"), st.integers(0, 8), st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.just("admit"), st.integers(0, 11), st.integers(1, 50), st.sampled_from([None, 0, 3, 7])),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 0.6, 2.0])),
    st.tuples(st.just("floor"), st.sampled_from([0.0, 0.5, 1.0])),
)
CAPACITY = 200


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=60), st.sampled_from([0.0, 0.3, 1.0]))
def test_the_compiled_admission_answers_as_its_oracle(steps: list[tuple], initial: float) -> None:
    _drive(steps, initial, note)


@pytest.mark.parametrize("seed", range(6))
def test_long_random_walks_answer_as_the_oracle(seed: int) -> None:
    """Hypothesis prefers short sequences; a ticket's verdict against its lapse needs a lookup, a tick and
    a put of one of its hashes in that order, which long seeded walks hit many times each."""
    rng = random.Random(seed)
    steps: list[tuple] = []
    for _ in range(3000):
        r = rng.random()
        if r < 0.15:
            steps.append(("remember", rng.randrange(12), rng.randint(1, 50), rng.random() < 0.5))
        elif r < 0.3:
            steps.append(("evicted", rng.randrange(12), rng.randint(1, 50), rng.random() < 0.5))
        elif r < 0.5:
            steps.append(("lookup", rng.randrange(9), rng.randint(0, 4), rng.randint(0, 4)))
        elif r < 0.85:
            steps.append(("admit", rng.randrange(12), rng.randint(1, 50), rng.choice([None, 0, 3, 7])))
        elif r < 0.97:
            steps.append(("tick", rng.choice([0.1, 0.6, 2.0])))
        else:
            steps.append(("floor", rng.choice([0.0, 0.5, 1.0])))
    trail: list[str] = []
    try:
        _drive(steps, (0.0, 0.3, 1.0)[seed % 3], trail.append)
    except AssertionError:
        raise AssertionError("after the steps:\n" + "\n".join(trail[-12:])) from None


def _drive(steps: list[tuple], initial: float, log: Callable[[str], object]) -> None:
    config = AdmissionConfig(initial_rate=initial, min_rate=0.0, step=0.5, ghost_entries=6, ticket_ms=1000)
    clock = Clock()
    a, o = Admission(config, clock), OracleAdmission(config, clock)
    cached = {HASHES[3]}  # the parent block the index holds (``find``)

    def find(key: bytes) -> int | None:
        return 1 if key[1:] in cached else None

    for op in steps:
        log(repr(op))
        name = op[0]
        if name == "remember":
            _, i, size, refused = op
            a.remember(HASHES[i], size, refused=refused)
            o.remember(HASHES[i], size, refused=refused)
        elif name == "evicted":
            _, i, size, unread = op
            a.evicted(HASHES[i], size, CAPACITY, unread=unread)
            o.evicted(HASHES[i], size, CAPACITY, unread=unread)
        elif name == "lookup":
            _, first, n, run = op
            chain = HASHES[first : first + n]
            a.on_lookup(chain, min(run, len(chain)), CAPACITY)
            o.on_lookup(chain, min(run, len(chain)), CAPACITY)
        elif name == "admit":
            _, i, size, parent = op
            hangs_on = b"" if parent is None else MLA_TAG + HASHES[parent]
            assert a.admit(HASHES[i], size, hangs_on, find) == o.admit(HASHES[i], size, hangs_on, find)
        elif name == "tick":
            clock.t += op[1]
        else:
            a.floor = o.floor = op[1]
        assert (a.rate, a.refused, a.admitted) == (o.rate, o.refused, o.admitted)
        assert a.ghosts() == list(o._ghost.items())
        assert a.tickets() == o._tickets


def test_bad_hashes_and_settings_are_value_errors() -> None:
    a = Admission(AdmissionConfig(), Clock())
    with pytest.raises(ValueError, match="32 bytes"):
        a.remember(b"short", 5, refused=True)
    with pytest.raises(ValueError, match="32 bytes"):
        a.on_lookup([HASHES[0], b"short"], 0, 100)
    with pytest.raises(ValueError, match=">= 0"):
        a.on_lookup(HASHES[:2], -1, 100)
    assert a.ghosts() == [] and a.tickets() == {} and not a.was_refused(b"short")
    with pytest.raises(ValueError, match="min_rate"):
        Admission(AdmissionConfig(initial_rate=0.1, min_rate=0.5), Clock())
