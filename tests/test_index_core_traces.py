"""The simulator on the compiled index counts exactly what it counted on the oracle (the plain-Python index).

Every online policy of ``bench/policy_bench.py`` (and the labels yardstick, an SSD tier, client hints) on
the bundled Mooncake traces and a generated mix, at a capacity that evicts: the whole result (integer hit
counts, bytes, evictions, demotions, refusals, per-workload and per-tenant counters, hint tallies) must be
equal. The traces are cut to their first requests here to keep the suite short; ``bench/index_core_bench.py
--equality`` runs the bench's whole grid (every trace, policy and capacity) the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
from kvpool.workloads import sim
from kvpool.workloads.generators import generate_mix
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

from tests.oracle.prefix_index import PrefixIndex as OraclePrefixIndex

GiB = 2**30


def _both(monkeypatch: pytest.MonkeyPatch, reqs: list[Request], cfg: SimConfig) -> tuple[Any, Any]:
    core = simulate(reqs, cfg).to_dict()
    with monkeypatch.context() as m:
        m.setattr(sim, "PrefixIndex", OraclePrefixIndex)
        oracle = simulate(reqs, cfg).to_dict()
    return core, oracle


@pytest.fixture(scope="module")
def traces() -> dict[str, list[Request]]:
    mix = {"chat": 0.4, "agent": 0.2, "coding": 0.2, "rag": 0.2}
    return {
        "conversation": read_mooncake(bundled_trace("conversation"))[:1500],
        "synthetic": read_mooncake(bundled_trace("synthetic"))[:800],
        "mix": generate_mix(mix, requests=500, rate=4.0, seed=7, tenants=4),
    }


@pytest.mark.parametrize(
    ("trace", "policy", "ssd", "hints"),
    [
        ("conversation", "lru", 0, False),
        ("conversation", "hybrid", 0, False),
        ("conversation", "lfu", 0, False),
        ("conversation", "cost", 0, False),
        ("conversation", "depth", 0, False),
        ("conversation", "labels", 0, False),
        ("conversation", "hybrid", 4, False),
        ("synthetic", "lru", 4, False),
        ("synthetic", "hybrid", 0, False),
        ("mix", "hybrid", 0, True),
        ("mix", "lru", 0, True),
    ],
)
def test_the_simulator_counts_the_same_on_the_core(
    monkeypatch: pytest.MonkeyPatch,
    traces: dict[str, list[Request]],
    trace: str,
    policy: str,
    ssd: int,
    hints: bool,
) -> None:
    cap = 29 * GiB
    cfg = SimConfig(spec=get_spec("k3"), policy=policy, capacity=cap, ssd_capacity=ssd * cap, hints=hints)
    core, oracle = _both(monkeypatch, traces[trace], cfg)
    evicting = core["objects_evicted"] > 0 or core.get("demotions", 0) > 0
    assert evicting, "the point must evict to prove anything"
    assert core == oracle


def test_pure_mla_lru_evicting_to_fit_counts_the_same(
    monkeypatch: pytest.MonkeyPatch, traces: dict[str, list[Request]]
) -> None:
    """The issue's first measurement: pure-MLA LRU at a block capacity with both watermarks at 1.0."""
    cfg = SimConfig(
        spec=get_spec("k3", pure_mla=True), policy="lru", capacity=3000, capacity_unit="blocks",
        high_watermark=1.0, low_watermark=1.0,
    )  # fmt: skip
    core, oracle = _both(monkeypatch, traces["conversation"], cfg)
    assert core["objects_evicted"] > 0
    assert core == oracle
