"""Master shards at trace scale, simulated: per-shard load spread and the token hit rate against one master.

For each shipped trace, each shard count N and depth K: the trace replayed through N indexes, each with 1/N
of the capacity, chains routed by ``kvstore/shards.py`` (``kvpool replay TRACE --shards N --shard-depth K``
does one such run). Reported: the coefficient of variation (population stdev / mean) of lookups and of
bytes written between the shards, and the token hit rate minus one master's of the same total capacity.

    .venv/bin/python bench/shards_sim_bench.py                       # conversation + synthetic, N 2 4, K 1 2
    .venv/bin/python bench/shards_sim_bench.py --traces conversation --shards 2 --depths 2

Output: a table and one JSON line (every cell, and the worst CV and hit loss at K = 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvpool.kvstore.shards import ShardSet
from kvpool.workloads.commands.common import parse_size
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import bundled_trace, read_mooncake


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="conversation,synthetic")
    ap.add_argument("--shards", default="2,4")
    ap.add_argument("--depths", default="1,2")
    ap.add_argument("--capacity", default="89GiB", help="total capacity (split evenly between the shards)")
    args = ap.parse_args()
    spec = get_spec("k3")
    cells = []
    for trace in args.traces.split(","):
        reqs = read_mooncake(bundled_trace(trace))
        base = SimConfig(spec=spec, capacity=parse_size(args.capacity))
        one = simulate(reqs, base).total.to_dict()["token_hit_rate"]
        for count in map(int, args.shards.split(",")):
            for depth in map(int, args.depths.split(",")):
                r = simulate(reqs, dataclasses.replace(base, shards=ShardSet(count, depth)))
                s = r.shards()
                hit = r.total.to_dict()["token_hit_rate"]
                cells.append({
                    "trace": trace, "shards": count, "depth": depth, "lookup_cv": round(s["lookup_cv"], 4),
                    "bytes_cv": round(s["bytes_cv"], 4), "token_hit": round(hit, 5),
                    "one_master_token_hit": round(one, 5), "token_hit_loss": round(one - hit, 5),
                })  # fmt: skip
                c = cells[-1]
                print(f"{trace:<13} N={count} K={depth}  lookup CV {c['lookup_cv']:.3f}  bytes CV "
                      f"{c['bytes_cv']:.3f}  token hit {hit:.2%} vs {one:.2%} one master "
                      f"({c['token_hit_loss']:+.2%} lost)", flush=True)  # fmt: skip
    at_k2 = [c for c in cells if c["depth"] == 2]
    summary = {
        "capacity": args.capacity,
        "max_cv_k2": max((max(c["lookup_cv"], c["bytes_cv"]) for c in at_k2), default=None),
        "max_token_hit_loss_k2": max((c["token_hit_loss"] for c in at_k2), default=None),
    }
    print(json.dumps({"cells": cells, **summary}))


if __name__ == "__main__":
    main()
