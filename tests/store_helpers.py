"""Store test helpers: the process launchers (``tests.harness.store_procs``) plus small conveniences."""

from __future__ import annotations

from pathlib import Path

from kvpool.proto import common_pb2

from tests.harness import store_procs as node_procs
from tests.harness.store_procs import MasterProc, NodeProc, Proc, start_master

__all__ = ["MasterProc", "NodeProc", "Proc", "location", "start_master", "start_node"]


def location(node: NodeProc, meta: common_pb2.ObjectMeta) -> common_pb2.ObjectLocation:
    return common_pb2.ObjectLocation(meta=meta, node=node.endpoint)


def start_node(
    log_dir: Path,
    master: str | None = None,
    capacity: str = "64MiB",
    transports: str = "tcp,shm,ucx",
    *extra: str,
    prefault: bool = False,
) -> NodeProc:
    """``node_procs.start_node`` without prefaulting by default (~10 ms per MiB of pool on a loaded
    2-core box, paid by a node per test)."""
    return node_procs.start_node(log_dir, master, capacity, transports, *extra, prefault=prefault)
