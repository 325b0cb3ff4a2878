"""Sampled LRU curves (``--sample R``, workloads/sampled.py) against the exact one-pass curve: mean and max
absolute error of the token and block hit rates over a sweep, per salt, with the seconds of each.

Traces: generated ``chat`` (kvpool's own generator, ``--tenants`` tenants x 4 system prompts, no hints)
and the bundled Mooncake conversation trace; pure-MLA K3 LRU, evict-to-fit (1.0 / 1.0), capacities in
blocks geometric from 5 % of the distinct blocks to all of them.

    .venv/bin/python bench/sampled_curve_bench.py                        # table, then one JSON line
    .venv/bin/python bench/sampled_curve_bench.py --requests 20000 --tenants 200 --rates 0.1,0.01
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvpool.workloads.generators import generate
from kvpool.workloads.lru_curve import lru_curve
from kvpool.workloads.sampled import curve_error, sampled_lru_curve
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.specs import get_spec
from kvpool.workloads.sweep import auto_capacities, unique_blocks
from kvpool.workloads.trace import Request, bundled_trace, read_mooncake

MLA = get_spec("k3", pure_mla=True)
BS = 512
CFG = SimConfig(spec=MLA, policy="lru", capacity_unit="blocks", block_size=BS, hints=False,
                high_watermark=1.0, low_watermark=1.0)  # fmt: skip


def _one(name: str, reqs: list[Request], rates: list[float], salts: int, points: int, by: str) -> list[dict]:
    u = unique_blocks(reqs, MLA, BS)
    caps = auto_capacities(u, points, max(1, u // 20))
    start = time.monotonic()
    curve, fallback = lru_curve(reqs, CFG, caps, BS)
    exact_s = time.monotonic() - start
    exact = {c: p.to_dict() for c, p in curve.items()}
    out = []
    for rate in rates:
        for salt in range(salts):
            start = time.monotonic()
            est = sampled_lru_curve(reqs, CFG, list(exact), BS, rate, salt, by)
            took = round(time.monotonic() - start, 2)
            row: dict[str, Any] = {"trace": name, "requests": len(reqs), "by": by, "rate": rate, "salt": salt,
                                   "sampled_requests": est.sampled_requests, "capacities": len(exact),
                                   "exact_s": round(exact_s, 2), "sampled_s": took}  # fmt: skip
            for metric in ("token_hit_rate", "block_hit_rate"):
                mean, worst = curve_error(exact, est.points, metric)
                row[f"{metric}_mean_abs_err"] = round(mean, 4)
                row[f"{metric}_max_abs_err"] = round(worst, 4)
            out.append(row)
            print(f"{name:<24}{by:>8}{rate:>6g}{salt:>5}{est.sampled_requests:>8}{len(reqs):>8}"
                  f"{row['token_hit_rate_mean_abs_err']:>9.4f}{row['token_hit_rate_max_abs_err']:>9.4f}"
                  f"{row['block_hit_rate_mean_abs_err']:>9.4f}{exact_s:>8.1f}{row['sampled_s']:>8.1f}",
                  flush=True)  # fmt: skip
    del fallback
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--tenants", type=int, default=40)
    ap.add_argument("--rates", default="0.1")
    ap.add_argument("--salts", type=int, default=3)
    ap.add_argument("--points", type=int, default=6)
    ap.add_argument("--no-conversation", action="store_true")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    print(f"{'trace':<24}{'by':>8}{'R':>6}{'salt':>5}{'kept':>8}{'of':>8}{'tok mean':>9}{'tok max':>9}"
          f"{'blk mean':>9}{'exact s':>8}{'sample s':>8}")  # fmt: skip
    rows = []
    chat = generate("chat", args.requests, rate=20.0, seed=5, tenants=args.tenants, hints=False)
    name = f"chat {args.requests}x{args.tenants}t"
    rows += _one(name, chat, rates, args.salts, args.points, "root")
    rows += _one(name, chat, rates, args.salts, args.points, "session")
    if not args.no_conversation:
        rows += _one("mooncake conversation", read_mooncake(bundled_trace("conversation")), rates, args.salts,
                     args.points, "root")  # fmt: skip
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
