"""Cache policies for a hybrid model, side by side: token hit of every online policy, the ``labels``
yardstick and the offline references that count checkpoint bytes (``reference``: feasible; ``bound``:
provable upper bound), on every trace at every standard capacity, DRAM only and over an SSD tier of 4x DRAM.

Traces: the shipped Mooncake ``conversation`` and ``synthetic`` traces (``workloads/data``) and generated
ones: ``mix`` (chat, agent, coding, RAG), ``agent_loop`` (tool calls every 1-3 s over a long shared prefix)
and ``coding``; all at K3 spec (429 MiB per KDA checkpoint, 13.5 MiB per 512-token MLA block). A row
``<policy>+ssd4`` is that policy over an SSD tier of 4x the DRAM capacity (demote on eviction, promote on
hit). Goals (issue "hit rate, round two"): see ``GOALS``; they are DRAM-only. Client hints (retention,
session keys) are not modelled yet, so the "mix with hints" goal reads "not measured".

    .venv/bin/python bench/policy_bench.py            # every trace, policy and capacity; table + JSON line
    .venv/bin/python bench/policy_bench.py --quick    # conversation at 29 and 89 GiB: lru, hybrid, reference
    .venv/bin/python bench/policy_bench.py --traces conversation,coding --policies lru,hybrid --ssd ''
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool.kvstore.index.eviction import POLICIES
from kvpool.workloads.generators import generate, generate_mix
from kvpool.workloads.labels import YARDSTICKS
from kvpool.workloads.offline import OFFLINE_POLICIES, run_offline
from kvpool.workloads.progress import PointProgress
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

GiB = 2**30
CAPACITIES_GIB = (29, 89, 269, 815, 2458)
DEFAULT = "hybrid"  # the policy the master and the simulator use unless told otherwise
SSD_RATIO = 4
SSD = f"+ssd{SSD_RATIO}"
TRACES = ("conversation", "synthetic", "mix", "agent_loop", "coding")
GOALS = {
    "default_ge_0_995x_lru_everywhere": 0.995,
    "conversation_default_ge_1_5x_lru_at_29_89": 1.5,
    "conversation_default_ge_0_5x_reference_at_29_89": 0.5,
    "mix_with_hints_ge_0_85x_reference": 0.85,
    "sim_s_per_point_le": 10.0,
}


def load(name: str) -> list[Request]:
    """The requests of one bench trace (shipped, or generated with fixed seeds)."""
    if name in ("conversation", "synthetic"):
        return read_mooncake(bundled_trace(name))
    if name == "mix":
        mix = {"chat": 0.4, "agent": 0.2, "coding": 0.2, "rag": 0.2}
        return generate_mix(mix, requests=3000, rate=4.0, seed=7, tenants=4)
    if name == "agent_loop":
        return generate("agent_loop", 3000, rate=24.0, seed=7)
    if name == "coding":
        return generate("coding", 3000, rate=4.0, seed=7)
    raise SystemExit(f"unknown trace {name!r}; choose from {', '.join(TRACES)}")


def hit(reqs: list[Request], policy: str, capacity: int | None) -> tuple[float, float]:
    """(token hit rate, seconds) of one run at ``capacity`` bytes (None: unbounded)."""
    k3 = get_spec("k3")
    t0 = time.perf_counter()
    if policy in OFFLINE_POLICIES:
        d = run_offline(policy, reqs, capacity, k3).to_dict()
    elif policy.endswith(SSD):
        assert capacity is not None
        cfg = SimConfig(
            spec=k3, policy=policy[: -len(SSD)], capacity=capacity, ssd_capacity=SSD_RATIO * capacity
        )
        d = simulate(reqs, cfg).to_dict()
    else:
        d = simulate(reqs, SimConfig(spec=k3, policy=policy, capacity=capacity)).to_dict()
    return float(d["token_hit_rate"]), time.perf_counter() - t0


def goals_met(results: dict[str, Any], seconds: list[float]) -> dict[str, Any]:
    """Each goal of ``GOALS`` for the default policy: met or not, and the points that miss."""
    below_lru: list[str] = []
    conv_lru: list[str] = []
    conv_ref: list[str] = []
    for name, r in results.items():
        rows = r["token_hit"]
        if DEFAULT not in rows or "lru" not in rows:
            continue
        for cap, lru in rows["lru"].items():
            ours = rows[DEFAULT][cap]
            if ours < GOALS["default_ge_0_995x_lru_everywhere"] * lru:
                below_lru.append(f"{name}@{cap}: {ours / lru:.3f}x lru")
            if name == "conversation" and cap in ("29", "89"):
                if ours < GOALS["conversation_default_ge_1_5x_lru_at_29_89"] * lru:
                    conv_lru.append(f"@{cap}: {ours / lru:.2f}x lru")
                ref = rows.get("reference", {}).get(cap)
                if ref and ours < GOALS["conversation_default_ge_0_5x_reference_at_29_89"] * ref:
                    conv_ref.append(f"@{cap}: {ours / ref:.3f}x reference")
    compared = [n for n, r in results.items() if DEFAULT in r["token_hit"] and "lru" in r["token_hit"]]
    conv = results.get("conversation", {}).get("token_hit", {})

    def verdict(misses: list[str], measured: bool) -> dict[str, Any]:
        return {"met": (not misses) if measured else None, "misses": misses if measured else ["not measured"]}

    return {
        "default_ge_0_995x_lru_everywhere": verdict(below_lru, bool(compared)),
        "conversation_default_ge_1_5x_lru_at_29_89": verdict(conv_lru, "lru" in conv and DEFAULT in conv),
        "conversation_default_ge_0_5x_reference_at_29_89": verdict(
            conv_ref, "reference" in conv and DEFAULT in conv
        ),
        "mix_with_hints_ge_0_85x_reference": {
            "met": None,
            "misses": ["not measured: client hints not built"],
        },
        "sim_s_per_point_le": {
            "met": bool(seconds) and max(seconds) <= GOALS["sim_s_per_point_le"],
            "max_s": max(seconds, default=0.0),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="conversation at 29 and 89 GiB: lru, hybrid, reference"
    )
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    ap.add_argument(
        "--traces", default=",".join(TRACES), help="comma-separated subset of " + ", ".join(TRACES)
    )
    ap.add_argument(
        "--policies",
        default="",
        help="comma-separated (default: every online policy, labels, reference, bound)",
    )
    ap.add_argument(
        "--ssd", default=f"lru,{DEFAULT}", help="policies also run over a 4x SSD tier ('' for none)"
    )
    ap.add_argument("--caps", default=",".join(map(str, CAPACITIES_GIB)), help="DRAM capacities in GiB")
    args = ap.parse_args()
    if args.quick:
        names, policies, caps = ["conversation"], ["lru", DEFAULT, "reference"], [29, 89]
    else:
        names = [t for t in args.traces.split(",") if t]
        policies = [p for p in args.policies.split(",") if p] or [
            *sorted(POLICIES),
            *YARDSTICKS,
            *OFFLINE_POLICIES,
        ]
        policies += [p + SSD for p in args.ssd.split(",") if p]
        caps = [int(c) for c in args.caps.split(",") if c]
    results: dict[str, Any] = {}
    seconds: list[float] = []
    tally = PointProgress(len(names) * len(policies) * len(caps))  # one line per point on stderr, with ETA
    for name in names:
        reqs = load(name)
        rows: dict[str, dict[str, float]] = {}
        for policy in policies:
            rows[policy] = {}
            for cap in caps:
                tally.begin()
                rate, s = hit(reqs, policy, cap * GiB)
                tally.finished(f"{name} {policy} {rate:.2%}", cap * GiB)  # the figure too, as it comes
                rows[policy][str(cap)] = rate
                if name == "conversation" and policy == DEFAULT:
                    seconds.append(s)
        results[name] = {"token_hit": rows}
    ratios: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, r in results.items():
        rows = r["token_hit"]
        for base in ("lru", "reference"):
            if base in rows:
                ratios.setdefault(f"vs_{base}", {})[name] = {
                    c: (rows[DEFAULT][c] / rows[base][c] if rows[base][c] and DEFAULT in rows else None)
                    for c in rows[base]
                }
    if not args.json:
        for name, r in results.items():
            print(f"\n{name}")
            print(f"{'policy':<14}" + "".join(f"{str(c) + ' GiB':>12}" for c in caps))
            for p in policies:
                print(f"{p:<14}" + "".join(f"{r['token_hit'][p][str(c)]:>12.2%}" for c in caps))
        if seconds:
            print(
                f"\nsimulator seconds per conversation point ({DEFAULT}): max {max(seconds):.1f}, "
                f"mean {sum(seconds) / len(seconds):.1f}"
            )
        for goal, verdict in goals_met(results, seconds).items():
            met = {True: "met", False: "MISSED", None: "not measured"}[verdict["met"]]
            print(f"goal {goal}: {met} {verdict}")
    line = {
        "bench": "policy",
        "default_policy": DEFAULT,
        "token_hit": {n: r["token_hit"] for n, r in results.items()},
        "default_ratio": ratios,
        "sim_s_per_point_max": max(seconds, default=None),
        "goals": GOALS,
        "goals_met": goals_met(results, seconds),
        "loadavg": os.getloadavg()[0],
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
