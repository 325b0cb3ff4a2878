"""The vLLM connector side by side: TTFT of fresh engines (cold, kvpool, a baseline tree's kvpool, vLLM's disk
``ExampleConnector``), load bandwidth inside the reader, and a throughput run with and without kvpool.

Run with the vLLM venv (``make venv-vllm``)::

    .venv-vllm/bin/python bench/vllm_connector_bench.py                        # 1k, 2k, 4k tokens
    .venv-vllm/bin/python bench/vllm_connector_bench.py --baseline /tmp/kvb    # + a git worktree's kvpool
    .venv-vllm/bin/python bench/vllm_connector_bench.py --lengths 16384 --prompts 1 --no-throughput
    .venv-vllm/bin/python bench/vllm_connector_bench.py --baseline /tmp/kvb --prompts 2 --no-throughput

One real kvpool store (master + storage node on loopback, ``auto`` transport: shm on one host) and one engine
process at a time. **TTFT**: *cold* (no connector), *kvpool writer* (``kv_both``, cold, saves), *kvpool
reader* (a fresh ``kv_both`` engine: every prompt is a hit; asynchronous loads, and ``_sync`` with
``load_async=false``), the same from ``--baseline TREE`` (a ``git worktree`` of an earlier commit, imported
through ``PYTHONPATH``: same store, same prompts under a salt of its own), *disk writer* and *disk reader*
(``ExampleConnector`` on a temp dir). The writers run first, then a second cold engine (a writer is compared
with the median of both cold runs); then ``--rounds`` rounds of fresh readers, every reader kind once per
round in an order rotated each round, so that no kind always runs first or last on a shared box. Each
engine first answers a 40-token warm-up; TTFT is the wall time of a one-token greedy generate of one prompt,
median over ``--prompts`` prompts per length and every run of that kind. **Load bandwidth**: the
readers' own account of each load (bytes over the time from the load's start to its last object written,
logged by the connector at ``log_level=INFO``), median over loads; against a memcpy of the same size in this
process. **Throughput**: a writer sees ``--docs`` documents of ``--doc-tokens`` tokens once; then a fresh
engine with vLLM's prefix caching on answers ``--requests`` requests (each a document plus its own 64-token
question, 16 output tokens) submitted together, with and without kvpool: tokens/s and TTFT p50/p99.

Last line: one JSON object with the ratios against the goals (``docs/measurements/vllm_connector.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.workloads.progress import StepProgress

from tests.harness.store_procs import start_master, start_node
from tests.vllm_connector.engines import Engine, kvpool_spec, prompts_of
from tests.vllm_connector.make_model import make_tiny_llama

WARMUP = prompts_of([40], seed=99)
LOAD_LINE = re.compile(r"objects, \d+ B loaded in [\d.]+ ms \(([\d.]+) GB/s\)")
CHUNK = 64


def mirror_of(tree: Path, into: Path) -> Path:
    """A directory that imports ``tree``'s code as ``kvpool.*`` (our ``package-dir`` mapping, rebuilt with
    symlinks): put it first on ``PYTHONPATH`` to run an earlier commit's connector in the same venv."""
    mapping = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = into / "kvpool"
    root.mkdir(parents=True)
    for entry in (tree / mapping["kvpool"]).iterdir():
        (root / entry.name).symlink_to(entry)
    for name, path in mapping.items():
        if name.count(".") == 1:  # kvpool.<package> -> <dir>
            (root / name.split(".")[1]).symlink_to(tree / path)
    return into


