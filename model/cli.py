"""``kvpool generate``: greedy decoding from the command line on the tiny model or a checkpoint directory.

Prints the text, or with ``--json`` one object ``{"prompt_ids", "output_ids", "text", ...}``; bad input exits
with status 2 and a one-line ``error:`` message (no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .errors import ModelError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="greedy generation with the hybrid model")
    p.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (embedded default), 'tiny8', 'tiny-dsa', 'tiny-dsa-fp8' or a Kimi-Linear checkpoint dir",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with tokenizer.json or the byte fallback)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens to generate")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights' dtype on the device")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the eos token")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_generate)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ModelError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def run_generate(args: argparse.Namespace) -> int:
    from .loader import load_model
    from .tokenizer import load_tokenizer

    try:
        model = load_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
        tok = load_tokenizer(args.model, model.config)
        prompt_ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else tok.encode(args.prompt)
        t0 = time.perf_counter()
        out = model.generate(prompt_ids, args.max_tokens, eos_ids=() if args.ignore_eos else None)
        elapsed = time.perf_counter() - t0
    except (ModelError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = tok.decode(out)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(args.model),
                    "fingerprint": model.fingerprint().hex(),
                    "device": str(model.device),
                    "prompt_ids": prompt_ids,
                    "output_ids": out,
                    "text": text,
                    "seconds": round(elapsed, 4),
                }
            )
        )
    else:
        print(text)
    return 0
