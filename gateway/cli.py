"""``kvpool gateway``: serve the OpenAI-compatible API in front of prefill and decode workers.

Prints one JSON readiness line ``{"ready": true, "role": "gateway", "port": N, "url": ...}`` once uvicorn
accepts connections (``--port 0`` binds any free port), and exits cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys

from kvpool.gateway.cache_hints import parse_tiers
from kvpool.gateway.router import POLICIES
from kvpool.gateway.settings import GatewaySettings
from kvpool.kvstore.shards import add_depth_flag

READY_POLL_S = 0.02


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = GatewaySettings(prefill=[], decode=[])
    p.add_argument(
        "--prefill", action="append", required=True, metavar="HOST:PORT", help="prefill worker (repeat)"
    )
    p.add_argument(
        "--decode", action="append", required=True, metavar="HOST:PORT", help="decode worker (repeat)"
    )
    p.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="store master (cache-aware routing, store metrics); master shards as SHARD0;SHARD1;...",
    )
    add_depth_flag(p)
    p.add_argument("--model", default=d.model, help="'tiny' or a checkpoint directory (tokenizer, config)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--fingerprint", default=None, help="model fingerprint hex (a worker's readiness line)")
    p.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per cache block (must match the workers)"
    )
    p.add_argument(
        "--routing",
        choices=POLICIES,
        default=d.routing,
        help="how prefill workers are chosen: cache (longest cached prefix, then load) or rr (round robin)",
    )
    p.add_argument(
        "--ttft-slo-s", type=float, default=d.ttft_slo_s, help="429 above this estimated TTFT (0=off)"
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted API key, or KEY=TENANT to bind its requests to a tenant (their cache salt is derived "
        "server-side from the tenant; repeat; env KVPOOL_API_KEYS, comma-separated)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=d.max_prompt_tokens,
        help="max_model_len: prompt + max_tokens must fit in it",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=d.max_output_tokens,
        help="largest max_tokens a request may ask for",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body accepted (413 above)",
    )
    p.add_argument(
        "--max-concurrent", type=int, default=d.max_concurrent, help="requests in flight at most (429 above)"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="seconds a request may take end to end (504 after)",
    )
    p.add_argument(
        "--cache-hints",
        action=argparse.BooleanOptionalAction,
        default=d.cache_hints,
        help="accept the clients' cache hints (prompt_cache_key, prompt_cache_retention, cache_control); "
        "off: a request carrying one gets a 400",
    )
    p.add_argument(
        "--retention-tiers",
        type=parse_tiers,
        default=d.retention_tiers,
        help="retention tiers offered (default 5m,1h,24h): a hint for another is a 400; "
        "prompt_cache_retention=in_memory is the shortest",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one line per request (id, status, tokens, cached tokens) on stderr",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn log level (debug, info, warning, error)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gateway", help="run the OpenAI-compatible gateway")
    add_arguments(p)
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    keys = list(args.api_key) + [k for k in os.environ.get("KVPOOL_API_KEYS", "").split(",") if k]
    return GatewaySettings(
        prefill=args.prefill,
        decode=args.decode,
        master=args.master,
        shard_depth=args.shard_depth,
        model=args.model,
        served_model_name=args.served_model_name,
        fingerprint_hex=args.fingerprint,
        block_size=args.block_size,
        routing=args.routing,
        ttft_slo_s=args.ttft_slo_s,
        api_keys=keys,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_body_bytes=args.max_body_bytes,
        max_concurrent=args.max_concurrent,
        request_timeout_s=args.request_timeout,
        cache_hints=args.cache_hints,
        retention_tiers=args.retention_tiers,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from kvpool.gateway.app import create_app

    if args.access_log:  # one line per request on stderr (kvpool up sends it to the gateway's log file)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s access %(message)s"))
        access = logging.getLogger("kvpool.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    app = create_app(settings_from_args(args))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"kvpool gateway: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)

    async def main() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(READY_POLL_S)
        if server.started:
            url = f"http://{args.host}:{port}"
            print(
                json.dumps(
                    {
                        "ready": True,
                        "role": "gateway",
                        "host": args.host,
                        "port": port,
                        "url": url,
                        "pid": os.getpid(),
                    }
                ),
                flush=True,
            )
        await serving

    # uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown, restoring the previous handler
    # first; a no-op Python handler here turns that into a normal return, so a clean stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    asyncio.run(main())
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpool.gateway.cli ...``: the gateway without importing every other command."""
    parser = argparse.ArgumentParser(prog="kvpool gateway")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
