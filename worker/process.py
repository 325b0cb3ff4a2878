"""What the prefill and decode worker processes share: CLI flags, runtime construction, the gRPC server
(with the standard health service), the JSON readiness line and signal-driven shutdown.

Why a readiness line: launchers (tests, ``kvpool verify``, deploy scripts) bind ``--port 0`` and need the
real port; one JSON object on stdout, printed only once the server accepts calls, is race-free.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
from kvpool.kvstore.client.async_client import RPC_SHARE_OF_BUDGET, AsyncStoreClient
from kvpool.kvstore.errors import StoreError, UnauthenticatedError
from kvpool.kvstore.shards import add_depth_flag
from kvpool.model.hybrid import HybridModel
from kvpool.model.loader import load_model
from kvpool.model.tokenizer import load_tokenizer
from kvpool.runtime.grpc_server import GrpcServer
from kvpool.runtime.lifecycle import serve_until_signal
from kvpool.runtime.metrics_http import MetricsHttpServer
from kvpool.worker.errors import ON_CACHE_ERROR
from kvpool.worker.store_io import DEFAULT_TIMEOUT_S

log = logging.getLogger("kvpool.worker")


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    """Flags of the prefill engine (``kvpool prefill`` and ``kvpool decode --colocated``)."""
    p.add_argument(
        "--checkpoint-policy",
        default="end,junction",
        help="comma list of end | junction | every=N, or none (docs/design/checkpoint_policy.md)",
    )
    p.add_argument("--tail-ttl-ms", type=int, default=120_000, help="TTL of request tails in the store")


def add_common_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="store master (shared KV cache); an HA group as A,B; master shards as SHARD0;SHARD1;...",
    )
    where.add_argument("--no-store", action="store_true", help="serve without the shared cache")
    p.add_argument("--model", default="tiny", help="'tiny' or a Kimi-Linear checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = any; see the readiness line)")
    p.add_argument("--block-size", type=int, default=64, help="hash block size (multiple of 64)")
    p.add_argument("--transport", default="auto", help="store data plane: auto|tcp|shm|ucx")
    add_depth_flag(p)
    p.add_argument(
        "--on-cache-error",
        choices=ON_CACHE_ERROR,
        default="recompute",
        help="when the store fails mid-request: recompute (serve from scratch) or fail",
    )
    p.add_argument("--store-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per store call")
    p.add_argument(
        "--request-timeout", type=float, default=120.0, help="max seconds per request (client deadline wins)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; the same on every worker and reference for bitwise equality (1: robust when "
        "cores are shared, OpenMP spinning with 2 threads on a loaded box is 10x slower)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus text on http://HOST:PORT/metrics (0 = any free port, see the readiness line; "
        "absent or negative = off)",
    )
    p.add_argument("--log-level", default="WARNING", help="Python log level of the worker")


@dataclass
class Runtime:
    model: HybridModel
    store: AsyncStoreClient | None
    tokenizer: object


def build_runtime(args: argparse.Namespace) -> Runtime:
    """Model with deterministic kernels (overview §7.3 rule 3), tokenizer, store client (lazy connect)."""
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper())
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    model = load_model(args.model)
    model.cache_schema(args.block_size)  # rejects a block size off the 64-token grid before serving
    tokenizer = load_tokenizer(args.model, model.config)
    store = (
        None
        if args.no_store
        else AsyncStoreClient(
            args.master,
            args.transport,
            rpc_timeout_s=RPC_SHARE_OF_BUDGET * args.store_timeout,
            shard_depth=args.shard_depth,
        )
    )
    return Runtime(model, store, tokenizer)


STORE_CHECK_TIMEOUT_S = 3.0


async def store_refusal(store: AsyncStoreClient | None) -> UnauthenticatedError | None:
    """One Stats call to every master shard at start. A master that refuses this worker's cluster secret is
    a configuration error that no retry fixes (every push and fetch would be a silent miss), so the worker
    stops with the master's reason; a master that is down or slow is not one (the worker serves without
    its cache until the master is back), so anything else is let through."""
    if store is None:
        return None
    calls = [asyncio.ensure_future(store.stats(shard)) for shard in range(store.shards.count)]
    done, pending = await asyncio.wait(calls, timeout=STORE_CHECK_TIMEOUT_S)  # a slow shard hides no refusal
    for call in pending:
        call.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for call in done:
        error = call.exception()
        if isinstance(error, UnauthenticatedError):
            return error
        if error is not None and not isinstance(error, StoreError):
            log.warning("store check at start failed: %s: %s", type(error).__name__, error)
    return None


async def serve_worker(
    server: GrpcServer, ready: dict, on_stop: Callable[[], object], metrics: MetricsHttpServer | None = None
) -> int:
    """Start the gRPC server (then ``metrics`` when given), print the readiness line (with ``metrics_port``),
    run until SIGTERM/SIGINT, stop gracefully: the one lifecycle of ``kvpool.runtime.lifecycle``."""

    async def start() -> dict:
        port = await server.start()
        metrics_port = await metrics.start() if metrics is not None else None
        return {"host": server.host, "port": port, **ready, "metrics_port": metrics_port}

    async def stop() -> None:
        if metrics is not None:
            await metrics.stop()
        await server.stop()
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result

    return await serve_until_signal("worker", start, stop)


def ready_fields(role: str, args: argparse.Namespace, model: HybridModel) -> dict:
    return {
        "role": role,  # "prefill", "decode" or "prefill+decode" (colocated)
        "model": args.model,
        "fingerprint": model.fingerprint().hex(),
        "block_size": args.block_size,
        "store": None if args.no_store else args.master,
        "on_cache_error": args.on_cache_error,
    }


def request_deadline(context: grpc.aio.ServicerContext, cap_s: float) -> float:
    """Seconds this call may take: the client's deadline when it set one, never more than ``cap_s``."""
    remaining = context.time_remaining()
    return cap_s if remaining is None else max(min(remaining, cap_s), 0.001)
