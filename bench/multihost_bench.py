"""Multi-host benchmark on network namespaces (root): the store's data plane across a veth, and TTFT over
200 µs links, each side by side with its baseline in one run.

``store``: master, storage node and client each in its own namespace on one bridge (links unshaped: the
veth itself is the wire). Put/get GB/s of kvpool tcp and ucx at each object size, against a plain
blocking socket pair between the same two namespaces. Goal: tcp and ucx >= 0.9 x the socket pair, and
ucx within 20 % of tcp.

``ttft``: server TTFT at 0 / 50 / 90 % prefix hits (``ttft_bench``'s method: seed requests store the
prefix, the measured request reuses exactly that many blocks) on ``kvpool up --netns --link "delay
200us"`` (every service in its own namespace, each link 200 µs each way) against the same cluster on
loopback.

    .venv/bin/python bench/multihost_bench.py                # both sections
    .venv/bin/python bench/multihost_bench.py --only store --sizes 4,16 --reps 10

Last stdout line: one JSON object with every number and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool.workloads.progress import StepProgress
from store_common import MB, Plan, Row, children, read_json_line

HERE = Path(__file__).resolve()
TTFT_HITS = (0.0, 0.5, 0.9)
LINK = "delay 200us"


# ----------------------------------------------------------------------------------------------- store
def _client_role(args: argparse.Namespace) -> int:
    """Runs inside the client namespace: measure tcp, ucx and the socket pair; print one JSON line."""
    from store_baselines import measure_socket
    from store_ours import _measure_transport

    plan = Plan.from_json(json.loads(args.plan))
    host, port = args.socket.rsplit(":", 1)
    rows = [asyncio.run(_measure_transport(plan, args.master, t)).to_json() for t in ("tcp", "ucx")]
    rows.append(measure_socket(plan, host, int(port)).to_json())
    print(json.dumps({"rows": rows}), flush=True)
    return 0


def section_store(plan: Plan) -> dict[str, Any]:
    from kvpool.runtime.netns import Topology
    from kvpool.runtime.spawn import start, wait_ready
    from store_ours import _capacity_for

    topo = Topology.create()
    try:
        with children() as procs:  # every server stopped on the way out, whatever happened
            hosts = {name: topo.add_host(name) for name in ("master", "node", "client")}
            logs = Path(tempfile.mkdtemp(prefix="multihost-bench-"))
            master_argv = ["kvpool.kvstore.cli", "master", "--host", hosts["master"].ip, "--port", "0"]
            master = start("master", master_argv, logs / "master.log", prefix=hosts["master"].exec_prefix())
            procs.append(master.popen)
            wait_ready(master, 60)
            master_addr = f"{hosts['master'].ip}:{master.ready['port']}"
            node = start(
                "node",
                ["kvpool.kvstore.cli", "node", "--master", master_addr, "--host", hosts["node"].ip,
                 "--capacity", str(_capacity_for(plan)), "--transport", "tcp,ucx"],
                logs / "node.log",
                prefix=hosts["node"].exec_prefix(),
            )  # fmt: skip
            procs.append(node.popen)
            wait_ready(node, 60)
            sink = subprocess.Popen(
                [*hosts["node"].exec_prefix(), sys.executable, str(HERE.parent / "store_baselines.py"),
                 "socket-server", str(max(plan.sizes_mb) * MB), hosts["node"].ip],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            procs.append(sink)
            sink_port = read_json_line(sink, 60, "port")["port"]
            client = subprocess.run(
                [*hosts["client"].exec_prefix(), sys.executable, str(HERE), "client",
                 "--master", master_addr, "--socket", f"{hosts['node'].ip}:{sink_port}",
                 "--plan", json.dumps(plan.to_json())],
                capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            if client.returncode != 0:
                raise RuntimeError(f"client namespace failed: {client.stderr[-2000:]}")
            return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        topo.destroy()


# ------------------------------------------------------------------------------------------------ ttft
class _Workers:
    """What ``ttft_bench._measure`` needs of a cluster: one prefill and one decode address."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill, decode


