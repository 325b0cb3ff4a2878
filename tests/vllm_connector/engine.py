"""One vLLM engine process for the connector tests and the bench, driven by JSON lines on stdin.

Run with the vLLM venv's Python: ``python tests/vllm_connector/engine.py SPEC_JSON``. SPEC: ``model`` (a
directory), ``connector`` (``null`` for none, else ``{"role": ..., "master": ..., ...extra}``, or
``{"example": DIR}`` for vLLM's own disk ``ExampleConnector``, ``{"lmcache": PORT}`` for LMCache's
``LMCacheMPConnector`` and its server on that port), ``block_size``, ``dtype``, ``executor``
(vLLM's ``distributed_executor_backend``; "uni" with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is one process).
Once the engine is up it prints ``KVPOOL-ENGINE {"ready": ...}``, then answers each command line
``{"prompts": [[ids...]], "max_tokens": N, "salt": S}`` with one line ``KVPOOL-ENGINE {"outputs":
[{"tokens": [...], "cached": n}], "seconds": s}`` (greedy), until stdin closes. The marker keeps answers
apart from vLLM's own stdout logs.
"""

from __future__ import annotations

import json
import os
import sys
import time

MARK = "KVPOOL-ENGINE "  # our answer lines; vLLM logs on the same stdout


def build_llm(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    conn = spec.get("connector")
    if conn and "example" in conn:
        kv = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": conn["example"]},
        )
    elif conn and "lmcache" in conn:  # LMCache's multiprocess connector, its server at this port
        kv = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": conn["lmcache"],
            },
        )
    elif conn:
        extra = {k: v for k, v in conn.items() if k != "role"}
        kv = KVTransferConfig(
            kv_connector="KvpoolConnector",
            kv_connector_module_path="kvpool.integrations.vllm",
            kv_role=conn["role"],
            kv_connector_extra_config=extra,
        )
    return LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=spec.get("block_size", 64),
        max_model_len=spec.get("max_model_len", 4608),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 4608),
        enable_prefix_caching=spec.get("prefix_caching", False),
        kv_transfer_config=kv,
        distributed_executor_backend=spec.get("executor"),
        seed=0,
        dtype=spec.get("dtype", "float32"),
        disable_log_stats=not spec.get("log_stats", False),  # on: per-request first-token latency
    )


def run(llm, cmd: dict) -> dict:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8), ignore_eos=True)
    salt = cmd.get("salt")
    prompts = [
        TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {})) for p in cmd["prompts"]
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {
        "outputs": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "cached": o.num_cached_tokens or 0,
                "ttft": getattr(o.metrics, "first_token_latency", None),
            }
            for o in outs
        ],
        "seconds": seconds,
    }


def answer(obj: dict) -> None:
    """One marked line in one write(2): vLLM's threads log into the same stdout buffer, and a line built
    by print() from two buffered writes could get a log line between its JSON and its newline."""
    sys.stdout.flush()
    os.write(1, (MARK + json.dumps(obj) + "\n").encode())


def main() -> int:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    llm = build_llm(spec)
    answer({"ready": True, "start_s": time.perf_counter() - t0})
    for line in sys.stdin:
        if line.strip():
            answer(run(llm, json.loads(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
