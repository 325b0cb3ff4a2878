"""The offline schedules' backward pass (chains, next uses, stops) is built once per sweep and shared by
every capacity (and by the pool's forked workers): a multi-capacity offline sweep gives, row for row, what
one ``run_offline`` per capacity (each building its own plan) gives; a plan built for other arguments is
refused."""

from __future__ import annotations

import pytest
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads import offline
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.offline import offline_plan, run_offline
from kvpool.workloads.specs import get_spec
from kvpool.workloads.sweep import capacity_sweep
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

K3 = get_spec("k3")
GiB = 2**30
CAPS = [9 * GiB, 29 * GiB, 89 * GiB, 269 * GiB]


@pytest.fixture(scope="module")
def reqs() -> list[Request]:
    return sorted(read_mooncake(bundled_trace("conversation")), key=lambda r: r.arrival_ms)[:1500]


def _per_point(reqs: list[Request], policy: str, cap: int) -> dict:
    return run_offline(policy, reqs, cap, K3, 512).to_dict()


@pytest.mark.parametrize("jobs", [1, 2])
def test_an_offline_sweep_equals_one_run_per_capacity_and_builds_its_plan_once(
    reqs: list[Request], jobs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = {(p, c): _per_point(reqs, p, c) for p in ("reference", "bound") for c in CAPS}
    built: list[int] = []
    real = offline._plan

    def once(*a: object) -> object:  # a second build, here or in a forked worker, fails the sweep
        assert not built, "the offline plan was built twice"
        built.append(1)
        return real(*a)

    monkeypatch.setattr(offline, "_plan", once)
    rows = capacity_sweep(reqs, K3, CAPS, "bytes", ["reference", "bound"], CheckpointPolicy(), 512, jobs=jobs)
    assert len(built) == 1  # in this process, before any worker forks
    assert [(r["policy"], r["capacity_bytes"]) for r in rows] == list(expected)
    for row in rows:
        want = expected[(row["policy"], row["capacity_bytes"])]
        for k in ("block_hit_rate", "token_hit_rate", "cached_tokens", "input_tokens", "mla_bytes_written",
                  "kda_bytes_written", "checkpoints_written", "requests"):  # fmt: skip
            assert row[k] == want[k], (row["policy"], row["capacity_bytes"], k)


def test_one_plan_serves_every_capacity_with_identical_results(reqs: list[Request]) -> None:
    plan = offline_plan(reqs[:600], K3, 512)
    for policy in ("reference", "bound"):
        for cap in (*CAPS, None):
            shared = run_offline(policy, reqs[:600], cap, K3, 512, plan=plan).to_dict()
            assert shared == run_offline(policy, reqs[:600], cap, K3, 512).to_dict()


def test_a_plan_built_for_other_arguments_is_refused(reqs: list[Request]) -> None:
    plan = offline_plan(reqs[:100], K3, 512)
    with pytest.raises(ReplayError, match="offline plan built for"):
        run_offline("reference", reqs[:200], GiB, K3, 512, plan=plan)
    with pytest.raises(ReplayError, match="store_output"):
        run_offline("bound", reqs[:100], GiB, K3, 512, store_output=False, plan=plan)
