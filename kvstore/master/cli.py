"""``kvpool store master``: run the master until SIGTERM/SIGINT.

Prints exactly one JSON line ``{"ready": true, "port": N, ...}`` on stdout once it serves (``--port 0`` picks
a free port), so launchers and tests read the port instead of guessing; logs go to stderr. ``--port`` is the
master wire, the one listener: ``HOST:PORT`` is what workers, nodes and the gateway pass as ``--master``.
``python -m kvpool.kvstore.master.cli [flags]`` is the same command without loading the other command
groups (the model's imports take seconds), which is what tests and benchmarks spawn.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.eviction import POLICIES
from kvpool.kvstore.master.config import MasterConfig
from kvpool.kvstore.master.state import StateFileError
from kvpool.runtime.lifecycle import serve_until_signal
from kvpool.runtime.metrics_http import MetricsHttpServer


def add_master_parser(store_sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``master`` to the ``kvpool store`` subcommands (called by kvpool.kvstore.cli)."""
    p = store_sub.add_parser("master", help="run the store master (metadata, prefix index, eviction)")
    add_master_arguments(p)
    p.set_defaults(func=run_master)
    return p


def add_master_arguments(p: argparse.ArgumentParser) -> None:
    d = MasterConfig()
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument(
        "--port", type=int, default=0, help="master wire port, the address clients use (0 = any free port)"
    )
    p.add_argument(
        "--policy",
        default=d.policy,
        choices=sorted(POLICIES),
        help="eviction policy (hybrid: dead blocks first, depth-weighted recency, admission control)",
    )
    a = d.admission
    p.add_argument(
        "--depth-weight",
        type=float,
        default=d.depth_weight,
        help="hybrid: weight of log2(depth) vs log2(age)",
    )
    p.add_argument(
        "--admission-continuation",
        type=float,
        default=a.continuation_fraction,
        help="hybrid: a lookup whose cached + ghost run covers this share of it is a continuation (admitted)",
    )
    p.add_argument(
        "--admission-step", type=float, default=a.step, help="hybrid: learning rate of the sampling rate"
    )
    p.add_argument(
        "--admission-min-rate",
        type=float,
        default=a.min_rate,
        help="hybrid: lowest sampling rate of new chains (1 = admit everything)",
    )
    p.add_argument(
        "--admission-ghosts", type=int, default=a.ghost_entries, help="hybrid: block hashes kept as ghosts"
    )
    p.add_argument("--high-watermark", type=float, default=d.high_watermark, help="evict above this fill")
    p.add_argument("--low-watermark", type=float, default=d.low_watermark, help="evict down to this fill")
    p.add_argument("--heartbeat-ms", type=int, default=d.heartbeat_ms, help="node heartbeat interval")
    p.add_argument(
        "--node-timeout-ms",
        type=int,
        default=d.node_timeout_ms,
        help="a node silent this long is dropped with its objects",
    )
    p.add_argument("--lease-ms", type=int, default=d.lease_ms, help="default read-pin lease")
    p.add_argument("--max-lease-ms", type=int, default=d.max_lease_ms, help="longest lease a client may ask")
    p.add_argument(
        "--put-deadline-ms",
        type=int,
        default=d.put_deadline_ms,
        help="a started put not committed in time is aborted",
    )
    p.add_argument(
        "--node-call-timeout-ms",
        type=int,
        default=d.node_call_timeout_ms,
        help="deadline of Delete/Demote/Promote calls to nodes",
    )
    p.add_argument(
        "--sweep-ms", type=int, default=d.sweep_ms, help="period of dead-node / abandoned-put / expiry sweeps"
    )
    p.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="persist tenant quotas and soft pins here (JSON) so they survive a restart",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=-1,
        help="serve Prometheus text on http://HOST:PORT/metrics (0 = any free port, -1 = off)",
    )
    ha = p.add_argument_group("high availability (etcd)")
    ha.add_argument(
        "--etcd",
        metavar="HOST:PORT[,HOST:PORT]",
        default=None,
        help="campaign for leadership of --ha-group in this etcd cluster; quotas and pins live there",
    )
    ha.add_argument("--ha-group", default="kvpool", help="masters with the same group elect one leader")
    ha.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        default=None,
        help="where clients reach this master (default: --host and the bound port)",
    )
    ha.add_argument("--lease-ttl", type=int, default=2, help="leader lease in seconds (etcd minimum 2)")
    p.add_argument("--log-level", default="INFO", help="stderr log level")


def config_from_args(args: argparse.Namespace) -> MasterConfig:
    return MasterConfig(
        policy=args.policy,
        depth_weight=args.depth_weight,
        admission=AdmissionConfig(
            continuation_fraction=args.admission_continuation,
            step=args.admission_step,
            min_rate=args.admission_min_rate,
            ghost_entries=args.admission_ghosts,
        ),
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        heartbeat_ms=args.heartbeat_ms,
        node_timeout_ms=args.node_timeout_ms,
        lease_ms=args.lease_ms,
        max_lease_ms=args.max_lease_ms,
        put_deadline_ms=args.put_deadline_ms,
        node_call_timeout_ms=args.node_call_timeout_ms,
        sweep_ms=args.sweep_ms,
        state_path=args.state_file,
    )


def run_master(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(), format="%(asctime)s master %(levelname)s %(message)s"
    )
    try:
        config = config_from_args(args)
        config.validate()
        if args.etcd and args.state_file:
            raise ValueError(
                "--state-file and --etcd exclude each other: with HA, quotas and pins live in etcd"
            )
        if args.etcd and args.lease_ttl < 2:
            raise ValueError("--lease-ttl must be at least 2 s (etcd's minimum lease)")
    except ValueError as exc:
        print(f"kvpool store master: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(config, args.host, args.port, args.metrics_port, args))
    except StateFileError as exc:
        print(f"kvpool store master: {exc}", file=sys.stderr)
        return 2


async def _serve(
    config: MasterConfig, host: str, port: int, metrics_port: int, args: argparse.Namespace
) -> int:
    from kvpool.kvstore.master.metrics import render
    from kvpool.kvstore.master.server import MasterServer

    server = MasterServer(config, host, port)
    ha = None
    if args.etcd:  # gated before the first call can arrive: a standby must never serve as a leader
        from kvpool.kvstore.master.ha import HaConfig, HaMaster

        ha = HaMaster(server, HaConfig(args.etcd, args.ha_group, args.advertise or "", args.lease_ttl))
    metrics = (
        MetricsHttpServer(lambda: render(server.core.stats()).encode(), host, metrics_port)
        if metrics_port >= 0
        else None
    )

    async def start() -> dict:
        bound = await server.start()
        bound_metrics = await metrics.start() if metrics is not None else None
        ready = {"port": bound, "host": host, "policy": config.policy}
        if ha is not None:
            await ha.start(f"{host}:{bound}")
            ready["ha"] = {"group": args.ha_group, "advertise": ha.advertise, "etcd": args.etcd}
        return {**ready, "metrics_port": bound_metrics}

    async def stop() -> None:
        if ha is not None:
            await ha.stop()
        if metrics is not None:
            await metrics.stop()
        await server.stop()

    return await serve_until_signal("store master", start, stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool store master", description=__doc__.splitlines()[0])
    add_master_arguments(parser)
    return run_master(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
