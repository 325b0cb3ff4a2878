"""``kvpool prefill``: run a prefill worker (gRPC ``kvpool.v1.Prefill`` + health) on the shared store."""

from __future__ import annotations

import argparse
import asyncio

from kvpool.prefill.worker import add_common_args


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint-policy",
        default="end,junction",
        help="comma list of end | junction | every=N, or none (docs/design/checkpoint_policy.md)",
    )
    p.add_argument("--tail-ttl-ms", type=int, default=120_000, help="TTL of request tails in the store")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefill", help="run a prefill worker")
    add_common_args(p)
    add_prefill_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpool.prefill.worker import serve

    return asyncio.run(serve(args, ("prefill",)))
