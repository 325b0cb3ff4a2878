"""The compiled index core against the plain-Python index it replaced, side by side in one run.

Each tree (this one, and each ``--baseline TREE``: a ``git worktree`` of an earlier commit, e.g. the one
before the core, with its own ``.venv``) runs the same measuring script in a fresh child process of its
own interpreter:

- **sim**: simulator points on the bundled conversation trace (12,031 requests, 288,500 block reads), CPU
  seconds of ``simulate`` alone (the trace is loaded before the clock starts): pure-MLA LRU at 20,000 blocks
  with both watermarks at 1.0 (evict to fit, the issue's setting), the same at the default watermarks, and
  the default policy (hybrid) at K3 spec at 29 and 89 GiB. Block reads/s = the trace's prompt blocks / CPU s.
- **index**: the index alone, no simulator around it: a 24-block ``match_prefix`` over 100k indexed objects
  (4,000 chains of 24 MLA blocks and a checkpoint), and ``insert_chain`` of such chains (µs per object).
- **memory**: RSS growth per indexed object of a fresh child indexing ``--objects`` MLA blocks (chains of 24
  with a checkpoint each), keys made inside the measured region as a master receiving them would hold them,
  glibc's mmap threshold pinned at 1 MiB as the master process pins it at start.
- **churn** (``--churn N``): N such objects put through an object cap of N / 5 (lru): RSS when the index
  first holds the cap, and its peak after (sampled every 250k puts), as peak / steady.

Prints a table, then one JSON line with every figure and, per baseline, the ratios baseline / this tree
(times and bytes, so > 1 is better here). ``--equality`` also runs the whole ``bench/policy_bench.py``
grid (every trace, online policy, capacity, with and without the SSD tier and hints) on the core and on
the oracle (``tests/oracle``) in this tree, and reports the points whose results differ (none is the
requirement).

    .venv/bin/python bench/index_core_bench.py --baseline /tmp/kvpool-before
    .venv/bin/python bench/index_core_bench.py --baseline /tmp/kvpool-before --baseline /tmp/kvpool-233e1f4
    .venv/bin/python bench/index_core_bench.py --baseline /tmp/kvpool-before --objects 10000000
    .venv/bin/python bench/index_core_bench.py --churn 50000000
    .venv/bin/python bench/index_core_bench.py --equality --no-speed --traces conversation --caps 29,89
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.policy_bench import CAPACITIES_GIB, TRACES  # noqa: E402 (after the path that makes bench/ importable)

CHILD = r"""
import gc, hashlib, json, os, sys, time
import psutil
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import ObjectKind
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG

what, arg = sys.argv[1], int(sys.argv[2])
out = {"index_source": PrefixIndex.__module__ + ":" + sys.modules[PrefixIndex.__module__].__file__}

def chains(n_chains, seed=b"c"):
    for c in range(n_chains):
        prev = hashlib.sha256(seed + c.to_bytes(8, "little")).digest()
        hs = []
        for i in range(24):
            prev = hashlib.sha256(prev).digest()
            hs.append(prev)
        yield hs

def _takes_columns():
    # the columnar chain (since 07f61fd): an empty one is answered; the tuple form takes no such arguments
    probe = PrefixIndex("lru", clock=lambda: 1.0)
    probe.add_node("n", 1)
    try:
        return probe.insert_chain([], [], [], node_id="n") == []
    except TypeError:
        return False

COLUMNS = _takes_columns()
ONES, ADMITS, CHECKPOINT = [1] * 24, [True] * 24, [(24, 1, True)]

def put_chain(idx, hs):
    # 24 MLA blocks and a checkpoint closing them, in one call of the tree's own insert_chain
    if COLUMNS:
        return idx.insert_chain(hs, ONES, ADMITS, CHECKPOINT, node_id="n")
    items, parent = [], b""
    for h in hs:
        items.append((MLA_TAG + h, ObjectKind.MLA, 1, parent, True))
        parent = MLA_TAG + h
    items.append((KDA_TAG + hs[-1], ObjectKind.KDA, 1, b"", True))
    return idx.insert_chain(items, node_id="n")

