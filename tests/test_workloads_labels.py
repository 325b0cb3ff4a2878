"""The ``labels`` yardstick: the default policy told only whether each checkpoint will be read again."""

from __future__ import annotations

import pytest
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.generators import generate
from kvpool.workloads.labels import ReuseOracle
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request

K3 = get_spec("k3")


def _req(i: int, t_ms: float, ids: list[int]) -> Request:
    return Request(f"r{i}", t_ms, len(ids) * 512, 10, hash_ids=ids, workload="w")


def test_the_oracle_marks_the_deepest_block_an_earlier_request_computed() -> None:
    reqs = [_req(0, 0, [1, 2, 3]), _req(1, 1000, [1, 2, 3, 4, 5]), _req(2, 2000, [1, 9])]
    oracle = ReuseOracle(reqs, K3.name, 512)
    chains = [oracle_chain(r) for r in reqs]
    # request 1 looks up blocks [0, 4): the deepest seen before is block 3 (index 2) of request 0
    assert oracle.read_after(chains[0][2], 0.5) and not oracle.read_after(chains[0][2], 1.5)
    # request 2 (a 2-block prompt looks up 1 block) reads block 1 only; block 2 is passed, not read
    assert oracle.read_after(chains[0][0], 1.5) and not oracle.read_after(chains[0][1], 1.5)
    assert not oracle.read_after(chains[1][4], 0.0)  # nobody comes back to request 1's end


def oracle_chain(req: Request) -> list[bytes]:
    from kvpool.workloads.chains import ChainBuilder

    return ChainBuilder(K3.name, 512).chain(req).hashes


def test_labels_runs_like_the_default_and_knows_better_on_a_small_cache() -> None:
    reqs = generate("chat", 400, rate=4.0, seed=3, hints=False)  # the policies alone, no client pins
    cap = 6 * 2**30
    labels = simulate(reqs, SimConfig(spec=K3, policy="labels", capacity=cap)).to_dict()
    default = simulate(reqs, SimConfig(spec=K3, capacity=cap)).to_dict()
    assert labels["config"]["policy"] == "labels"
    assert labels["token_hit_rate"] >= default["token_hit_rate"] > 0


def test_labels_needs_the_requests_as_a_list() -> None:
    reqs = generate("chat", 20, rate=4.0, seed=3)
    with pytest.raises(ReplayError, match="reads the future"):
        simulate(iter(reqs), SimConfig(spec=K3, policy="labels", capacity=2**34))
