"""``kvpool up`` on the command line: flags, the port check before anything starts, the foreground loop
that reports a service that exits, and the ordered shutdown on Ctrl-C / SIGTERM. The cluster itself is
``kvpool.launch.cluster.Cluster``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from kvpool.kvstore.shards import ShardSetError
from kvpool.launch.cluster import Cluster
from kvpool.launch.config import DEFAULT_CONFIG, load_config
from kvpool.runtime.spawn import LaunchError


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start master, store, prefill, decode and gateway on this machine")
    up.add_argument("--config", type=Path, default=None, help=f"TOML config (default {DEFAULT_CONFIG.name})")
    up.add_argument(
        "--run-dir", type=Path, default=None, help="logs + state.json (default under $KVPOOL_RUNS)"
    )
    up.add_argument("--port", type=int, default=None, help="gateway port (overrides the config)")
    up.add_argument(
        "--routing",
        choices=("cache", "rr"),
        default=None,
        help="gateway routing: cache (longest cached prefix, then load) or rr (round robin)",
    )
    up.add_argument("--prefill", type=int, default=None, help="number of prefill workers")
    up.add_argument("--decode", type=int, default=None, help="number of decode workers")
    up.add_argument(
        "--netns",
        action="store_true",
        help="multi-host on one box (root): master, each node and each worker in its own network namespace "
        "with its own IP on a bridge; the gateway stays on this host's 127.0.0.1",
    )
    up.add_argument(
        "--link",
        default=None,
        help="with --netns: shape every service's link, "
        'e.g. "delay 200us jitter 20us rate 10gbit loss 0.1%%"',
    )
    up.add_argument(
        "--ha",
        action="store_true",
        help="control plane HA: etcd plus two masters that elect a leader (clients follow it); with --netns "
        "each etcd member and master gets its own namespace",
    )
    up.add_argument(
        "--etcd-members", type=int, default=1, help="with --ha: etcd cluster size (1 or 3; tests use 3)"
    )
    up.add_argument(
        "--shards",
        type=int,
        default=None,
        help="master shards (each chain's index lives on one; with --ha each shard is its own HA group)",
    )
    up.add_argument(
        "--shard-depth", type=int, default=None, help="blocks of a chain that choose its shard (default 2)"
    )
    up.set_defaults(func=run_up)


def overrides_from_args(args: argparse.Namespace) -> dict:
    o: dict[str, dict] = {"gateway": {}, "prefill": {}, "decode": {}, "master": {}}
    if args.shards is not None:
        o["master"]["shards"] = args.shards
    if args.shard_depth is not None:
        o["master"]["shard_depth"] = args.shard_depth
    if args.port is not None:
        o["gateway"]["port"] = args.port
    if args.routing:
        o["gateway"]["routing"] = args.routing
    if args.prefill is not None:
        o["prefill"]["count"] = args.prefill
    if args.decode is not None:
        o["decode"]["count"] = args.decode
    return o


def port_in_use(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound as the gateway will bind it (SO_REUSEADDR, as uvicorn)."""
    import socket

    if port == 0:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def run_up(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides_from_args(args))
    host, port = config["gateway"].get("host", "127.0.0.1"), int(config["gateway"].get("port", 8000))
    if port_in_use(host, port):  # before anything starts: no half-started cluster to clean up
        print(
            f"kvpool up: port {port} on {host} is in use (another `kvpool up`? `kvpool status` shows it); "
            "choose another with --port N",
            file=sys.stderr,
        )
        return 1
    if args.etcd_members not in (1, 3, 5):
        print("kvpool up: --etcd-members must be 1, 3 or 5 (an odd quorum)", file=sys.stderr)
        return 2
    try:
        cluster = Cluster(
            config, args.run_dir, netns=args.netns, link=args.link, ha=args.ha, etcd_members=args.etcd_members
        )
    except ShardSetError as exc:  # before anything starts
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 2
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    try:
        cluster.start()
        print(
            f"kvpool up: {len(cluster.services)} services ready in {time.monotonic() - t0:.1f}s, "
            f"logs in {cluster.run_dir}"
        )
        for s in cluster.services.values():
            where = f"netns {s.netns}" if s.netns else ""
            line = f"  {s.name:<10} pid {s.popen.pid:<8} {s.address:<22} {s.metrics_url or ''} {where}"
            print(line.rstrip())
        print(f"OpenAI API: {cluster.base_url}/v1   (Ctrl-C to stop; `kvpool status` to inspect)")
        hint = "store clients outside this run: export KVPOOL_CLUSTER_SECRET_FILE=<that path>"
        print(f"cluster secret: {cluster.secret_file} ({hint})", flush=True)
        reported: set[str] = set()
        while True:
            for s in cluster.services.values():
                if not s.alive() and s.name not in reported:
                    reported.add(s.name)
                    rc = s.popen.returncode
                    print(f"kvpool up: {s.name} exited (rc={rc}); see {s.log_path}", flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("kvpool up: stopping", flush=True)
        return 0
    except LaunchError as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
        print(f"kvpool up: stopped {len(cluster.services)} services", flush=True)
