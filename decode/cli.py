"""``kvpool decode``: run a decode worker (gRPC ``kvpool.v1.Decode`` + health) on the shared store."""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvpool.prefill.worker import add_common_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("decode", help="run a decode worker")
    add_common_args(p)
    p.add_argument("--max-batch", type=int, default=64, help="requests per batched decode step")
    p.add_argument(
        "--no-end-checkpoint", action="store_true", help="do not push the end-of-output KDA checkpoint"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from kvpool.decode.batcher import StepBatcher
    from kvpool.decode.engine import DecodeEngine
    from kvpool.decode.server import SERVICE_NAME, DecodeService
    from kvpool.prefill.model_runner import ModelRunner
    from kvpool.prefill.worker import WorkerServer, build_runtime, ready_fields, serve_until_signal
    from kvpool.proto import decode_pb2_grpc

    try:
        rt = build_runtime(args)
    except (ValueError, OSError) as exc:  # bad --model / --block-size: a clear message, not a traceback
        print(f"kvpool {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    runner = ModelRunner(rt.model)
    engine = DecodeEngine(
        runner,
        rt.store,
        block_size=args.block_size,
        tokenizer=rt.tokenizer,
        end_of_output_checkpoint=not args.no_end_checkpoint,
        timeout_s=args.store_timeout,
        on_cache_error=args.on_cache_error,
        batcher=StepBatcher(runner, args.max_batch),
    )
    service = DecodeService(engine, args.request_timeout)
    server = WorkerServer(
        SERVICE_NAME, lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(service, s), args.host, args.port
    )

    async def close() -> None:
        if rt.store is not None:
            await rt.store.close()
        runner.close()

    return await serve_until_signal(server, ready_fields("decode", args, rt.model), close)
