"""Trace I/O at production size: a Mooncake-format JSONL of N requests read as today, converted to Parquet
once (``kvpool trace convert``), and reloaded from Parquet, side by side in one run.

The trace is the bundled conversation trace tiled to N requests (each copy's hash ids and arrivals shifted
past the previous copy's, so sizes and per-request shape are the real trace's). Prints a table and one JSON
line: ``{"requests", "jsonl_read_s", "convert_s", "parquet_read_s", "reload_speedup"}``, where
``reload_speedup`` = JSONL read / Parquet read. Goal (issue #42): at 1 M requests, convert <= 60 s and
reload <= 2 s.

    .venv/bin/python bench/trace_io_bench.py --requests 1000000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvpool.workloads.trace import bundled_trace, open_text, read_trace
from kvpool.workloads.trace_columnar import write_parquet


def tiled_mooncake(path: Path, requests: int) -> None:
    """Write ``requests`` Mooncake lines: the conversation trace, repeated with ids and times shifted."""
    base = [json.loads(line) for line in open_text(bundled_trace("conversation"), "r") if line.strip()]
    id_span = 1 + max(i for r in base for i in r["hash_ids"])
    time_span = 1 + max(r["timestamp"] for r in base)
    with open(path, "w", encoding="utf-8") as fh:
        for n in range(requests):
            copy, r = divmod(n, len(base))
            rec = base[r]
            line = {
                "timestamp": rec["timestamp"] + copy * time_span,
                "input_length": rec["input_length"],
                "output_length": rec["output_length"],
                "hash_ids": [i + copy * id_span for i in rec["hash_ids"]],
            }
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        jsonl, parquet = Path(tmp) / "trace.jsonl", Path(tmp) / "trace.parquet"
        tiled_mooncake(jsonl, args.requests)
        t = time.perf_counter()
        reqs = read_trace(jsonl)
        jsonl_s = time.perf_counter() - t
        blocks = sum(len(r.hash_ids or ()) for r in reqs)
        t = time.perf_counter()
        write_parquet(read_trace(jsonl), parquet)  # what `kvpool trace convert` does: read, then write
        convert_s = time.perf_counter() - t
        del reqs
        t = time.perf_counter()
        again = read_trace(parquet)
        parquet_s = time.perf_counter() - t
        assert len(again) == args.requests
        sizes = (jsonl.stat().st_size, parquet.stat().st_size)
    print(f"{'step':<28}{'seconds':>10}{'file MB':>10}")
    print(f"{'read JSONL (today)':<28}{jsonl_s:>10.2f}{sizes[0] / 1e6:>10.1f}")
    print(f"{'convert JSONL -> Parquet':<28}{convert_s:>10.2f}{sizes[1] / 1e6:>10.1f}")
    print(f"{'reload Parquet':<28}{parquet_s:>10.2f}")
    print(f"{args.requests} requests, {blocks} block ids")
    result = {
        "requests": args.requests,
        "block_ids": blocks,
        "jsonl_read_s": round(jsonl_s, 3),
        "convert_s": round(convert_s, 3),
        "parquet_read_s": round(parquet_s, 3),
        "reload_speedup": round(jsonl_s / parquet_s, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
