"""The master's figures for the store bench: ``match_prefix`` latency over a 2,000-block chain and the
master's memory per indexed object. Processes are started as in ``store_ours`` (the project's CLIs, readiness
lines).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from store_common import HOST, MB, Plan, VerifyError, children, rss_bytes
from store_ours import start_master, start_node

CHAIN_BLOCKS = 2000
BLOCK_PAYLOAD = 256  # bytes per chain object: the latency test is about the index, not the data
MEMORY_CHUNK = 50_000  # objects per RegisterNode when filling the master (small messages, little garbage)


def hash_chain(n: int, seed: bytes = b"store-bench") -> list[bytes]:
    """``n`` chained 32-byte block hashes (each depends on the one before, as in overview §3)."""
    out: list[bytes] = []
    h = hashlib.sha256(seed).digest()
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h)
    return out


async def _measure_match_prefix(plan: Plan, master: str) -> dict[str, Any]:
    from kvpool.kvstore.client.async_client import AsyncStoreClient, PutItem
    from kvpool.kvstore.keys import kda_key, mla_key
    from kvpool.proto import common_pb2

    hashes = hash_chain(CHAIN_BLOCKS)
    payload = bytes(BLOCK_PAYLOAD)
    items: list[PutItem] = []
    parent = b""
    for h in hashes:
        key = mla_key(h)
        items.append(PutItem(key, payload, kind=common_pb2.MLA_BLOCK, parent=parent))
        parent = key
    items.append(PutItem(kda_key(hashes[-1]), payload, kind=common_pb2.KDA_CHECKPOINT, parent=parent))
    calls = 50 if plan.quick else 500

    async def timed(client: AsyncStoreClient, chain: list[bytes], require_checkpoint: bool) -> list[float]:
        """Per-call seconds of the shipped client's ``match_prefix`` (the master wire), after 10 warm-ups;
        every reply is checked against the chain that was put."""
        out: list[float] = []
        for i in range(10 + calls):
            t0 = time.perf_counter()
            reply = await client.match_prefix(chain, require_checkpoint=require_checkpoint)
            dt = time.perf_counter() - t0
            n = len(chain)
            if reply.usable_blocks != n or reply.mla_run_blocks != n or len(reply.mla) != n:
                raise VerifyError(
                    f"match_prefix returned usable={reply.usable_blocks} run={reply.mla_run_blocks} "
                    f"locations={len(reply.mla)}, expected {n}"
                )
            sizes = sum(loc.meta.size for loc in reply.mla)
            if reply.mla[-1].meta.key != items[n - 1].key or sizes != n * BLOCK_PAYLOAD:
                raise VerifyError("match_prefix locations do not match the chain that was put")
            if i >= 10:
                out.append(dt)
        return out

    async with AsyncStoreClient(master, transport="tcp", rpc_timeout_s=30) as client:
        for lo in range(0, len(items), 250):
            errors = [e for e in await client.batch_put(items[lo : lo + 250]) if e is not None]
            if errors:
                raise RuntimeError(f"inserting the chain failed: {errors[0]}")
        times = await timed(client, hashes, require_checkpoint=True)
        # the same call for a 1-block chain: the wire + client floor, to tell chain cost from call cost
        floor = await timed(client, hashes[:1], require_checkpoint=False)
    times.sort()
    return {
        "chain_blocks": CHAIN_BLOCKS,
        "calls": calls,
        "usable_blocks": CHAIN_BLOCKS,
        "one_block_p50_ms": round(statistics.median(floor) * 1e3, 3),
        "locations": "one ObjectLocation per block (the one MatchPrefix reply)",
        "p50_ms": round(statistics.median(times) * 1e3, 3),
        "channel": "master wire",
        "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3, 3),
        "min_ms": round(times[0] * 1e3, 3),
        "require_checkpoint": True,
    }


def section_match_prefix(plan: Plan) -> dict[str, Any]:
    """``MatchPrefix`` through the store client (master wire) on a committed 2,000-block chain (+ checkpoint
    at its end)."""
    with children() as procs, tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        log_dir = Path(tmp)
        master, _ = start_master(procs, log_dir)
        start_node(procs, log_dir, master, 64 * MB, "tcp")
        res = asyncio.run(_measure_match_prefix(plan, master))
    return {"rows": [], "match_prefix": res}


def _fake_inventory(start: int, count: int) -> list[Any]:
    """``count`` MLA-block metas in chains of 1,000 (realistic 33-byte keys with parent links)."""
    from kvpool.kvstore.keys import mla_key
    from kvpool.proto import common_pb2

    metas = []
    parent = b""
    for i in range(start, start + count):
        key = mla_key(hashlib.sha256(i.to_bytes(8, "little")).digest())
        if i % 1000 == 0:
            parent = b""
        metas.append(
            common_pb2.ObjectMeta(key=key, kind=common_pb2.MLA_BLOCK, size=1 << 20, checksum=i, parent=parent)
        )
        parent = key
    return metas


def _settled_rss(pid: int, master: str) -> int:
    """RSS once it stops moving (the master frees request garbage asynchronously)."""
    from kvpool.kvstore.protocol.master_wire import call_blocking
    from kvpool.proto import master_pb2

    call_blocking(master, "Stats", master_pb2.StatsRequest(), timeout_s=30)
    last = rss_bytes(pid)
    for _ in range(20):
        time.sleep(0.25)
        now = rss_bytes(pid)
        if abs(now - last) < 256 * 1024:
            return now
        last = now
    return last


def _measure_master_memory(objects: int, master: str, pid: int) -> dict[str, Any]:
    """Fill the master through RegisterNode inventories (the recovery path) and read its RSS delta.

    Fake nodes never heartbeat, so the master runs with a long node timeout; they offer far more
    capacity than the objects take, so nothing is evicted while measuring.
    """
    from kvpool.kvstore.protocol.master_wire import call_blocking
    from kvpool.proto import common_pb2, master_pb2

    before = _settled_rss(pid, master)
    done = 0
    node = 0
    while done < objects:
        count = min(MEMORY_CHUNK, objects - done)
        inventory = _fake_inventory(done, count)
        ep = common_pb2.NodeEndpoint(
            node_id=f"bench-fake-{node}", host=HOST, grpc_port=1, tcp_port=1, host_id="bench-fake"
        )
        req = master_pb2.RegisterNodeRequest(node=ep, dram_capacity_bytes=1 << 50, inventory=inventory)
        reply = call_blocking(master, "RegisterNode", req, timeout_s=300)
        if reply.adopted_objects != count:
            raise VerifyError(f"master adopted {reply.adopted_objects} of {count} objects")
        del inventory, req
        done += count
        node += 1
    gc.collect()
    stats = call_blocking(master, "Stats", master_pb2.StatsRequest(), timeout_s=30)
    if stats.objects < objects:
        raise VerifyError(f"master indexes {stats.objects} objects, expected {objects}")
    after = _settled_rss(pid, master)
    trims = call_blocking(master, "Stats", master_pb2.StatsRequest(), timeout_s=30).counters.get(
        "heap_trims", 0
    )
    return {
        "objects": objects,
        "fake_nodes": node,
        "method": "RegisterNode inventories over the master wire, RSS delta",
        "rss_before_mb": round(before / MB, 1),
        "rss_after_mb": round(after / MB, 1),
        "bytes_per_object": round((after - before) / objects, 1),
        "heap_trims": trims,  # a bulk load's freed memory went back to the OS (release_free_heap)
    }


def _master_process_memory(objects: int) -> dict[str, Any]:
    with children() as procs, tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        master, pid = start_master(
            procs, Path(tmp), "--node-timeout-ms", "3600000", "--heartbeat-ms", "600000"
        )
        return _measure_master_memory(objects, master, pid)


def section_master_memory(plan: Plan) -> dict[str, Any]:
    """Master resident memory per indexed object with ``plan.objects`` objects (default 1 M).

    Two measurements, and the goal is judged on the larger: the whole master process (RegisterNode
    inventories into a real ``kvpool store master``, RSS delta: wire, protobuf and allocator overhead
    included, the way a restarted master re-indexes its nodes) and, when ``bench/master_bench.py`` is
    there, its ``bench_memory`` (the index filled by one-by-one inserts in a fresh process, the way puts
    build it). Either one over the budget fails the goal.
    """
    try:
        import master_bench
    except ImportError:
        master_bench = None
    process = _master_process_memory(plan.objects)
    if master_bench is None or not hasattr(master_bench, "bench_memory"):
        return {"rows": [], "master_memory": process}
    mb = master_bench.bench_memory(plan.objects, CHAIN_BLOCKS, 10)
    index_alone = mb["rss_bytes_per_object"]
    res = {
        "objects": mb["objects"],
        "bytes_per_object": max(index_alone, process["bytes_per_object"]),
        "method": "the larger of: whole master process fed RegisterNode inventories (master_process), and "
        "bench/master_bench.py bench_memory, PrefixIndex filled by inserts in a fresh process (index_alone)",
        "index_alone_bytes_per_object": index_alone,
        "index_alone_by_structure": mb.get("bytes_per_object_by_structure"),
        "insert_us_per_object": mb.get("insert_us_per_object"),
        "master_process": process,
    }
    return {"rows": [], "master_memory": res}
