"""The offline reference and bound at several capacities: one plan per point (before, issue #42 part 3)
against one plan per sweep (after), on the bundled Mooncake conversation trace, K3 hybrid, 512-token blocks.

The capacities are ``kvpool report``'s (``sweep_range`` + ``auto_capacities``, in full-block units). Both
ways run here, one after the other, in one process (``jobs=1``), so the timings share the machine's load;
CPU seconds (``time.process_time``) are reported beside wall. Every row of both ways must be equal, else the
bench exits 1.

    .venv/bin/python bench/offline_plan_bench.py               # 6 capacities, table then one JSON line
    .venv/bin/python bench/offline_plan_bench.py --points 3 --limit 4000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from kvpool.workloads.offline import OFFLINE_POLICIES, offline_plan, run_offline
from kvpool.workloads.specs import get_spec
from kvpool.workloads.sweep import auto_capacities, sweep_range
from kvpool.workloads.trace import bundled_trace, read_mooncake

K3 = get_spec("k3")
BS = 512


def _timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.monotonic(), time.process_time()
    out = fn()
    return out, time.monotonic() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=6)
    ap.add_argument("--limit", type=int, default=0, help="first N requests (0: all)")
    args = ap.parse_args(argv)
    reqs = read_mooncake(bundled_trace("conversation"))
    reqs = sorted(reqs, key=lambda r: r.arrival_ms)[: args.limit or None]
    lo, hi = sweep_range(reqs, K3, BS)
    caps = [c * K3.mla_bytes_per_token * BS for c in auto_capacities(hi, args.points, lo)]

    def per_point() -> list[dict[str, Any]]:
        return [run_offline(p, reqs, c, K3, BS).to_dict() for p in OFFLINE_POLICIES for c in caps]

    def per_sweep() -> tuple[list[dict[str, Any]], float]:
        start = time.monotonic()
        plan = offline_plan(reqs, K3, BS)
        built = time.monotonic() - start
        return [
            run_offline(p, reqs, c, K3, BS, plan=plan).to_dict() for p in OFFLINE_POLICIES for c in caps
        ], built

    before, b_wall, b_cpu = _timed(per_point)
    (after, plan_s), a_wall, a_cpu = _timed(per_sweep)
    equal = before == after
    out = {
        "trace": "conversation",
        "requests": len(reqs),
        "spec": K3.name,
        "capacities_bytes": caps,
        "points": len(before),
        "plan_per_point": {"wall_s": round(b_wall, 2), "cpu_s": round(b_cpu, 2)},
        "plan_per_sweep": {"wall_s": round(a_wall, 2), "cpu_s": round(a_cpu, 2), "plan_s": round(plan_s, 2)},
        "speedup_cpu": round(b_cpu / a_cpu, 2) if a_cpu else None,
        "rows_equal": equal,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"{len(reqs)} requests, {len(caps)} capacities x {list(OFFLINE_POLICIES)} = {len(before)} points")
    print(f"  plan per point : {b_wall:7.2f} s wall {b_cpu:7.2f} s CPU")
    print(f"  plan per sweep : {a_wall:7.2f} s wall {a_cpu:7.2f} s CPU (plan {plan_s:.2f} s, once)")
    print(f"  rows equal     : {equal}")
    print(json.dumps(out))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
