"""Start store processes (a storage node, a master) as children and wait for their readiness lines.

For tests, benchmarks and local launchers: ``start_master(log_dir)`` then ``start_node(log_dir, m.address)``
give handles with the bound ports (dynamic by default), ``endpoint`` (a NodeEndpoint) and ``stop()``
(SIGTERM, exit code). Each launcher waits, with a deadline, for the one JSON readiness line on stdout,
skipping any other line (UCX may log there), then keeps draining stdout in a thread so the child never
blocks on a full pipe. Their command lines are the launcher's (``kvpool.launch.service_argv``, the store-only
entry points: no torch import), started via subprocess: never fork a process that may have initialised UCX.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpool.proto import common_pb2
from kvpool.runtime.spawn import Child, spawn

from kvpool.launch.service_argv import master_argv, node_argv

READY_TIMEOUT_S = 30.0


class Proc(Child):
    """A started store process and its readiness record (``kvpool.runtime.spawn.Child``)."""


@dataclass
class NodeProc(Proc):
    @property
    def endpoint(self) -> common_pb2.NodeEndpoint:
        r = self.ready
        return common_pb2.NodeEndpoint(
            node_id=r["node_id"],
            host=r["host"],
            grpc_port=r["grpc_port"],
            tcp_port=r["tcp_port"],
            ucx_port=r["ucx_port"],
            shm_name=r["shm_name"],
            host_id=r["host_id"],
        )

    @property
    def grpc_target(self) -> str:
        return f"{self.ready['host']}:{self.ready['grpc_port']}"


def start_node(
    log_dir: Path,
    master: str | None = None,
    capacity: str = "64MiB",
    transports: str = "tcp,shm,ucx",
    *extra: str,
    prefault: bool = True,
) -> NodeProc:
    """``kvpool store node`` as a child; ``master=None`` starts it standalone (``--no-master``).

    ``extra``: more node flags (``--ssd-path``, ``--frame-timeout``...). ``prefault=False`` skips backing the
    pool at startup (faster start, slower first puts; tests use it).
    """
    flags = [*extra] if prefault else [*extra, "--no-prefault"]
    argv = node_argv(master, capacity, transports, flags)
    return spawn("node", argv, log_dir, READY_TIMEOUT_S, child_type=NodeProc)


@dataclass
class MasterProc(Proc):
    @property
    def address(self) -> str:
        return f"{self.ready.get('host', '127.0.0.1')}:{self.ready['port']}"


def start_master(log_dir: Path, *extra: str, port: int = 0) -> MasterProc:
    """``kvpool store master`` as a child (``port`` fixed when a restarted master must keep its address)."""
    argv = master_argv(port=port, extra=extra)
    return spawn("master", argv, log_dir, READY_TIMEOUT_S, child_type=MasterProc)