def ttfts(engine: Engine, prompts: list[list[int]], salt: str | None) -> list[tuple[float, int]]:
    engine.run(WARMUP, max_tokens=1)
    out = []
    for p in prompts:
        r = engine.run([p], max_tokens=1, salt=salt, deadline_s=900)
        out.append((r["seconds"], r["outputs"][0]["cached"]))
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def memcpy_gbps(nbytes: int = 32 << 20) -> float:
    """This host's memcpy of a load-sized buffer into already-touched memory, best of 5 (GB/s)."""
    import torch

    # both touched: an untouched source reads the kernel's zero page and measures nothing
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def throughput(engine: Engine, requests: list[list[int]]) -> dict[str, float]:
    engine.run(WARMUP, max_tokens=1)
    r = engine.run(requests, max_tokens=16, deadline_s=1800)
    tokens = sum(len(p) for p in requests) + sum(len(o["tokens"]) for o in r["outputs"])
    ttft = [o["ttft"] for o in r["outputs"] if o["ttft"] is not None]
    return {
        "seconds": r["seconds"],
        "tokens_per_s": tokens / r["seconds"],
        "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99) if ttft else float("nan"),
        "cached_tokens": sum(o["cached"] for o in r["outputs"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    ap.add_argument("--prompts", type=int, default=3, help="different prompts per length (median)")
    ap.add_argument("--hidden", type=int, default=1024, help="model hidden size (heads of 64)")
    ap.add_argument("--layers", type=int, default=8, help="model layers")
    ap.add_argument("--baseline", type=Path, default=None, help="a git worktree of an earlier commit")
    ap.add_argument("--rounds", type=int, default=2, help="fresh engines per reader kind, alternated")
    ap.add_argument("--docs", type=int, default=8, help="throughput run: shared documents")
    ap.add_argument("--doc-tokens", type=int, default=2048, help="throughput run: tokens per document")
    ap.add_argument("--requests", type=int, default=32, help="throughput run: requests over the documents")
    ap.add_argument("--no-throughput", action="store_true", help="skip the throughput run")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {n: prompts_of([n] * args.prompts, seed=n) for n in lengths}
    flat = [p for n in lengths for p in prompts[n]]
    work = Path(tempfile.mkdtemp(prefix="kvpool-vllm-bench-"))
    model = make_tiny_llama(work / "model", hidden=args.hidden, layers=args.layers, kv_heads=4)
    master = start_master(work)
    # 2 GiB holds every prompt's KV (a 16k prompt is 256 MiB) and the throughput run's documents
    node = start_node(work, master.address, "2GiB", "tcp,shm")
    disk = work / "disk"
    disk.mkdir()
    max_len = max([*lengths, args.doc_tokens + CHUNK]) + CHUNK
    base = {"max_model_len": max_len, "max_num_batched_tokens": max(4608, max_len)}
    Spec = tuple[dict[str, Any], dict[str, str] | None]
    reader = {"log_level": "INFO"}  # each load logs its bytes and time: the bandwidth below
    writers: dict[str, Spec] = {
        "cold": ({"model": str(model)}, None),
        "kvpool_writer": (kvpool_spec(model, master.address, "kv_both"), None),
    }
    readers: dict[str, Spec] = {
        "kvpool_reader": (kvpool_spec(model, master.address, "kv_both", **reader), None),
        "kvpool_reader_sync": (
            kvpool_spec(model, master.address, "kv_both", load_async=False, **reader),
            None,
        ),
    }
    if args.baseline is not None:
        env = {"PYTHONPATH": str(mirror_of(args.baseline.resolve(), work / "baseline-mirror"))}
        writers["before_writer"] = (kvpool_spec(model, master.address, "kv_both"), env)
        readers["before_reader"] = (kvpool_spec(model, master.address, "kv_both", **reader), env)
        readers["before_reader_sync"] = (
            kvpool_spec(model, master.address, "kv_both", load_async=False, **reader),
            env,
        )
    writers["disk_writer"] = ({"model": str(model), "connector": {"example": str(disk)}}, None)
    readers["disk_reader"] = ({"model": str(model), "connector": {"example": str(disk)}}, None)
    # the order of fresh engines: the writers, then a second cold engine (a writer's TTFT is compared with
    # both cold runs, one before and one after it); then the readers, alternated: each round runs every
    # reader once, in an order rotated by one each round, so no reader always goes first or last
    order: list[tuple[str, Spec, int]] = [(name, spec, 0) for name, spec in writers.items()]
    order.append(("cold", writers["cold"], 1))
    names = list(readers)
    for r in range(args.rounds):
        k = r % len(names)
        order += [(name, readers[name], r) for name in names[k:] + names[:k]]
    steps = len(order) + (0 if args.no_throughput else 3)
    progress = StepProgress(steps, "vllm_connector_bench", enabled=not args.json)
    results: dict[str, list[list[tuple[float, int]]]] = {}  # per engine kind, per prompt: every run of it
    tput: dict[str, dict[str, float]] = {}
    kvpool_bytes = 0
    try:
        for name, (spec, env), r in order:
            e = Engine({**spec, **base}, work / f"{name}-{r}.log", env=env)
            try:
                # the baseline pair keys its objects apart from ours with a cache salt of its own: the
                # "before" reader loads what the "before" writer saved
                got = ttfts(e, flat, "before" if name.startswith("before") else None)
            finally:
                e.close()
            for runs, one in zip(results.setdefault(name, [[] for _ in flat]), got, strict=True):
                runs.append(one)
            if name == "kvpool_writer":  # what our writer stored, before anything else writes
                with StoreClient(master.address, "tcp", deadline_s=10) as c:
                    kvpool_bytes = c.stats().bytes
            progress.finished(f"{name} #{r + 1}")
        if not args.no_throughput:
            docs = prompts_of([args.doc_tokens] * args.docs, seed=4242)
            questions = prompts_of([CHUNK] * args.requests, seed=4343)
            requests = [docs[i % args.docs] + questions[i] for i in range(args.requests)]
            cached_on = {"prefix_caching": True, "log_stats": True}
            e = Engine({**kvpool_spec(model, master.address, "kv_both"), **base}, work / "tput_writer.log")
            try:
                e.run(docs, max_tokens=1, deadline_s=1800)
            finally:
                e.close()
            progress.finished("throughput writer")
            for name, spec in (
                ("without_kvpool", {"model": str(model)}),
                ("with_kvpool", kvpool_spec(model, master.address, "kv_both")),
            ):
                e = Engine({**spec, **base, **cached_on}, work / f"tput_{name}.log")
                try:
                    tput[name] = throughput(e, requests)
                finally:
                    e.close()
                progress.finished(f"throughput {name}")
    finally:
        node.stop()
        master.stop()
    covered = sum(len(p) // CHUNK * CHUNK for p in flat)
    rows = []
    ratios: dict[str, float] = {}
    for n in lengths:
        idx = [i for i, p in enumerate(flat) if len(p) == n]
        med = {k: statistics.median(t for i in idx for t, _ in results[k][i]) * 1000 for k in results}
        cached = {k: statistics.median(c for i in idx for _, c in results[k][i]) for k in results}
        rows.append({"tokens": n, "ttft_ms": med, "cached": cached})
        ratios[f"kvpool_over_disk_ttft_{n}"] = med["kvpool_reader"] / med["disk_reader"]
        ratios[f"kvpool_sync_over_disk_ttft_{n}"] = med["kvpool_reader_sync"] / med["disk_reader"]
        ratios[f"writer_over_cold_ttft_{n}"] = med["kvpool_writer"] / med["cold"]
        if "before_reader" in med:
            ratios[f"before_over_disk_ttft_{n}"] = med["before_reader"] / med["disk_reader"]
            ratios[f"before_sync_over_disk_ttft_{n}"] = med["before_reader_sync"] / med["disk_reader"]
            ratios[f"before_writer_over_cold_ttft_{n}"] = med["before_writer"] / med["cold"]
    per_token = {"kvpool": kvpool_bytes / covered, "disk": dir_bytes(disk) / covered}
    load_gbps: dict[str, float] = {}
    for name in readers:
        # the reader's own account of each load (its connector logs one line per load at INFO), every round
        logs = [(work / f"{name}-{r}.log").read_text(errors="replace") for r in range(args.rounds)]
        rates = [float(m) for text in logs for m in LOAD_LINE.findall(text)]
        if rates:
            load_gbps[name] = statistics.median(rates)
    memcpy = memcpy_gbps()
    ratios["memcpy_gbps"] = memcpy
    for name, g in load_gbps.items():
        short = name.removesuffix("_reader").replace("_reader", "")
        ratios[f"load_gbps_{short}"] = g
        ratios[f"load_over_memcpy_{short}"] = g / memcpy
    if tput:
        ratios["throughput_with_over_without"] = (
            tput["with_kvpool"]["tokens_per_s"] / tput["without_kvpool"]["tokens_per_s"]
        )
    if not args.json:
        kinds = list(results)
        print(
            f"TTFT ms (median of {args.prompts} prompts x {args.rounds} rounds for readers, x 2 for cold),"
            f" model hidden {args.hidden} x {args.layers} layers"
        )
        print(f"{'tokens':>6}  " + "  ".join(f"{k:>18}" for k in kinds))
        for r in rows:
            print(f"{r['tokens']:>6}  " + "  ".join(f"{r['ttft_ms'][k]:>18.1f}" for k in kinds))
            print(f"{'cached':>6}  " + "  ".join(f"{r['cached'][k]:>18.0f}" for k in kinds))
        for name, g in load_gbps.items():
            print(f"{name}: load bandwidth {g:.2f} GB/s (median over its loads), {g / memcpy:.2f}x memcpy")
        print(f"memcpy of 32 MiB: {memcpy:.2f} GB/s")
        for name, t in tput.items():
            print(
                f"throughput {name}: {t['tokens_per_s']:,.0f} tokens/s, TTFT p50 {t['ttft_p50_ms']:.0f} ms,"
                f" p99 {t['ttft_p99_ms']:.0f} ms, {t['cached_tokens']:,} cached tokens, {t['seconds']:.1f} s"
            )
        print(
            f"bytes stored per prompt token: kvpool {per_token['kvpool']:,.0f}, disk {per_token['disk']:,.0f}"
        )
    summary = {
        "bench": "vllm_connector",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg()[0],
        "rows": rows,
        "throughput": tput,
        "bytes_per_token": per_token,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "goals": {  # issue #43
            "hit_ttft_le_0.8x_disk": all(
                v <= 0.8 for k, v in ratios.items() if k.startswith("kvpool_over_disk_ttft")
            ),
            "sync_hit_ttft_le_0.8x_disk": all(
                v <= 0.8 for k, v in ratios.items() if k.startswith("kvpool_sync_over_disk_ttft")
            ),
            "load_ge_0.65x_memcpy": max(
                (
                    v
                    for k, v in ratios.items()
                    if k in ("load_over_memcpy_kvpool", "load_over_memcpy_kvpool_sync")
                ),
                default=0,
            )
            >= 0.65,
            "writer_le_1.05x_cold": all(
                v <= 1.05 for k, v in ratios.items() if k.startswith("writer_over_cold_ttft")
            ),
            "throughput_ge_2x": ratios.get("throughput_with_over_without", 0) >= 2,
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
