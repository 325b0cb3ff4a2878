"""The offline hybrid references count checkpoint bytes: on small random traces, the bound is at least the
exhaustive best schedule, which is at least the feasible reference; on the shipped trace the reference beats
LRU and the bound caps every online policy."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.offline import bound, reference, run_offline
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import ModelSpec, get_spec
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

BS = 512
# a checkpoint weighs as much as 2 MLA blocks: small enough that exhaustive search sees every trade-off
SMALL = ModelSpec("small", 1, 2 * BS, 1.0, BS, "test spec: checkpoint = 2 blocks")


@pytest.fixture(scope="module")
def conversation() -> list[Request]:
    return read_mooncake(bundled_trace("conversation"))


def _trace(rng: random.Random, n: int) -> list[Request]:
    """Requests whose id lists are root-to-node paths of a small random tree (ids are chained)."""
    paths: list[list[int]] = [[0]]
    next_id = 1
    reqs = []
    for i in range(n):
        path = list(rng.choice(paths)[: rng.randint(1, 3)])
        while len(path) < rng.randint(2, 4) or (len(path) < 4 and rng.random() < 0.3):
            path.append(next_id)
            next_id += 1
        paths.append(path)
        # one token past the last full block: every id block is full and a lookup may use all of them
        reqs.append(Request(f"r{i}", float(i), len(path) * BS + 1, 1, hash_ids=[*path, 10_000 + i]))
    return reqs


def _exhaustive_best(reqs: list[Request], capacity_blocks: int) -> int:
    """Max cached tokens over every feasible schedule: after each request the cache may hold any subset of
    what it held plus what the request could write (its MLA blocks, checkpoints at the boundaries it
    computed), within capacity; a hit needs MLA blocks [0, p) and a checkpoint at p."""
    chains = [tuple(r.hash_ids or ()) for r in reqs]
    ck = SMALL.kda_bytes_per_checkpoint // BS  # checkpoint size in blocks

    def size(state: frozenset) -> int:
        return sum(ck if kind == "K" else 1 for kind, _ in state)

    @functools.cache
    def best(i: int, state: frozenset) -> int:
        if i == len(chains):
            return 0
        ids = chains[i]
        cap = len(ids) - 1  # the partial last block holds the last prompt token
        run = 0
        while run < cap and ("M", ids[run]) in state:
            run += 1
        usable = run
        while usable and ("K", ids[usable - 1]) not in state:
            usable -= 1
        writable = {("M", h) for h in ids[:cap]} | {("K", ids[q - 1]) for q in range(usable + 1, cap + 1)}
        pool = sorted(state | writable)
        assert len(pool) <= 14, "trace too large for exhaustive search"
        options = []
        for mask in range(1 << len(pool)):
            chosen = frozenset(pool[j] for j in range(len(pool)) if mask >> j & 1)
            if size(chosen) <= capacity_blocks:
                options.append(chosen)
        return usable * BS + max(best(i + 1, o) for o in options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_bound_is_at_least_the_exhaustive_best_which_is_at_least_the_reference(seed: int) -> None:
    reqs = _trace(random.Random(seed), 4)
    for blocks in (2, 3, 4, 5):
        cap = blocks * BS
        exact = _exhaustive_best(reqs, blocks)
        ref = reference(reqs, cap, SMALL).total.cached_tokens
        up = bound(reqs, cap, SMALL).total.cached_tokens
        assert up >= exact >= ref, (seed, blocks, up, exact, ref)


def test_with_room_for_less_than_one_checkpoint_nothing_hits() -> None:
    reqs = _trace(random.Random(1), 6)
    assert bound(reqs, SMALL.kda_bytes_per_checkpoint - 1, SMALL).total.cached_tokens == 0
    assert reference(reqs, SMALL.kda_bytes_per_checkpoint - 1, SMALL).total.cached_tokens == 0


def test_unbounded_reference_reaches_the_unbounded_bound_on_a_tree() -> None:
    """With room for everything, offline placement puts a checkpoint wherever a later request stops
    sharing, so every shareable block hits: the reference meets the bound."""
    reqs = _trace(random.Random(3), 12)
    assert reference(reqs, None, SMALL).total.cached_tokens == bound(reqs, None, SMALL).total.cached_tokens


def test_on_the_conversation_trace_the_reference_beats_lru_and_the_bound_caps_every_policy(
    conversation: list[Request],
) -> None:
    reqs = conversation[:3000]
    k3 = get_spec("k3")
    cap = 89 * 2**30
    ref = reference(reqs, cap, k3).total.to_dict()["token_hit_rate"]
    up = bound(reqs, cap, k3).total.to_dict()["token_hit_rate"]
    online = {
        p: simulate(reqs, SimConfig(spec=k3, policy=p, capacity=cap)).to_dict()["token_hit_rate"]
        for p in ("lru", "lfu", "cost")
    }
    assert ref > 1.2 * online["lru"]
    assert all(up >= hit for hit in [ref, *online.values()])


def test_an_unknown_offline_policy_names_the_valid_ones() -> None:
    with pytest.raises(ReplayError, match="reference"):
        run_offline("belady", [], None, SMALL)


def test_replay_runs_the_reference_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvpool.commands.main import main

    args = ["replay", "conversation", "--limit", "400", "--policy", "reference", "--capacity-bytes", "89GiB"]
    assert main([*args, "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "reference" and out["config"]["capacity"] == 89 * 2**30
    assert 0 < out["token_hit_rate"] <= 1


def test_an_ssd_tier_under_dram_demotes_on_eviction_and_promotes_on_hit(conversation: list[Request]) -> None:
    reqs = conversation[:2000]
    k3 = get_spec("k3")
    dram = simulate(reqs, SimConfig(spec=k3, capacity=29 * 2**30)).to_dict()
    tiered = simulate(reqs, SimConfig(spec=k3, capacity=29 * 2**30, ssd_capacity=2 * 2**40)).to_dict()
    assert dram["ssd_token_hit_rate"] == 0 and dram["objects_demoted"] == 0
    assert tiered["objects_demoted"] > 0 and tiered["ssd_bytes_read"] > 0
    assert tiered["token_hit_rate"] > dram["token_hit_rate"]
    by_tier = tiered["dram_token_hit_rate"] + tiered["ssd_token_hit_rate"]
    assert by_tier == pytest.approx(tiered["token_hit_rate"])


def test_an_ssd_tier_without_a_dram_capacity_in_bytes_is_a_clear_error() -> None:
    with pytest.raises(ReplayError, match="needs a DRAM capacity in bytes"):
        SimConfig(spec=get_spec("k3"), capacity=100, capacity_unit="blocks", ssd_capacity=1).check()


def test_a_sweep_reports_each_point_with_an_eta_even_off_a_terminal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvpool.commands.main import main

    args = [
        "replay",
        "conversation",
        "--limit",
        "300",
        "--policy",
        "lru,bound",
        "--capacity-bytes",
        "29GiB,89GiB",
    ]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == ["[1/4", "[2/4", "[3/4", "[4/4"]
    assert all("ETA" in line for line in lines)
    # points run side by side (--jobs): each is reported once as it finishes, in whatever order
    labels = [line.split("] ", 1)[1].split(":")[0] for line in lines]  # "lru (...) @ 29.0 GiB"
    points = sorted(f"{label.split()[0]} @ {label.split(' @ ')[1]}" for label in labels)
    assert points == ["bound @ 29.0 GiB", "bound @ 89.0 GiB", "lru @ 29.0 GiB", "lru @ 89.0 GiB"], lines
    assert main([*args, "--out-dir", str(tmp_path), "--no-progress"]) == 0
    assert "[1/4]" not in capsys.readouterr().err
