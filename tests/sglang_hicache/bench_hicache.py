"""Time per page: ``KvpoolHiCacheStorage`` vs SGLang's ``HiCacheFile`` on tmpfs, driven as SGLang's cache
controller drives them (``cache_controller.py``: ``_generic_page_set`` / ``_generic_page_get`` /
``_page_set_zero_copy`` / ``_page_get_zero_copy`` and ``_storage_hit_query``'s ``batch_exists``).

    KVPOOL_VLLM_TESTS=1 .venv-vllm/bin/python -m tests.sglang_hicache.bench_hicache [--pages 32] [--rounds 7]

A kvpool master and one storage node (shm transport, same host) as real processes; HiCacheFile in a
directory under /dev/shm. Pages of 64 tokens x 8,064 B (Kimi-Linear-48B's MLA bytes per token: 7 x 576
bf16 here) = 504 KiB. Writes use new keys each round (both backends skip a page they already hold). Rounds
alternate between the backends; ``store batch_put (no backend)`` is kvpool's store client putting the same
pages with no backend around it (the floor of any kvpool write path). The median round is reported, in
microseconds per page. Torch runs one intra-op thread (see ``main``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kvpool.kvstore.client.async_client import PutItem
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from tests.harness.store_procs import start_master, start_node
from tests.sglang_hicache.conftest import storage_config
from tests.sglang_hicache.host_pools import CpuMLAHostPool

PAGE = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=32, help="pages per call (SGLang batches up to 128)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layout", default="page_first")
    args = ap.parse_args()
    # one intra-op thread, as in SGLang's storage IO threads: on a busy 2-core box torch's thread pool
    # turns a 0.5 MB page copy into ~16 ms of waiting (both backends' generic paths copy pages with torch)
    torch.set_num_threads(1)
    n = args.pages
    work = Path(tempfile.mkdtemp(prefix="hicache-bench-"))
    files = Path(tempfile.mkdtemp(prefix="hicache-bench-file-", dir="/dev/shm"))
    master = start_master(work)
    node = start_node(work, master.address, "1GiB", "tcp,shm")  # prefaulted, as a serving node
    try:
        pool = CpuMLAHostPool(layers=7, dim=576, page_size=PAGE, pages=2 * n, layout=args.layout)
        for i in range(n):
            pool.fill(i * PAGE, i)
        cfg = storage_config(master.address, files, "bench", salt="bench")
        backends = {}
        for name, kind in (("kvpool", "dynamic"), ("file", "file")):
            b = StorageBackendFactory.create_backend(kind, cfg, pool)
            b.register_mem_pool_host(pool)
            backends[name] = b
        src_idx = torch.arange(n * PAGE)
        dst_idx = torch.arange(n * PAGE, 2 * n * PAGE)
        times: dict[str, list[float]] = {}

        def timed(label: str, fn) -> None:
            t0 = time.perf_counter()
            ok = fn()
            dt = time.perf_counter() - t0
            assert ok, label
            times.setdefault(label, []).append(dt / n * 1e6)

        for r in range(args.rounds + 1):  # round 0 warms up (connections, page faults)
            tokens = torch.randint(
                0, 50_000, (n * PAGE,), generator=torch.Generator().manual_seed(r)
            ).tolist()
            keys = get_storage_hash_str(tokens, None, page_size=PAGE)
            for name, b in backends.items():
                k = [f"{name}-{x}" for x in keys]  # each backend its own keys (both share the salt-less file)

                def generic_set(b=b, k=k):
                    return b.batch_set(k, [pool.get_data_page(i * PAGE) for i in range(n)])

                def generic_get(b=b, k=k):
                    pages = b.batch_get(k, [pool.get_dummy_flat_data_page() for _ in range(n)])
                    for i, p in enumerate(pages):
                        if p is None:
                            return False
                        pool.set_from_flat_data_page(n * PAGE + i * PAGE, p)
                    return True

                timed(f"{name} generic set", generic_set)
                timed(f"{name} exists", lambda b=b, k=k: b.batch_exists(k) == n)
                timed(f"{name} generic get", generic_get)
                if name == "kvpool":
                    raw = [
                        PutItem(f"raw-{x}".encode(), pool.get_data_page(i * PAGE)) for i, x in enumerate(keys)
                    ]
                    timed(
                        "store batch_put (no backend)",
                        lambda b=b, raw=raw: b.store.batch_put(raw) == [None] * n,
                    )
                    k1 = [f"v1-{x}" for x in keys]
                    timed("kvpool v1 set", lambda b=b, k1=k1: all(b.batch_set_v1(k1, src_idx)))
                    timed("kvpool v1 get", lambda b=b, k1=k1: all(b.batch_get_v1(k1, dst_idx)))
            if r == 0:
                times.clear()
        med = {label: statistics.median(v) for label, v in times.items()}
        out = {
            "pages_per_call": n,
            "page_bytes": pool.get_dummy_flat_data_page().numel() * 2,
            "layout": args.layout,
            "rounds": args.rounds,
            "us_per_page_median": {k: round(v, 1) for k, v in sorted(med.items())},
            "ratio_vs_file": {
                "generic set": round(med["kvpool generic set"] / med["file generic set"], 2),
                "generic get": round(med["kvpool generic get"] / med["file generic get"], 2),
                "v1 set (vs file generic set)": round(med["kvpool v1 set"] / med["file generic set"], 2),
                "v1 get (vs file generic get)": round(med["kvpool v1 get"] / med["file generic get"], 2),
                "exists": round(med["kvpool exists"] / med["file exists"], 2),
            },
        }
        print(json.dumps(out, indent=1))
        for b in backends.values():
            if hasattr(b, "close"):
                b.close()
    finally:
        node.stop()
        master.stop()
        shutil.rmtree(files, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
