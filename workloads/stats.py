"""Summary statistics of a trace: sizes, arrival span, and the infinite-cache prefix hit rate.

The hit rate here is the Mooncake-report definition
(the Mooncake FAST'25 trace analysis; docs/design/workloads.md) computed directly on block ids
with a plain set, independent of the index, so ``kvpool trace stats`` is a cross-check of the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.workloads.chains import ChainBuilder
from kvpool.workloads.trace import Request


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` as the sample at index round(q x (n - 1)) of the sorted list;
    0 for no values. One definition for measured (live) and estimated (simulated) TTFT, so they compare."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def trace_stats(requests: Sequence[Request], block_size: int = 512) -> dict[str, Any]:
    """Counts per workload and overall; blocks are full blocks for token records, ids for trace records."""
    builder = ChainBuilder("stats", block_size)
    seen: set[bytes] = set()
    groups: dict[str, dict[str, Any]] = {}
    total = _empty()
    for req in sorted(requests, key=lambda r: r.arrival_ms):
        ch = builder.chain(req, with_output=False)
        run = 0
        for h in ch.hashes:
            if h not in seen:
                break
            run += 1
        seen.update(ch.hashes)
        for g in (groups.setdefault(req.workload, _empty()), total):
            g["requests"] += 1
            g["input_tokens"] += req.input_length
            g["output_tokens"] += req.output_length
            g["blocks"] += len(ch.hashes)
            g["hit_blocks"] += run
            g["hit_tokens"] += sum(ch.block_tokens[:run])
            g["first_ms"] = min(g["first_ms"], req.arrival_ms)
            g["last_ms"] = max(g["last_ms"], req.arrival_ms)
    out = _finish(total)
    out["unique_blocks"] = len(seen)
    out["workloads"] = {w: _finish(g) for w, g in sorted(groups.items())}
    return out


def _empty() -> dict[str, Any]:
    return {"requests": 0, "input_tokens": 0, "output_tokens": 0, "blocks": 0, "hit_blocks": 0,
            "hit_tokens": 0, "first_ms": float("inf"), "last_ms": float("-inf")}  # fmt: skip


def _finish(g: dict[str, Any]) -> dict[str, Any]:
    n = g["requests"]
    return {
        "requests": n,
        "input_tokens": g["input_tokens"],
        "output_tokens": g["output_tokens"],
        "mean_input": g["input_tokens"] / n if n else 0.0,
        "mean_output": g["output_tokens"] / n if n else 0.0,
        "blocks": g["blocks"],
        "duration_s": (g["last_ms"] - g["first_ms"]) / 1000.0 if n else 0.0,
        "infinite_block_hit_rate": g["hit_blocks"] / g["blocks"] if g["blocks"] else 0.0,
        "infinite_token_hit_rate": g["hit_tokens"] / g["input_tokens"] if g["input_tokens"] else 0.0,
    }
