"""``kvpool prefill``: run a prefill worker (gRPC ``kvpool.v1.Prefill`` + health) on the shared store."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvpool.prefill.worker import add_common_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefill", help="run a prefill worker")
    add_common_args(p)
    p.add_argument(
        "--checkpoint-policy",
        default="end,junction",
        help="comma list of end | junction | every=N, or none (docs/design/checkpoint_policy.md)",
    )
    p.add_argument("--tail-ttl-ms", type=int, default=120_000, help="TTL of request tails in the store")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpool.prefill.policy import CheckpointPolicy

    try:
        policy = CheckpointPolicy.parse(args.checkpoint_policy)
    except ValueError as exc:
        print(f"kvpool prefill: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, policy))


async def _serve(args: argparse.Namespace, policy: object) -> int:
    from kvpool.prefill.engine import PrefillEngine
    from kvpool.prefill.model_runner import ModelRunner
    from kvpool.prefill.server import SERVICE_NAME, PrefillService
    from kvpool.prefill.worker import WorkerServer, build_runtime, ready_fields, serve_until_signal
    from kvpool.proto import prefill_pb2_grpc

    try:
        rt = build_runtime(args)
    except (ValueError, OSError) as exc:  # bad --model / --block-size: a clear message, not a traceback
        print(f"kvpool {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    runner = ModelRunner(rt.model)
    engine = PrefillEngine(
        runner,
        rt.store,
        block_size=args.block_size,
        policy=policy,  # type: ignore[arg-type]
        tail_ttl_ms=args.tail_ttl_ms,
        timeout_s=args.store_timeout,
        on_cache_error=args.on_cache_error,
    )
    service = PrefillService(engine, args.request_timeout)
    server = WorkerServer(
        SERVICE_NAME,
        lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(service, s),
        args.host,
        args.port,
    )

    async def close() -> None:
        if rt.store is not None:
            await rt.store.close()
        runner.close()

    return await serve_until_signal(server, ready_fields("prefill", args, rt.model), close)
