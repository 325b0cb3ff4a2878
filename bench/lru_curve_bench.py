"""The one-pass LRU curve against one ``simulate()`` per capacity, and ``kvpool report`` sequential against
its process pool, on the bundled Mooncake conversation trace (issue #42, parts 2 and 4).

1. Pure-MLA K3 LRU with evict-to-fit watermarks (1.0 / 1.0, the configuration that takes the fast path) at
   ``--points`` capacities in blocks, geometric from the largest request to every distinct block: the
   one pass (``workloads/lru_curve.py``) once, then each capacity simulated (in a pool of ``--jobs``
   processes; the summed per-point seconds are what one core pays). Every point's integer counts must
   agree, else the bench exits 1.
2. ``kvpool report`` (``build_report``) on ``--report-limit`` requests of each bundled trace, with
   ``jobs=1`` (before: one point after another) and with the default pool; the CSV files must agree.

    .venv/bin/python bench/lru_curve_bench.py                   # table, then one JSON line
    .venv/bin/python bench/lru_curve_bench.py --limit 3000 --report-limit 1000   # quicker
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.workloads.lru_curve import lru_curve
from kvpool.workloads.parallel import default_jobs, run_points
from kvpool.workloads.report import build_report
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.sweep import auto_capacities, unique_blocks
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

MLA = get_spec("k3", pure_mla=True)
FIELDS = ("hit_blocks", "usable_blocks", "mla_hit_tokens", "cached_tokens", "mla_bytes_written",
          "bytes_evicted", "objects_evicted", "bytes_held")  # fmt: skip


def _config(capacity: int | None = None) -> SimConfig:
    return SimConfig(spec=MLA, policy="lru", capacity=capacity, capacity_unit="blocks", high_watermark=1.0,
                     low_watermark=1.0)  # fmt: skip


def _simulate_point(reqs: list[Request], cap: int) -> dict[str, Any]:
    d = simulate(reqs, _config(cap)).to_dict()
    return {k: d[k] for k in (*FIELDS, "token_hit_rate", "block_hit_rate")}


def curve_vs_points(reqs: list[Request], points: int, jobs: int) -> dict[str, Any]:
    biggest = max(len(r.hash_ids or ()) for r in reqs)
    caps = auto_capacities(unique_blocks(reqs, MLA, 512), points, biggest)
    t = time.perf_counter()
    curve, fallback = lru_curve(reqs, _config(), caps, 512)
    one_pass_s = time.perf_counter() - t
    per_point_s: list[float] = [0.0] * len(caps)

    def done(i: int, _: dict[str, Any], seconds: float) -> None:
        per_point_s[i] = seconds

    t = time.perf_counter()
    sims = run_points(_simulate_point, reqs, caps, jobs, done)
    wall = time.perf_counter() - t
    rows = []
    for cap, sim, secs in zip(caps, sims, per_point_s, strict=True):
        got = curve[cap].to_dict() if cap in curve else None
        rows.append({
            "capacity_blocks": cap,
            "token_hit_rate": round(sim["token_hit_rate"], 6),
            "block_hit_rate": round(sim["block_hit_rate"], 6),
            "simulate_s": round(secs, 2),
            "one_pass": got is not None,
            "equal": got is not None and all(got[k] == sim[k] for k in FIELDS),
        })  # fmt: skip
    return {
        "requests": len(reqs),
        "capacities": len(caps),
        "one_pass_s": round(one_pass_s, 2),
        "per_point_cpu_s": round(sum(per_point_s), 1),
        "per_point_wall_s": round(wall, 1),
        "per_point_jobs": jobs,
        "speedup_vs_one_core": round(sum(per_point_s) / one_pass_s, 1),
        "fallback": fallback,
        "all_equal": all(r["equal"] for r in rows),
        "rows": rows,
    }


def report_before_after(limit: int | None, jobs: int) -> dict[str, Any]:
    times = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-report-bench-") as tmp:
        for name, j in (("sequential", 1), ("pool", jobs)):
            out = Path(tmp) / name / "report.html"
            t = time.perf_counter()
            build_report(["conversation", "synthetic"], out, limit=limit, show_points=False, jobs=j)
            times[name] = round(time.perf_counter() - t, 1)
        csvs = sorted(p.name for p in (Path(tmp) / "sequential").glob("*.csv"))
        same = all(
            filecmp.cmp(Path(tmp) / "sequential" / c, Path(tmp) / "pool" / c, shallow=False) for c in csvs
        )
    return {"limit": limit, "jobs": jobs, "sequential_s": times["sequential"], "pool_s": times["pool"],
            "csv_files": len(csvs), "same_csv": same}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, help="first N requests of the conversation trace (default all)")
    ap.add_argument("--points", type=int, default=20, help="capacities of the curve (default 20)")
    ap.add_argument("--jobs", type=int, default=default_jobs(), help="processes for the per-point runs")
    ap.add_argument("--report-limit", type=int, default=0, help="requests per trace for the report part "
                    "(0: whole traces, the report's defaults; -1: skip the report part)")  # fmt: skip
    args = ap.parse_args(argv)
    reqs = sorted(read_mooncake(bundled_trace("conversation")), key=lambda r: r.arrival_ms)
    if args.limit:
        reqs = reqs[: args.limit]
    curve = curve_vs_points(reqs, args.points, args.jobs)
    print(f"{'capacity':>10}{'token hit':>11}{'block hit':>11}{'simulate s':>12}  one pass")
    for r in curve["rows"]:
        verdict = "equal" if r["equal"] else "simulated" if not r["one_pass"] else "DIFFERS"
        print(f"{r['capacity_blocks']:>10}{r['token_hit_rate']:>11.4f}{r['block_hit_rate']:>11.4f}"
              f"{r['simulate_s']:>12.2f}  {verdict}")  # fmt: skip
    print(
        f"one pass {curve['one_pass_s']} s; per point {curve['per_point_cpu_s']} s on one core "
        f"({curve['per_point_wall_s']} s wall on {args.jobs} processes): x{curve['speedup_vs_one_core']}"
    )
    report = None
    if args.report_limit >= 0:
        report = report_before_after(args.report_limit or None, args.jobs)
        print(
            f"kvpool report (limit {report['limit']}): {report['sequential_s']} s one after another, "
            f"{report['pool_s']} s on {args.jobs} processes; CSV identical: {report['same_csv']}"
        )
    load = round(os.getloadavg()[0], 2)
    print(json.dumps({"bench": "lru_curve_bench", "trace": "conversation", "cpus": os.cpu_count(),
                      "loadavg_1m": load, "curve": curve, "report": report}))  # fmt: skip
    ok = curve["all_equal"] or all(r["equal"] or not r["one_pass"] for r in curve["rows"])
    return 0 if ok and (report is None or report["same_csv"]) else 1


if __name__ == "__main__":
    sys.exit(main())