def _ttft_on(netns: bool, args: argparse.Namespace) -> dict[str, Any]:
    import ttft_bench

    from kvpool.launch.cluster import Cluster
    from kvpool.launch.config import load_config

    ttft_bench.HITS = TTFT_HITS
    config = load_config(
        None,
        {
            "cluster": {"threads": 1},
            "store": {"capacity": "1GiB", "transport": "tcp,shm"},
            "prefill": {"count": 1, "args": ["--store-timeout", "30"]},
            "decode": {"count": 1, "args": ["--store-timeout", "30"]},
            "gateway": {"port": 0},
        },
    )
    run_dir = Path(tempfile.mkdtemp(prefix=f"multihost-ttft-{'netns' if netns else 'lo'}-"))
    with Cluster(config, run_dir, netns=netns, link=LINK if netns else None) as cluster:
        workers = _Workers(cluster.by_role("prefill")[0].address, cluster.by_role("decode")[0].address)
        measure_args = argparse.Namespace(
            model="tiny", tokens=args.tokens, block_size=64, max_tokens=8, reps=args.ttft_reps, seed=0,
            threads=1, link_gbps=25.0,
        )  # fmt: skip
        return asyncio.run(ttft_bench._measure(measure_args, workers))


def section_ttft(args: argparse.Namespace) -> dict[str, Any]:
    return {"loopback": _ttft_on(False, args), "netns_200us": _ttft_on(True, args)}


# ------------------------------------------------------------------------------------------------ main
def _ratios(store: dict | None, ttft: dict | None, size: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    if store:
        rows = {r["id"]: Row.from_json(r) for r in store["rows"]}
        sock = rows["socket"]
        for t in ("tcp", "ucx"):
            for op in ("put", "get"):
                mine, base = getattr(rows[t], op).get(size), getattr(sock, op).get(size)
                out[f"{t}_{op}_over_socket"] = round(mine / base, 3) if mine and base else None
        for op in ("put", "get"):
            u, t = getattr(rows["ucx"], op).get(size), getattr(rows["tcp"], op).get(size)
            out[f"ucx_{op}_over_tcp"] = round(u / t, 3) if u and t else None
    if ttft:
        for h in TTFT_HITS:
            lo = next(r for r in ttft["loopback"]["rows"] if r["hit"] == h)["server_ttft_s"]
            ns = next(r for r in ttft["netns_200us"]["rows"] if r["hit"] == h)["server_ttft_s"]
            out[f"ttft_{int(h * 100)}_netns_over_loopback"] = round(ns / lo, 3) if lo else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role")
    c = sub.add_parser("client", help="(internal) the measuring side, run inside the client namespace")
    c.add_argument("--master", required=True)
    c.add_argument("--socket", required=True)
    c.add_argument("--plan", required=True)
    p.add_argument("--only", default="store,ttft", help="comma-separated: store, ttft")
    p.add_argument("--sizes", default="1,4,16", help="object sizes in MB")
    p.add_argument("--reps", type=int, default=8, help="timed reps per size")
    p.add_argument("--tokens", type=int, default=2048, help="TTFT prompt length")
    p.add_argument("--ttft-reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.role == "client":
        return _client_role(args)
    if os.geteuid() != 0:
        print("multihost_bench: network namespaces need root", file=sys.stderr)
        return 2
    only = set(args.only.split(","))
    sizes = [int(s) for s in args.sizes.split(",")]
    plan = Plan(sizes_mb=sizes, reps=dict.fromkeys(sizes, args.reps), warmup=2)
    progress = StepProgress(len(only), "multihost_bench")
    t0 = time.time()
    store = section_store(plan) if "store" in only else None
    if store:
        progress.finished("store across namespaces")
    ttft = section_ttft(args) if "ttft" in only else None
    if ttft:
        progress.finished("ttft loopback vs 200us links")
    size = 4 if 4 in sizes else sizes[0]
    if store:
        print(f"\nstore across namespaces (GB/s; veth, unshaped), sizes {sizes} MB")
        print(f"{'method':<28}" + "".join(f"{f'{s}MB put':>10}{f'{s}MB get':>10}" for s in sizes))
        for r in store["rows"]:
            row = Row.from_json(r)
            cells = "".join(f"{row.put.get(s) or 0:>10.2f}{row.get.get(s) or 0:>10.2f}" for s in sizes)
            print(f"{row.method:<28}{cells}")
    if ttft:
        print(f"\nserver TTFT (s), {args.tokens}-token prompts, median of {args.ttft_reps}")
        print(f"{'hit':>6}{'loopback':>12}{'netns 200us':>14}")
        for h in ("cold", *TTFT_HITS):
            lo = next(r for r in ttft["loopback"]["rows"] if r["hit"] == h)["server_ttft_s"]
            ns = next(r for r in ttft["netns_200us"]["rows"] if r["hit"] == h)["server_ttft_s"]
            label = h if h == "cold" else f"{h:.0%}"
            print(f"{label:>6}{lo:>12.3f}{ns:>14.3f}")
    result = {
        "bench": "multihost",
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "seconds": round(time.time() - t0, 1),
        "store": store,
        "ttft": ttft,
        "ratios": _ratios(store, ttft, size),
        "ratio_size_mb": size,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