if what == "sim":
    from kvpool.worker.checkpoint_policy import CheckpointPolicy
    from kvpool.workloads.sim import SimConfig, simulate
    from kvpool.workloads.specs import get_spec
    from kvpool.workloads.trace import bundled_trace, read_mooncake
    reqs = read_mooncake(bundled_trace("conversation"))
    blocks = sum(len(r.hash_ids) for r in reqs)
    GiB = 2**30
    mla, k3 = get_spec("k3", pure_mla=True), get_spec("k3")
    points = {
        "lru_mla_fit": SimConfig(spec=mla, policy="lru", capacity=20000, capacity_unit="blocks",
                                 high_watermark=1.0, low_watermark=1.0, checkpoints=CheckpointPolicy()),
        "lru_mla": SimConfig(spec=mla, policy="lru", capacity=20000, capacity_unit="blocks",
                             checkpoints=CheckpointPolicy()),
        "default_k3_29": SimConfig(spec=k3, capacity=29 * GiB),
        "default_k3_89": SimConfig(spec=k3, capacity=89 * GiB),
    }
    for name, cfg in points.items():
        gc.collect()
        t = time.process_time()
        res = simulate(reqs, cfg).to_dict()
        cpu = time.process_time() - t
        out[name] = {"cpu_s": round(cpu, 3), "block_reads_per_s": round(blocks / cpu),
                     "token_hit_rate": res["token_hit_rate"]}
    out["block_reads"] = blocks
elif what == "index":
    idx = PrefixIndex("lru", clock=lambda: 1.0)
    idx.add_node("n", 1 << 60)
    all_hs = list(chains(arg))
    t = time.process_time()
    for hs in all_hs:
        put_chain(idx, hs)
    out["insert_us_per_object"] = round((time.process_time() - t) / (len(all_hs) * 25) * 1e6, 3)
    reps = 20000
    pick = [all_hs[(i * 7919) % len(all_hs)] for i in range(reps)]
    t = time.process_time()
    for hs in pick:
        m = idx.match_prefix(hs)
    out["match24_us"] = round((time.process_time() - t) / reps * 1e6, 3)
    assert m.usable_blocks == 24
