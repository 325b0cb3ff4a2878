"""kvpool's own data paths for the store bench: put/get per transport (auth on and off) and the prefill push.

The master's own figures (``match_prefix`` latency, memory per indexed object) are in ``store_ours_master``.

Everything runs against real processes started through the project's CLIs (``kvpool store master`` and
``kvpool store node``), waiting on their JSON readiness lines, with the bench process as the client
(``kvpool.kvstore.client.async_client.AsyncStoreClient`` with the transport forced, so an unusable transport
is an error, not a silent fallback to another one). Timing and verification follow ``store_common``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvpool.kvstore.protocol.shm_segment import MAPPER_THREAD
from kvpool.runtime.spawn import spawn
from store_common import (
    HOST,
    MB,
    Plan,
    Row,
    VerifyError,
    atime_reps,
    check_equal,
    children,
    gbps,
    make_payload,
    stamp,
)

READY_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------------ processes


def _entry(args: list[str]) -> list[str]:
    """Module + argv for ``kvpool store ...``: the store-only entry when present (it skips the torch import
    of the full CLI, which would inflate the master's baseline RSS and startup time)."""
    try:
        from kvpool.kvstore import cli as store_cli
    except ImportError:
        store_cli = None
    if store_cli is not None and hasattr(store_cli, "main") and args[:1] == ["store"]:
        return ["kvpool.kvstore.cli", *args[1:]]
    return ["kvpool", *args]


def _spawn(
    procs: list[subprocess.Popen[Any]],
    args: list[str],
    log_dir: Path,
    name: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start ``python -m kvpool ARGS`` through the one spawner and return its readiness record."""
    child = spawn(name, _entry(args), log_dir, READY_TIMEOUT_S, env=env)
    procs.append(child.popen)
    return {**child.ready, "pid": child.pid}


def start_master(
    procs: list[subprocess.Popen[Any]], log_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[str, int]:
    """A ``kvpool store master`` on a free port; returns (address, pid)."""
    args = ["store", "master", "--host", HOST, "--port", "0", "--log-level", "WARNING", *extra]
    ready = _spawn(procs, args, log_dir, "master", env)
    return f"{ready.get('host', HOST)}:{ready['port']}", int(ready["pid"])


def start_node(
    procs: list[subprocess.Popen[Any]],
    log_dir: Path,
    master: str,
    capacity: int,
    transports: str,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A ``kvpool store node`` registered with ``master`` (its readiness line comes after registration)."""
    return _spawn(
        procs,
        [
            "store",
            "node",
            "--master",
            master,
            "--host",
            HOST,
            "--capacity",
            str(capacity),
            "--transport",
            transports,
        ],
        log_dir,
        "node",
        env,
    )


# ------------------------------------------------------------------------------------ put/get per transport


async def _map_pools(client: Any) -> None:
    """shm: let the client finish mapping the node's pool before anything is timed. A same-host client maps
    the whole pool once, in a background thread (~0.3 ms per MB here); timing puts while that thread still
    runs would charge a once-per-process cost to the first few dozen puts."""
    shm = client.transports.backends.get("shm")
    if shm is None:
        return
    await client.put(b"bench/map-warmup", b"x" * 64)
    # the threads ReaderMapping maps attached segments in (one per segment)
    mappers = [t for t in threading.enumerate() if t.name == MAPPER_THREAD]
    await asyncio.to_thread(lambda: [t.join(60.0) for t in mappers])
    await client.remove([b"bench/map-warmup"])


def _capacity_for(plan: Plan) -> int:
    """Pool big enough for every object of the largest size at once (each size is removed afterwards)."""
    largest = max(s * MB * (plan.reps_for(s) + plan.warmup) for s in plan.sizes_mb)
    return max(256 * MB, int(largest * 1.5) + 64 * MB)


async def _measure_transport(plan: Plan, master: str, transport: str, row_id: str = "") -> Row:
    from kvpool.kvstore.client.async_client import AsyncStoreClient

    note = "master + storage node processes, AsyncStoreClient"
    row = Row(row_id or transport, f"kvpool {row_id or transport}", note=note)
    async with AsyncStoreClient(master, transport=transport) as client:
        await _map_pools(client)
        for size in plan.sizes_mb:
            n = size * MB
            reps = plan.reps_for(size)
            src = make_payload(n)
            back = np.zeros(n, dtype=np.uint8)
            keys = [f"bench/{transport}/{size}/{i}".encode() for i in range(plan.warmup + reps)]

            def put_prep(i: int, src: np.ndarray = src) -> None:
                stamp(src, i)

            async def put_op(i: int, src: np.ndarray = src, keys: list[bytes] = keys) -> None:
                if not await client.put(keys[i], src):
                    raise VerifyError(f"put of fresh key {keys[i]!r} reported an existing object")

            async def put_verify(
                i: int, n: int = n, src: np.ndarray = src, back: np.ndarray = back, keys: list[bytes] = keys
            ) -> None:
                back[:8] = 0
                if await client.get_into(keys[i], back) != n:
                    raise VerifyError("read-back size mismatch")
                check_equal(back, src, f"{transport} put")

            row.put[size] = gbps(n, await atime_reps(put_op, put_verify, plan.warmup, reps, put_prep))

            dst = np.zeros(n, dtype=np.uint8)

            def get_prep(i: int, dst: np.ndarray = dst) -> None:
                dst[:8] = 0
                dst[-8:] = 0

            async def get_op(i: int, n: int = n, dst: np.ndarray = dst, keys: list[bytes] = keys) -> None:
                if await client.get_into(keys[i], dst) != n:
                    raise VerifyError("get size mismatch")

            def get_verify(i: int, src: np.ndarray = src, dst: np.ndarray = dst) -> None:
                stamp(src, i)
                check_equal(dst, src, f"{transport} get")

            row.get[size] = gbps(n, await atime_reps(get_op, get_verify, plan.warmup, reps, get_prep))
            await client.remove(keys)
            await asyncio.sleep(0.2)  # let the master's delete orders reach the node before the next size
    return row


def _transport_section(plan: Plan, transport: str, auth: bool = False) -> dict[str, Any]:
    """One transport's row; ``auth``: master and node require a cluster secret and this client holds it
    (every gRPC call carries the token, every connection starts with the hello)."""
    from kvpool.runtime import cluster_auth

    key = cluster_auth.new_secret() if auth else None
    env = {cluster_auth.ENV_VALUE: key} if key else None
    cluster_auth.configure(key.encode() if key else None)
    with children() as procs, tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        log_dir = Path(tmp)
        master, _ = start_master(procs, log_dir, env=env)
        planes = "tcp,shm,ucx" if transport == "ucx" else "tcp,shm"  # ucxx only where it is measured
        start_node(procs, log_dir, master, _capacity_for(plan), planes, env)
        row_id = f"{transport}_auth" if auth else transport
        row = asyncio.run(_measure_transport(plan, master, transport, row_id))
    return {"rows": [row.to_json()]}


def section_tcp(plan: Plan) -> dict[str, Any]:
    """kvpool over its asyncio TCP data plane."""
    return _transport_section(plan, "tcp")


def section_shm(plan: Plan) -> dict[str, Any]:
    """kvpool's same-host path straight into/out of the node's shared-memory pool."""
    return _transport_section(plan, "shm")


def section_tcp_auth(plan: Plan) -> dict[str, Any]:
    """kvpool tcp with a cluster secret (the auth overhead, against the ``tcp`` row of the same run)."""
    return _transport_section(plan, "tcp", auth=True)


def section_shm_auth(plan: Plan) -> dict[str, Any]:
    """kvpool shm with a cluster secret: its control frames go over the authenticated tcp connection."""
    return _transport_section(plan, "shm", auth=True)


def section_ucx(plan: Plan) -> dict[str, Any]:
    """kvpool over ucxx (tcp/sm on this host: no RDMA in pip's UCX)."""
    return _transport_section(plan, "ucx")


# ------------------------------------------------------------------------------------------ prefill push

# One K3 request's push (overview §7.5): 24 MLA blocks of 14.2 MB (512 tokens x 27,648 B) and one KDA
# checkpoint of 428.6 MiB. Scaled by KVPOOL_BENCH_PUSH_SCALE (default 1/4: 3.5 MB blocks + a 107 MiB
# checkpoint, 192 MiB in all, so that three rounds of three transports fit this box's memory next to the
# node's pool); the shape, 24 small objects and one 30x larger one, is kept.
PUSH_BLOCKS = 24
PUSH_BLOCK_BYTES = 512 * 27_648
PUSH_CKPT_BYTES = 449_372_160


def push_scale() -> float:
    return float(os.environ.get("KVPOOL_BENCH_PUSH_SCALE", "0.25"))


async def _measure_push(master: str, transport: str, reps: int, warmup: int) -> dict[str, float]:
    """GB/s of one request's whole push: ``batch_put`` (one control exchange each way, pipelined per node)
    against the same objects put one after another (two master round trips each)."""
    from kvpool.kvstore.client.async_client import AsyncStoreClient, PutItem
    from kvpool.kvstore.keys import kda_key, mla_key
    from kvpool.proto import common_pb2

    scale = push_scale()
    sizes = [int(PUSH_BLOCK_BYTES * scale)] * PUSH_BLOCKS + [int(PUSH_CKPT_BYTES * scale)]
    payloads = [make_payload(n, seed=i) for i, n in enumerate(sizes)]
    total = sum(sizes)
    out: dict[str, float] = {}
    async with AsyncStoreClient(master, transport=transport) as client:
        await _map_pools(client)
        for mode in ("batch", "sequential"):
            times = []
            for rep in range(warmup + reps):
                names = [
                    hashlib.sha256(f"push/{transport}/{mode}/{rep}/{i}".encode()).digest()
                    for i in range(len(sizes))
                ]
                keys = [mla_key(h) for h in names[:-1]] + [kda_key(names[-1])]
                kinds = [common_pb2.MLA_BLOCK] * PUSH_BLOCKS + [common_pb2.KDA_CHECKPOINT]
                items = [PutItem(k, p, kind) for k, p, kind in zip(keys, payloads, kinds, strict=True)]
                t0 = time.perf_counter()
                if mode == "batch":
                    errors = [e for e in await client.batch_put(items) if e is not None]
                    if errors:
                        raise VerifyError(f"push: {errors[0]!r}")
                else:
                    for item in items:
                        await client.put(item.key, item.data, kind=item.kind)
                dt = time.perf_counter() - t0
                back = await client.get(keys[-1])
                check_equal(np.frombuffer(back, dtype=np.uint8), payloads[-1], f"{transport} push")
                await client.remove(keys)
                await asyncio.sleep(0.2)
                if rep >= warmup:
                    times.append(dt)
            out[mode] = gbps(total, statistics.median(times))
        if transport != "ucx":  # from the worker's tensors: units assembled first vs put as parts
            import store_push_tensors  # torch: only this section pays for importing it

            out.update(await store_push_tensors.measure(client, transport, push_scale(), reps, warmup))
    return out


def section_push(plan: Plan) -> dict[str, Any]:
    """One prefill's whole push (K3-shaped, scaled) per transport, batched vs object by object."""
    scale = push_scale()
    total = int((PUSH_BLOCKS * PUSH_BLOCK_BYTES + PUSH_CKPT_BYTES) * scale)
    reps, warmup = (1, 1) if plan.quick else (3, 1)
    result: dict[str, Any] = {"scale": scale, "objects": PUSH_BLOCKS + 1, "bytes": total, "gbps": {}}
    for transport in ("shm", "tcp", "ucx"):
        with children() as procs, tempfile.TemporaryDirectory(prefix="store-bench-push-") as tmp:
            log_dir = Path(tmp)
            master_addr, _ = start_master(procs, log_dir)
            planes = "tcp,shm,ucx" if transport == "ucx" else "tcp,shm"
            start_node(procs, log_dir, master_addr, 2 * total + 64 * MB, planes)
            result["gbps"][transport] = asyncio.run(_measure_push(master_addr, transport, reps, warmup))
    return {"rows": [], "push": result}
