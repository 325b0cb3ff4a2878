"""The exact LRU curve at production size: ``kvpool replay --policy lru`` at 20 capacities on a 1 M-request
Mooncake-format trace, this tree against a baseline tree (issue #42's goal: <= 60 s on a 2-core box).

The trace is the bundled conversation trace tiled to ``--requests`` (``trace_io_bench.tiled_mooncake``:
ids and arrivals shifted per copy), converted to Parquet once. Each run is the user's command, pure MLA K3,
evict-to-fit (1.0 / 1.0), 20 capacities in blocks geometric from 714 to 182,784, one process:

    kvpool replay TRACE --pure-mla --policy lru --high-watermark 1 --low-watermark 1 \\
        --capacity-blocks C1,...,C20 --jobs 1 --no-progress

The baseline (``--baseline DIR``: a ``git worktree`` of the previous commit with its own ``.venv``) runs on
the first ``--baseline-requests`` only (its pass was minutes per 100 k requests); this tree runs on both
sizes, so the ratio is taken at the size both ran. Prints a table and one JSON line.

    .venv/bin/python bench/lru_curve_scale_bench.py --baseline /tmp/kvpool-base
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpool.workloads.trace import read_trace
from kvpool.workloads.trace_columnar import write_parquet
from trace_io_bench import tiled_mooncake

CAPACITIES = [int(714 * 256 ** (i / 19)) for i in range(20)]


def run(tree: Path, trace: Path, limit: int | None, out: Path) -> float:
    """Wall seconds of the replay command in ``tree`` (its own venv)."""
    caps = ",".join(map(str, CAPACITIES))
    cmd = [str(tree / ".venv/bin/kvpool"), "replay", str(trace), "--pure-mla", "--policy", "lru",
           "--high-watermark", "1", "--low-watermark", "1", "--capacity-blocks", caps,
           "--jobs", "1", "--no-progress", "--out-dir", str(out)]  # fmt: skip
    if limit:
        cmd += ["--limit", str(limit)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--baseline", type=Path, help="a worktree of the previous commit, with its .venv")
    ap.add_argument("--baseline-requests", type=int, default=100_000)
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        jsonl, parquet = Path(tmp) / "trace.jsonl", Path(tmp) / "trace.parquet"
        tiled_mooncake(jsonl, args.requests)
        write_parquet(read_trace(jsonl), parquet)
        jsonl.unlink()
        rows = [("this tree", args.requests, run(here, parquet, None, Path(tmp) / "a"))]
        rows.append(
            ("this tree", args.baseline_requests, run(here, parquet, args.baseline_requests, Path(tmp) / "b"))
        )
        if args.baseline:
            base = run(args.baseline, parquet, args.baseline_requests, Path(tmp) / "c")
            rows.append(("baseline", args.baseline_requests, base))
    print(f"{'tree':<10} {'requests':>10} {'wall s':>8}")
    for tree, n, seconds in rows:
        print(f"{tree:<10} {n:>10,} {seconds:>8.1f}")
    result = {"requests": args.requests, "wall_s": round(rows[0][2], 2), "goal_s": 60}
    if args.baseline:
        result["speedup_at_baseline_size"] = round(rows[2][2] / rows[1][2], 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