elif what == "memory":
    # the heap as the master process runs it (``kvpool store master`` pins glibc's mmap threshold at 1 MiB
    # at start): outgrown columns go back to the OS instead of staying resident in the heap. Through ctypes,
    # not the tree's own helper, so that every tree (one from before the helper too) gets the same heap
    import ctypes
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (glibc)
    except (OSError, AttributeError):
        pass
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    idx = PrefixIndex("lru", clock=lambda: 1.0, keep_events=False)
    idx.add_node("n", 1 << 60)
    n = 0
    for hs in chains(arg // 25):
        put_chain(idx, hs)
        n += 25
    gc.collect()
    out["objects"] = len(idx)
    out["rss_bytes_per_object"] = round((proc.memory_info().rss - rss0) / len(idx), 1)
elif what == "churn":
    # arg inserts through an object cap of arg / 5 (policy lru, the master's default watermarks): RSS when
    # the index first holds the cap (steady), and its peak after, sampled every 250k inserts
    proc = psutil.Process()
    cap = arg // 5
    idx = PrefixIndex("lru", clock=lambda: 1.0, keep_events=False, max_objects=cap)
    idx.add_node("n", 1 << 60)
    if cap < 250_000:
        raise SystemExit(f"--churn {arg}: the cap ({cap}) must hold at least one 250k-put sample")
    steady = peak = 0
    puts = arg // 25 * 25
    t = time.process_time()
    for i, hs in enumerate(chains(arg // 25, seed=b"churn")):
        put_chain(idx, hs)
        if (i + 1) % 10000 == 0:
            rss = proc.memory_info().rss
            if not steady and (i + 1) * 25 >= cap:
                steady = rss
            peak = max(peak, rss) if steady else 0
    out.update(churn_inserts=puts, churn_cap=cap, churn_steady_rss=steady, churn_peak_rss=peak,
               churn_peak_over_steady=round(peak / steady, 3), churn_us_per_insert=round(
                   (time.process_time() - t) / puts * 1e6, 3), churn_held=len(idx))
print(json.dumps(out))
"""


def _child(tree: Path, what: str, arg: int) -> dict[str, Any]:
    py = tree / ".venv" / "bin" / "python"
    cmd = [str(py), "-c", CHILD, what, str(arg)]
    run = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False, timeout=3600)
    if run.returncode:
        raise SystemExit(f"{tree} {what}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _equality(traces: list[str], caps: list[int]) -> dict[str, Any]:
    from kvpool.kvstore.index.eviction import POLICIES
    from kvpool.workloads import sim
    from kvpool.workloads.labels import YARDSTICKS
    from kvpool.workloads.sim import SimConfig, simulate
    from kvpool.workloads.specs import get_spec

    from bench.policy_bench import HINTED, SSD_RATIO, load
    from tests.oracle.prefix_index import PrefixIndex as OraclePrefixIndex

    core = sim.PrefixIndex
    k3 = get_spec("k3")
    points = differ = 0
    diffs: list[str] = []
    for trace in traces:
        reqs = load(trace)
        for policy in [*sorted(POLICIES), *YARDSTICKS]:
            for cap in caps:
                for ssd in (0, SSD_RATIO):
                    for hints in (False, True) if trace in HINTED else (False,):
                        cfg = SimConfig(spec=k3, policy=policy, capacity=cap * 2**30,
                                        ssd_capacity=ssd * cap * 2**30, hints=hints)  # fmt: skip
                        sim.PrefixIndex = core
                        a = simulate(reqs, cfg).to_dict()
                        sim.PrefixIndex = OraclePrefixIndex
                        b = simulate(reqs, cfg).to_dict()
                        sim.PrefixIndex = core
                        points += 1
                        if a != b:
                            differ += 1
                            diffs.append(f"{trace} {policy} {cap} ssd={ssd} hints={hints}")
                        print(f"  {trace:12} {policy:7} {cap:5} GiB ssd x{ssd} hints={hints!s:5}"
                              f" {'equal' if a == b else 'DIFFERENT'}", flush=True)  # fmt: skip
    return {"points": points, "different": differ, "which": diffs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--baseline", type=Path, action="append", default=[], help="a tree with its .venv (repeated)"
    )
    ap.add_argument("--objects", type=int, default=1_000_000, help="memory: objects indexed")
    ap.add_argument("--chains", type=int, default=4000, help="index: chains of 25 objects indexed")
    ap.add_argument("--churn", type=int, default=0, help="churn: inserts through a cap of a fifth (0: skip)")
    ap.add_argument("--equality", action="store_true", help="also the policy bench grid, core vs oracle")
    ap.add_argument("--traces", default=",".join(TRACES), help="equality: the grid's traces")
    ap.add_argument("--caps", default=",".join(map(str, CAPACITIES_GIB)), help="equality: capacities, GiB")
    ap.add_argument("--no-speed", action="store_true", help="equality only (no simulator, index, memory)")
    args = ap.parse_args()
    trees = {"this": ROOT}
    for tree in args.baseline:  # named by their directories, numbered where two share a name
        name = tree.resolve().name
        while name in trees:
            name += "'"
        trees[name] = tree.resolve()
    res: dict[str, dict[str, Any]] = {}
    if args.no_speed:
        trees = {}
    for name, tree in trees.items():
        res[name] = {**_child(tree, "sim", 0), **_child(tree, "index", args.chains)}
        res[name].update(_child(tree, "memory", args.objects))
        if args.churn:
            res[name].update(_child(tree, "churn", args.churn))
    rows = ["lru_mla_fit", "lru_mla", "default_k3_29", "default_k3_89"]
    index_keys = ("match24_us", "insert_us_per_object", "rss_bytes_per_object")
    if trees:
        print(f"{'measure':34} " + " ".join(f"{n:>22}" for n in trees))
        for r in rows:
            print(f"{r + ' (CPU s)':34} " + " ".join(f"{res[n][r]['cpu_s']:>22.3f}" for n in trees))
            rates = " ".join(f"{res[n][r]['block_reads_per_s']:>22,}" for n in trees)
            print(f"{r + ' (block reads/s)':34} {rates}")
        for key in index_keys + (("churn_peak_over_steady", "churn_us_per_insert") if args.churn else ()):
            print(f"{key:34} " + " ".join(f"{res[n][key]:>22}" for n in trees))
    out: dict[str, Any] = {"bench": "index_core", "host": platform.node(), "load1": os.getloadavg()[0],
                           "objects": args.objects, "results": res}  # fmt: skip
    this = res.get("this")
    for name in list(trees)[1:]:  # each baseline over this tree: > 1 is faster (or smaller) here
        base = res[name]
        out[f"ratios_{name}_over_this"] = {
            **{r: round(base[r]["cpu_s"] / this[r]["cpu_s"], 2) for r in rows},
            **{k: round(base[k] / this[k], 2) for k in index_keys},
        }
        same = all(base[r]["token_hit_rate"] == this[r]["token_hit_rate"] for r in rows)
        out[f"same_hit_rates_as_{name}"] = same
    if args.equality:
        t = time.perf_counter()
        out["equality"] = _equality(args.traces.split(","), [int(c) for c in args.caps.split(",")])
        out["equality"]["seconds"] = round(time.perf_counter() - t)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
