"""``kvpool store ...``: the store's command group (``node`` here, ``master`` from the master's module)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpool.kvstore.node.process import TRANSPORTS, NodeConfig, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:  # argparse shows ArgumentTypeError messages verbatim
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``store`` with its subcommands to the top-level ``kvpool`` parser."""
    store = subparsers.add_parser("store", help="shared KV store: master and storage nodes")
    store_sub = store.add_subparsers(dest="store_command", metavar="STORE_COMMAND")
    _add_node_parser(store_sub)
    try:
        from kvpool.kvstore.master.cli import add_master_parser
    except ModuleNotFoundError as exc:  # master not in this tree yet; its own import errors still surface
        if exc.name != "kvpool.kvstore.master.cli":
            raise
    else:
        add_master_parser(store_sub)


def _add_node_parser(store_sub: argparse._SubParsersAction) -> None:
    p = store_sub.add_parser("node", help="run a storage node (shm pool, tcp/shm/ucx data planes, gRPC)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--master", metavar="HOST:PORT", help="master to register with")
    where.add_argument(
        "--no-master", action="store_true", help="standalone node (transport tests, benchmarks)"
    )
    p.add_argument("--capacity", default="1GiB", type=_size, help="DRAM pool size (default 1GiB)")
    p.add_argument(
        "--transport",
        default="auto",
        help=f"comma list of data planes among {','.join(TRANSPORTS)} (tcp is always on); 'auto' = tcp,shm "
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
    from kvpool.kvstore.node.process import run

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
    """``python -m kvpool.kvstore.cli node|master ...``: the store commands without loading every feature
    (the full ``kvpool`` CLI imports torch for the model commands; launchers and tests skip that second)."""
    import sys

    parser = argparse.ArgumentParser(prog="kvpool")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["store", *(sys.argv[1:] if argv is None else argv)])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
