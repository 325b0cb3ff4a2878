"""``kvpool store ...``: the store's command group, ``master`` and ``node``, each run until SIGTERM/SIGINT.

Each prints exactly one JSON line ``{"ready": true, ...}`` on stdout once it serves (``--port 0`` picks a
free port), so launchers and tests read the ports instead of guessing; logs go to stderr. The master's
``--port`` is the master wire, its one listener: ``HOST:PORT`` is what workers, nodes and the gateway pass as
``--master``.

``python -m kvpool.kvstore.cli master|node [flags]`` is the same command without loading the other command
groups (the model's imports take seconds), which is what launchers, tests and benchmarks spawn. The node's
modules are imported only when ``node`` runs, so a master never loads them (the master's parser needs its
core's defaults, so those are loaded for either command).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.eviction import POLICIES
from kvpool.kvstore.master.core import MasterConfig
from kvpool.kvstore.master.kv_events_config import KvEventsConfig, KvEventsConfigError
from kvpool.kvstore.master.process_heap import MASTER_MMAP_THRESHOLD, fix_mmap_threshold
from kvpool.kvstore.master.state import StateFileError
from kvpool.kvstore.protocol.kv_events_wire import HashFormat
from kvpool.kvstore.shards import ShardSet, ShardSetError, add_depth_flag
from kvpool.runtime.lifecycle import serve_until_signal
from kvpool.runtime.metrics_http import MetricsHttpServer

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


def _size(text: str) -> int:
    """``"1GiB"``, ``"512MiB"``, ``"64MB"``, ``"4096"`` → bytes (an ArgumentTypeError, which argparse shows
    verbatim, for anything else)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 1GiB, 512MiB, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``store`` with its subcommands to the top-level ``kvpool`` parser."""
    store = subparsers.add_parser("store", help="shared KV store: master and storage nodes")
    store_sub = store.add_subparsers(dest="store_command", metavar="STORE_COMMAND")
    _add_master_parser(store_sub)
    _add_node_parser(store_sub)


# -- master ----------------------------------------------------------------------------------------------
def _add_master_parser(store_sub: argparse._SubParsersAction) -> None:
    p = store_sub.add_parser("master", help="run the store master (metadata, prefix index, eviction)")
    d = MasterConfig()
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument(
        "--port", type=int, default=0, help="master wire port, the address clients use (0 = any free port)"
    )
    p.add_argument(
        "--policy",
        default=d.policy,
        choices=sorted(POLICIES),
        help="eviction policy (hybrid: dead blocks first, checkpoints by learned time to their next read, "
        "falling back to recency against a shadow LRU; depth: the previous default, depth-weighted recency)",
    )
    a = d.admission
    p.add_argument(
        "--depth-weight",
        type=float,
        default=d.depth_weight,
        help="hybrid and depth: weight of log2(depth) in a checkpoint's score",
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
    p.add_argument(
        "--max-objects",
        type=int,
        default=d.max_objects,
        help="object cap of the index (0 = none): eviction keeps the count under it, bounding memory",
    )
    p.add_argument(
        "--pin-share",
        type=float,
        default=d.pin_share,
        help="clients' retention pins may hold at most this share of the DRAM capacity and of each tenant's "
        "quota, times the share they earn by being read (kvpool_master_pin_budget_earned); a pin past it "
        "pins nothing and is counted; operators' pins are not budgeted (default 0.5)",
    )
    p.add_argument(
        "--pin-budget-step",
        type=float,
        default=d.pin_budget_step,
        help="how fast clients' pins earn or lose their budget, per writer's lookup, by being read as "
        "densely as the rest of the cache; 0 keeps the whole --pin-share (a fixed budget) (default 0.02)",
    )
    sh = p.add_argument_group("master shards (docs/design/sharding.md)")
    sh.add_argument("--shards", type=int, default=1, help="how many master shards the fleet has (default 1)")
    sh.add_argument("--shard", type=int, default=0, help="the shard this master serves, 0..SHARDS-1")
    add_depth_flag(sh)
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
    _add_kv_events_flags(p)
    p.add_argument("--log-level", default="INFO", help="stderr log level")
    p.set_defaults(func=_run_master)


def _add_kv_events_flags(p: argparse.ArgumentParser) -> None:
    ev = p.add_argument_group("KV events for external routers, vLLM's format (docs/design/kv_events.md)")
    ev.add_argument(
        "--kv-events",
        metavar="tcp://HOST:PORT",
        default=None,
        help="publish the index's block events on this ZMQ PUB address (port 0 = any; off by default)",
    )
    ev.add_argument(
        "--kv-events-replay",
        metavar="tcp://HOST:PORT",
        default=None,
        help="ZMQ ROUTER address for replay requests and snapshots (port 0 = any)",
    )
    ev.add_argument("--kv-events-topic", default="kvpool", help="topic prefix: PREFIX/SHARD/INCARNATION")
    ev.add_argument(
        "--kv-events-block-size", type=int, default=64, help="tokens per block, as the workers hash them"
    )
    ev.add_argument(
        "--kv-events-hashes",
        choices=[f.value for f in HashFormat],
        default=HashFormat.BYTES.value,
        help="block hashes as the 32 bytes, or vLLM's int64 form (Dynamo takes only that)",
    )
    ev.add_argument(
        "--kv-events-medium",
        choices=["tier", "shared"],
        default="tier",
        help="tier: DRAM=CPU, SSD=STORAGE, tier moves are events; shared: everything EXTERNAL",
    )
    ev.add_argument(
        "--kv-events-keep-tokens",
        action="store_true",
        help="keep published blocks' tokens so snapshots carry them (4 B/token/block; Dynamo needs them)",
    )
    ev.add_argument("--kv-events-buffer", type=int, default=10_000, help="batches kept for replay")
    ev.add_argument(
        "--kv-events-queue", type=int, default=10_000, help="batches waiting to be sent before new ones drop"
    )
    ev.add_argument("--kv-events-hwm", type=int, default=100_000, help="ZMQ PUB high-water mark (messages)")
    ev.add_argument(
        "--kv-events-heartbeat-ms",
        type=int,
        default=1000,
        help="an idle stream sends an empty batch this often, so consumers notice restarts (0 = never)",
    )


def _kv_events_config(args: argparse.Namespace) -> KvEventsConfig | None:
    """The ``--kv-events*`` flags; None when events are off. KvEventsConfigError if unusable."""
    if args.kv_events is None:
        if args.kv_events_replay is not None:
            raise KvEventsConfigError("--kv-events-replay needs --kv-events")
        return None
    config = KvEventsConfig(
        endpoint=args.kv_events,
        replay_endpoint=args.kv_events_replay,
        topic_prefix=args.kv_events_topic,
        block_size=args.kv_events_block_size,
        hash_format=HashFormat(args.kv_events_hashes),
        shared_medium=args.kv_events_medium == "shared",
        keep_tokens=args.kv_events_keep_tokens,
        buffer_batches=args.kv_events_buffer,
        queue_batches=args.kv_events_queue,
        hwm=args.kv_events_hwm,
        heartbeat_ms=args.kv_events_heartbeat_ms,
    )
    config.validate()
    return config


def _master_config(args: argparse.Namespace) -> MasterConfig:
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
        max_objects=args.max_objects,
        pin_share=args.pin_share,
        pin_budget_step=args.pin_budget_step,
        shards=ShardSet(args.shards, args.shard_depth),
        shard=args.shard,
    )


def _run_master(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(), format="%(asctime)s master %(levelname)s %(message)s"
    )
    try:
        config = _master_config(args)
        config.validate()
        if args.etcd and args.state_file:
            raise ValueError(
                "--state-file and --etcd exclude each other: with HA, quotas and pins live in etcd"
            )
        if args.etcd and args.lease_ttl < 2:
            raise ValueError("--lease-ttl must be at least 2 s (etcd's minimum lease)")
        args.kv_events_config = _kv_events_config(args)
    except ValueError as exc:
        print(f"kvpool store master: {exc}", file=sys.stderr)
        return 2
    try:
        # uvloop, not asyncio's own loop: the master wakes for every read of every client, and each wakeup
        # costs it ~25 us less CPU (a 24-block lookup per wakeup: 63-70 -> 38-42 us of master CPU per call;
        # docs/measurements/master_front.md)
        import uvloop

        fix_mmap_threshold(MASTER_MMAP_THRESHOLD)  # process-wide, for the master's life (process_heap)
        return uvloop.run(_serve(config, args.host, args.port, args.metrics_port, args))
    except (StateFileError, ShardSetError) as exc:
        print(f"kvpool store master: {exc}", file=sys.stderr)
        return 2


async def _serve(
    config: MasterConfig, host: str, port: int, metrics_port: int, args: argparse.Namespace
) -> int:
    from kvpool.kvstore.master.server import MasterServer

    server = MasterServer(config, host, port, kv_events=args.kv_events_config)
    ha = None
    if args.etcd:  # gated before the first call can arrive: a standby must never serve as a leader
        from kvpool.kvstore.master.ha import HaConfig, HaMaster

        ha = HaMaster(server, HaConfig(args.etcd, args.ha_group, args.advertise or "", args.lease_ttl))
    metrics = MetricsHttpServer(server.metrics_text, host, metrics_port) if metrics_port >= 0 else None

    async def start() -> dict:
        bound = await server.start()
        bound_metrics = await metrics.start() if metrics is not None else None
        ready = {"port": bound, "host": host, "policy": config.policy}
        if config.shards.sharded:
            ready["shard"] = {"index": config.shard, "set": str(config.shards)}
        if server.kv_events is not None:
            ev = server.kv_events
            ready["kv_events"] = {"endpoint": ev.endpoint, "replay": ev.replay_endpoint, "topic": ev.topic}
        if ha is not None:
            await ha.start(f"{host}:{bound}")
            ready["ha"] = {"group": ha.group, "advertise": ha.advertise, "etcd": args.etcd}
        return {**ready, "metrics_port": bound_metrics}

    async def stop() -> None:
        if ha is not None:
            await ha.stop()
        if metrics is not None:
            await metrics.stop()
        await server.stop()

    return await serve_until_signal("store master", start, stop)


# -- node ------------------------------------------------------------------------------------------------
def _add_node_parser(store_sub: argparse._SubParsersAction) -> None:
    p = store_sub.add_parser("node", help="run a storage node (shm pool, tcp/shm/ucx data planes, gRPC)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--master",
        metavar="HOST:PORT",
        help="master to register with; an HA group as A,B; master shards as SHARD0;SHARD1;... (each "
        "registered with, each offered an equal slice of the capacity)",
    )
    where.add_argument(
        "--no-master", action="store_true", help="standalone node (transport tests, benchmarks)"
    )
    add_depth_flag(p)
    p.add_argument("--capacity", default="1GiB", type=_size, help="DRAM pool size (default 1GiB)")
    p.add_argument(
        "--transport",
        default="auto",
        help="comma list of data planes among tcp,shm,ucx (tcp is always on); 'auto' = tcp,shm "
        "plus ucx when ucxx works here (an explicit ucx that cannot start fails the node)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    p.add_argument("--port", type=int, default=0, help="gRPC control port (0 = any)")
    p.add_argument("--tcp-port", type=int, default=0, help="tcp data-plane port (0 = any)")
    p.add_argument("--ucx-port", type=int, default=0, help="ucx listener port (0 = any)")
    p.add_argument("--ssd-path", type=Path, default=None, help="directory of the SSD tier (off if unset)")
    p.add_argument("--ssd-capacity", type=_size, default=0, help="SSD tier size")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus text on http://HOST:PORT/metrics (0 = any free port, see the readiness line; "
        "absent or negative = off)",
    )
    p.add_argument("--node-id", default=None, help="stable node id (default hostname-grpcport)")
    p.add_argument(
        "--shard-register-wait-s",
        type=float,
        default=10.0,
        help="with master shards: seconds to wait for every shard to have the node before reporting ready "
        "(the rest keep trying in the background; a dead shard never keeps the node from the others)",
    )
    p.add_argument("--max-object", type=_size, default=None, help="largest object (default: capacity)")
    p.add_argument(
        "--frame-timeout",
        type=float,
        default=5.0,
        help="seconds a started data-plane frame may take (plus size at 100 MB/s)",
    )
    p.add_argument(
        "--stamp-slots",
        type=int,
        default=None,
        help="objects that can carry an shm read stamp at once (default capacity/4KiB + 1024; 0 = none: "
        "same-host readers always LOCATE)",
    )
    p.add_argument(
        "--reservation-ttl",
        type=float,
        default=30.0,
        help="seconds an shm reservation may stay unsealed before it is freed",
    )
    p.add_argument(
        "--no-prefault",
        action="store_true",
        help="do not back the pool's pages at startup (faster start, slower first puts)",
    )
    p.set_defaults(func=_run_node)


def _run_node(args: argparse.Namespace) -> int:
    from kvpool.kvstore.node.process import NodeConfig, run

    if args.transport.strip() == "auto":
        from kvpool.kvstore.transport.ucx import ucx_available

        transports: tuple[str, ...] = ("tcp", "shm", "ucx") if ucx_available() else ("tcp", "shm")
    else:
        transports = tuple(t.strip() for t in args.transport.split(",") if t.strip())
    if "tcp" not in transports:
        transports = ("tcp", *transports)
    config = NodeConfig(
        capacity=args.capacity,
        master=None if args.no_master else args.master,
        shard_depth=args.shard_depth,
        shard_register_wait_s=args.shard_register_wait_s,
        host=args.host,
        grpc_port=args.port,
        tcp_port=args.tcp_port,
        ucx_port=args.ucx_port,
        transports=transports,
        ssd_path=args.ssd_path,
        ssd_capacity=args.ssd_capacity if args.ssd_path else 0,
        node_id=args.node_id,
        max_object=args.max_object,
        frame_timeout_s=args.frame_timeout,
        prefault=not args.no_prefault,
        stamp_slots=args.stamp_slots,
        reservation_ttl_s=args.reservation_ttl,
        metrics_port=args.metrics_port if args.metrics_port is not None and args.metrics_port >= 0 else None,
    )
    return run(config)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpool.kvstore.cli master|node ...``: the store commands without loading every feature
    (the full ``kvpool`` CLI imports torch for the model commands; launchers and tests skip that second)."""
    parser = argparse.ArgumentParser(prog="kvpool")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store", *(sys.argv[1:] if argv is None else argv)])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
