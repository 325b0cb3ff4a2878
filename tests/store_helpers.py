"""Store test helpers: the process launchers (``tests.harness.store_procs``) plus small conveniences."""

from __future__ import annotations

from pathlib import Path

from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.protocol.data_frame import OP_LOCATE, Frame, ShmExtent
from kvpool.kvstore.protocol.shm_segment import attach_segment
from kvpool.kvstore.transport.tcp import TcpTransport
from kvpool.proto import common_pb2

from tests.harness import store_procs as node_procs
from tests.harness.store_procs import MasterProc, NodeProc, Proc, start_master

__all__ = [
    "MasterProc",
    "NodeProc",
    "Proc",
    "damage_pool_byte",
    "locate",
    "location",
    "start_master",
    "start_node",
]


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


async def locate(endpoint: common_pb2.NodeEndpoint, key: bytes) -> ShmExtent:
    """Where the node holds ``key`` in its shm pool: one LOCATE frame over its tcp data plane."""
    control = TcpTransport()
    try:
        (reply,) = await control.control(endpoint, [Frame(OP_LOCATE, key=key)])
    finally:
        await control.close()
    if isinstance(reply, StoreError):
        raise reply
    return ShmExtent.unpack(reply.aux)


async def damage_pool_byte(endpoint: common_pb2.NodeEndpoint, key: bytes, at: int, mask: int = 0x5A) -> None:
    """Flip bits of the node's copy in place through its shm segment (a stray writer, a bad DIMM)."""
    ext = await locate(endpoint, key)
    shm = attach_segment(ext.segment)
    try:
        shm.buf[ext.offset + at] ^= mask
    finally:
        shm.close()
