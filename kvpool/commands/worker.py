"""``kvpool prefill`` / ``kvpool decode``: assemble a worker process from the prefill and decode engines.

Why here and not in ``prefill/`` or ``decode/``: a colocated worker (``kvpool decode --colocated``) serves
both contracts from one process (one model thread, one store client), so the assembly is the one place that
knows both engines; ``prefill`` and ``decode`` stay independent of each other and share only
``kvpool.worker``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from kvpool.decode.batcher import StepBatcher
from kvpool.decode.engine import DecodeEngine
from kvpool.decode.metrics import DecodeMetrics
from kvpool.decode.server import SERVICE_NAME as DECODE_SERVICE
from kvpool.decode.server import DecodeService
from kvpool.prefill.engine import PrefillEngine
from kvpool.prefill.metrics import PrefillMetrics
from kvpool.prefill.server import SERVICE_NAME as PREFILL_SERVICE
from kvpool.prefill.server import PrefillService
from kvpool.proto import decode_pb2_grpc, prefill_pb2_grpc
from kvpool.runtime.grpc_server import GrpcServer
from kvpool.runtime.metrics_http import MetricsHttpServer
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.worker.metrics import worker_registry
from kvpool.worker.model_runner import ModelRunner
from kvpool.worker.process import (
    add_common_args,
    add_prefill_args,
    build_runtime,
    ready_fields,
    serve_worker,
    store_refusal,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prefill", help="run a prefill worker")
    add_common_args(p)
    add_prefill_args(p)
    p.set_defaults(func=lambda args: asyncio.run(serve(args, ("prefill",))))
    d = subparsers.add_parser("decode", help="run a decode worker (--colocated: prefill too)")
    add_common_args(d)
    d.add_argument("--max-batch", type=int, default=64, help="requests per batched decode step")
    d.add_argument(
        "--no-end-checkpoint", action="store_true", help="do not push the end-of-output KDA checkpoint"
    )
    d.add_argument("--colocated", action="store_true", help="also serve the Prefill service")
    add_prefill_args(d)
    d.set_defaults(
        func=lambda args: asyncio.run(serve(args, ("prefill", "decode") if args.colocated else ("decode",)))
    )


class WorkerMetrics:
    """The registry of one worker process; ``prefill`` / ``decode`` present for the roles it serves."""

    def __init__(self, roles: tuple[str, ...], info: dict[str, str] | None = None) -> None:
        self.registry: CollectorRegistry = worker_registry(roles, info)
        self.prefill = PrefillMetrics(self.registry) if "prefill" in roles else None
        self.decode = DecodeMetrics(self.registry) if "decode" in roles else None


async def serve(args: argparse.Namespace, roles: tuple[str, ...]) -> int:
    """Run the engines for ``roles`` ("prefill", "decode" or both = colocated) behind one gRPC server, one
    model thread and one store client; returns the exit code."""
    try:
        policy = CheckpointPolicy.parse(args.checkpoint_policy) if "prefill" in roles else None
        rt = build_runtime(args)
    except (ValueError, OSError) as exc:  # bad --model / --block-size / policy: a message, not a traceback
        print(f"kvpool {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    refused = await store_refusal(rt.store)
    if refused is not None and rt.store is not None:  # no or another secret: say so, never miss mutely
        print(f"kvpool {args.command}: the store refused this worker: {refused}", file=sys.stderr)
        await rt.store.close()
        return 2
    runner = ModelRunner(rt.model)
    metrics_on = args.metrics_port is not None and args.metrics_port >= 0
    metrics = WorkerMetrics(roles, {"model": args.model}) if metrics_on else None
    services: dict[str, Callable[[grpc.aio.Server], None]] = {}
    prefill: PrefillService | None = None
    decode: DecodeService | None = None
    if "prefill" in roles:
        prefill = PrefillService(
            PrefillEngine(
                runner,
                rt.store,
                block_size=args.block_size,
                policy=policy,
                tokenizer=rt.tokenizer,
                tail_ttl_ms=args.tail_ttl_ms,
                timeout_s=args.store_timeout,
                on_cache_error=args.on_cache_error,
            ),
            args.request_timeout,
            metrics.prefill if metrics else None,
        )
        services[PREFILL_SERVICE] = lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(prefill, s)
    if "decode" in roles:
        decode = DecodeService(
            DecodeEngine(
                runner,
                rt.store,
                block_size=args.block_size,
                tokenizer=rt.tokenizer,
                end_of_output_checkpoint=not args.no_end_checkpoint,
                timeout_s=args.store_timeout,
                on_cache_error=args.on_cache_error,
                batcher=StepBatcher(runner, args.max_batch),
            ),
            args.request_timeout,
            metrics.decode if metrics else None,
        )
        services[DECODE_SERVICE] = lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(decode, s)

    async def close() -> None:
        for service in (prefill, decode):  # deferred releases / tail removals end before the store closes
            if service is not None:
                await service.engine.deferred.drain()
        if rt.store is not None:
            await rt.store.close()
        runner.close()

    server = GrpcServer(services, args.host, args.port)
    http = MetricsHttpServer(metrics.registry, args.host, args.metrics_port) if metrics else None
    return await serve_worker(server, ready_fields("+".join(roles), args, rt.model), close, http)
