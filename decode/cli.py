"""``kvpool decode``: run a decode worker (gRPC ``kvpool.v1.Decode`` + health) on the shared store.

``--colocated`` serves ``kvpool.v1.Prefill`` from the same process too (one model thread, one store
client): the colocated deployment, with the handoff still going through the store.
"""

from __future__ import annotations

import argparse
import asyncio

from kvpool.prefill.cli import add_prefill_args
from kvpool.prefill.worker import add_common_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("decode", help="run a decode worker (--colocated: prefill too)")
    add_common_args(p)
    p.add_argument("--max-batch", type=int, default=64, help="requests per batched decode step")
    p.add_argument(
        "--no-end-checkpoint", action="store_true", help="do not push the end-of-output KDA checkpoint"
    )
    p.add_argument("--colocated", action="store_true", help="also serve the Prefill service")
    add_prefill_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpool.prefill.worker import serve

    return asyncio.run(serve(args, ("prefill", "decode") if args.colocated else ("decode",)))
