"""Master calls per master CPU-second under several client processes, for this tree and (optionally) a
baseline tree, side by side in one run.

Each tree's master and storage node are started as an operator starts them (``<tree>/.venv/bin/kvpool store
master`` / ``store node``), preloaded with chains of 25 small objects (24 MLA blocks and a checkpoint), then
``--clients`` client processes, each with ``--in-flight`` calls outstanding, drive one workload for
``--seconds``; the master's CPU time (user + system, from /proc) over that window is the denominator:

- ``match_prefix``: a 24-block ``match_prefix(require_checkpoint=True)`` of a random preloaded chain;
- ``write_cycle``: what a prefilling request does to the master: one ``match_prefix`` of a new chain, then a
  25-object ``batch_put`` (PutStartBatch, the bytes to the node over tcp, PutCommitBatch).

Clients use only the store client's public calls (``AsyncStoreClient.match_prefix`` / ``batch_put``), so the
same driver runs against any tree.

    .venv/bin/python bench/master_load_bench.py                                   # this tree
    .venv/bin/python bench/master_load_bench.py --baseline /tmp/kvpool-before      # side by side
    .venv/bin/python bench/master_load_bench.py --shards 2     # + this tree with 2 master shards

With ``--shards N`` this tree also runs as N master shards (``--shards N --shard i``, one node registered with
all, clients given ``G0;...``): the denominator is the CPU time of all N masters together, so the ratio
sharded/unsharded says what sharding adds per call (1.0 = nothing); the preloaded chains spread by route.

Output: a table (tree x workload: calls, calls per master CPU-second, p50/p99 ms) and one JSON line with every
cell and, with a baseline, the ratios after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_DEADLINE_S = 60.0

# Runs inside a client process with the tree's own interpreter: argv = master, mode, seconds, in_flight,
# chains, seed, role ("preload" | "drive"). Prints one JSON line.
CLIENT = r"""
import asyncio, hashlib, json, random, sys, time
from kvpool.kvstore.client.async_client import AsyncStoreClient
from kvpool.proto import common_pb2
master, mode, seconds, in_flight, chains, seed, role = sys.argv[1:8]
seconds, in_flight, chains, seed = float(seconds), int(in_flight), int(chains), int(seed)

def chain(i, salt="pre"):
    out, prev = [], hashlib.sha256(f"{salt}{i}".encode()).digest()
    for j in range(24):
        prev = hashlib.sha256(prev + j.to_bytes(4, "little")).digest()
        out.append(prev)
    return out

def items(hs):
    out, parent = [], b""
    for h in hs:
        out.append((b"M" + h, common_pb2.MLA_BLOCK, parent))
        parent = b"M" + h
    out.append((b"K" + hs[-1], common_pb2.KDA_CHECKPOINT, b""))
    return out

async def put_chain(c, hs, payload):
    try:  # where PutItem lives differs between trees
        from kvpool.kvstore.client.async_client import PutItem
    except ImportError:
        from kvpool.kvstore.client.records import PutItem
    kw = {"route": c.route_of(hs)} if hasattr(c, "route_of") else {}  # trees with master shards
    puts = [PutItem(key=k, data=payload, kind=kind, parent=p, **kw) for k, kind, p in items(hs)]
    res = await c.batch_put(puts)
    bad = [r for r in res if r is not None and type(r).__name__ not in ("ObjectNotAdmittedError",)]
    if bad:
        raise SystemExit(f"put failed: {bad[0]!r}")

async def main():
    payload = bytes(1024)
    async with AsyncStoreClient(master, transport="tcp") as c:
        if role == "preload":
            for i in range(chains):
                await put_chain(c, chain(i), payload)
            print(json.dumps({"preloaded": chains}))
            return
        rng = random.Random(seed)
        lat, end, n = [], time.monotonic() + seconds, 0
        async def worker(w):
            nonlocal n
            k = 0
            while time.monotonic() < end:
                t0 = time.perf_counter()
                if mode == "match_prefix":
                    r = await c.match_prefix(chain(rng.randrange(chains)), require_checkpoint=True)
                    assert r.usable_blocks == 24, r.usable_blocks
                else:
                    hs = chain(f"{seed}-{w}-{k}", salt="new")
                    k += 1
                    await c.match_prefix(hs, require_checkpoint=True)
                    await put_chain(c, hs, payload)
                lat.append(time.perf_counter() - t0)
                n += 1
        await asyncio.gather(*(worker(w) for w in range(in_flight)))
        print(json.dumps({"calls": n, "lat": sorted(lat)}))

asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Store:
    """One tree's master + storage node, started with the tree's own ``kvpool`` command."""

    def __init__(self, name: str, root: Path, shards: int = 1) -> None:
        self.name, self.root, self.shards = name, root, shards
        self.python = root / ".venv" / "bin" / "python"
        self.ports = [free_port() for _ in range(shards)]
        self.master = ";".join(f"127.0.0.1:{port}" for port in self.ports)
        self.dir = Path(tempfile.mkdtemp(prefix=f"master-load-{name}-"))
        self.procs: list[subprocess.Popen] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_CLUSTER_SECRET")}

    def _spawn(self, what: str, *args: str) -> subprocess.Popen:
        log = open(self.dir / f"{what}.log", "w")  # noqa: SIM115 - lives as long as the process
        cmd = [str(self.root / ".venv" / "bin" / "kvpool"), "store", what, *args]
        p = subprocess.Popen(cmd, cwd=self.root, stdout=subprocess.PIPE, stderr=log, env=self.env, text=True)
        self.procs.append(p)
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:  # the readiness line is the first stdout line
            line = p.stdout.readline() if p.stdout else ""
            if line.startswith('{"ready": true'):
                return p
            if p.poll() is not None:
                break
        raise SystemExit(f"{self.name}: `kvpool store {what}` did not become ready; see {self.dir}")

    def start(self) -> None:
        sharding = lambda i: ["--shards", str(self.shards), "--shard", str(i)] if self.shards > 1 else []  # noqa: E731
        self.master_procs = [
            self._spawn("master", "--port", str(port), *sharding(i)) for i, port in enumerate(self.ports)
        ]
        self._spawn(
            "node", "--master", self.master, "--capacity", "1GiB", "--transport", "tcp", "--no-prefault"
        )

    def clients(
        self, role: str, mode: str, n: int, seconds: float, in_flight: int, chains: int
    ) -> list[dict]:
        argv = [str(self.python), "-c", CLIENT, self.master, mode, str(seconds), str(in_flight), str(chains)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs = [
            subprocess.Popen([*argv, str(i), role], cwd=self.dir, env=self.env, **pipes) for i in range(n)
        ]
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=seconds + 120)
            if p.returncode != 0:
                raise SystemExit(f"{self.name}: client failed: {stderr[-2000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def measure(store: Store, mode: str, args: argparse.Namespace) -> dict:
    t0 = sum(cpu_s(p.pid) for p in store.master_procs)
    runs = store.clients("drive", mode, args.clients, args.seconds, args.in_flight, args.chains)
    cpu = sum(cpu_s(p.pid) for p in store.master_procs) - t0
    calls = sum(r["calls"] for r in runs)
    lat = sorted(x for r in runs for x in r["lat"])
    return {
        "calls": calls,
        "master_cpu_s": round(cpu, 3),
        "per_master_cpu_s": round(calls / max(cpu, 1e-9)),
        "p50_ms": round(1000 * lat[len(lat) // 2], 2),
        "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, default=None, help="a baseline tree with its own .venv")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--chains", type=int, default=400, help="preloaded chains of 25 objects")
    ap.add_argument("--rounds", type=int, default=2, help="each workload per tree, interleaved")
    ap.add_argument("--shards", type=int, default=1, help="also run this tree as N master shards")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    stores = [Store("after", here)]
    if args.shards > 1:
        stores.append(Store(f"after-{args.shards}sh", here, args.shards))
    if args.baseline is not None:
        stores.insert(0, Store("before", args.baseline.resolve()))
    cells: dict[str, dict[str, dict]] = {s.name: {} for s in stores}
    try:
        for s in stores:
            s.start()
            s.clients("preload", "-", 1, 0, 1, args.chains)
        for rnd in range(args.rounds):
            for mode in ("match_prefix", "write_cycle"):
                for s in stores if rnd % 2 == 0 else list(reversed(stores)):
                    cell = measure(s, mode, args)
                    best = cells[s.name].get(mode)
                    if best is None or cell["per_master_cpu_s"] > best["per_master_cpu_s"]:
                        cells[s.name][mode] = cell  # the best round: the least disturbed by the box
    finally:
        for s in stores:
            s.stop()
    print(f"{'tree':<10} {'workload':<14} {'calls':>8} {'/master cpu-s':>14} {'p50 ms':>8} {'p99 ms':>8}")
    for name, by_mode in cells.items():
        for mode, c in by_mode.items():
            print(f"{name:<10} {mode:<14} {c['calls']:>8} {c['per_master_cpu_s']:>14} {c['p50_ms']:>8} "
                  f"{c['p99_ms']:>8}")  # fmt: skip
    result: dict = {"cells": cells, "clients": args.clients, "in_flight": args.in_flight, "ratios": {}}
    if args.shards > 1:
        sharded = cells[f"after-{args.shards}sh"]
        for mode in ("match_prefix", "write_cycle"):
            ratio = sharded[mode]["per_master_cpu_s"] / cells["after"][mode]["per_master_cpu_s"]
            result["ratios"][f"{mode}_per_master_cpu_s_{args.shards}_shards_over_1"] = round(ratio, 3)
    if args.baseline is not None:
        result["ratios"] |= {
            f"{mode}_per_master_cpu_s_after_over_before": round(
                cells["after"][mode]["per_master_cpu_s"] / cells["before"][mode]["per_master_cpu_s"], 3
            )
            for mode in ("match_prefix", "write_cycle")
        }
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
