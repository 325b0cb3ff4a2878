"""A storage node process: shared-memory pool, optional SSD tier, data planes (tcp / shm / ucx), gRPC
control plane + health, and registration with the master.

Everything runs on one asyncio loop (the object table needs no locks; ucxx's blocking progress mode is driven
by the same loop). Startup prints exactly one JSON readiness line on stdout once every port is bound and the
master has accepted the registration; SIGTERM/SIGINT shut down cleanly and unlink the pool segment.
Start one programmatically with ``tests/store_helpers.start_node`` or ``kvpool store node ...``.

The gRPC control plane (``StorageNodeService``, proto/node.proto) carries the master's orders (Delete, Demote,
Promote, fenced by leader epoch) and what an operator or a test asks (Info, Inventory); bytes and the shm
control ops (LOCATE / RESERVE / SEAL) go over the tcp data plane (``tcp_server``). Typed store errors become
gRPC statuses (missing → NOT_FOUND, full → RESOURCE_EXHAUSTED, bad input → INVALID_ARGUMENT, corrupt →
DATA_LOSS) so the master and clients can tell them apart; the service keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.node.metrics import TransportBytes, TransportTap, node_registry
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.node.pool import SharedPool
from kvpool.kvstore.node.registration import MasterRegistration
from kvpool.kvstore.node.tcp_server import TcpDataServer
from kvpool.kvstore.protocol.shm_segment import host_id
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime import cluster_auth
from kvpool.runtime.grpc_server import GrpcServer
from kvpool.runtime.lifecycle import print_ready, wait_for_stop_signal
from kvpool.runtime.metrics_http import MetricsHttpServer

log = logging.getLogger(__name__)
TRANSPORTS = ("tcp", "shm", "ucx")
RESERVATION_REAP_S = 5.0
SERVICE_NAME = "kvpool.v1.StorageNode"
MAX_KEYS_PER_CALL = 100_000
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


def parse_size(text: str | int) -> int:
    """``"1GiB"``, ``"512MiB"``, ``"64MB"``, ``"4096"`` → bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 1GiB, 512MiB, 4096)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class NodeConfig:
    """Everything ``kvpool store node`` accepts."""

    capacity: int = 1 << 30
    master: str | None = None  # HOST:PORT; None = standalone (transport tests, benchmarks)
    host: str = "127.0.0.1"
    grpc_port: int = 0
    tcp_port: int = 0
    ucx_port: int = 0
    transports: tuple[str, ...] = TRANSPORTS
    ssd_path: Path | None = None
    ssd_capacity: int = 0
    node_id: str | None = None
    max_object: int | None = None
    frame_timeout_s: float = 5.0
    prefault: bool = True
    metrics_port: int | None = None  # Prometheus /metrics on host:port (0 = any free port); None = off
    stamp_slots: int | None = None  # shm read stamps (objects at once); None = capacity // 4 KiB + 1024
    reservation_ttl_s: float = 30.0  # an shm reservation left unsealed this long is freed


class StorageNodeService(node_pb2_grpc.StorageNodeServicer):
    """gRPC handlers; ``endpoint`` is filled in by the node once all ports are bound."""

    def __init__(
        self,
        store: ObjectStore,
        endpoint: Callable[[], common_pb2.NodeEndpoint],
    ) -> None:
        self.store = store
        self._endpoint = endpoint

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, exc: StoreError) -> None:
        await context.abort(grpc.StatusCode[exc.grpc_status], f"{type(exc).__name__}: {exc}")

    @staticmethod
    async def _check_keys(request: node_pb2.KeysRequest, context: grpc.aio.ServicerContext) -> None:
        if len(request.keys) > MAX_KEYS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"more than {MAX_KEYS_PER_CALL} keys")

    async def Info(self, request, context):
        alloc = self.store.pool.allocator
        return node_pb2.NodeInfoReply(
            node=self._endpoint(),
            dram_capacity_bytes=alloc.capacity,
            dram_used_bytes=alloc.used_bytes,
            ssd_capacity_bytes=self.store.ssd_capacity,
            ssd_used_bytes=self.store.ssd_used,
            fragmentation=alloc.fragmentation,
            objects=len(self.store.objects),
            counters={**self.store.counters, **cluster_auth.rejection_counters()},
        )

    async def Inventory(self, request, context) -> AsyncIterator[common_pb2.ObjectMeta]:
        for meta in self.store.inventory():
            yield meta

    async def _check_order(
        self, request: node_pb2.KeysRequest, context: grpc.aio.ServicerContext, what: str
    ) -> None:
        await self._check_keys(request, context)
        try:
            self.store.fenced(request.epoch, what)
        except StoreError as exc:
            await self._fail(context, exc)

    async def Delete(self, request, context):
        await self._check_order(request, context, "Delete")
        done, missing = self.store.delete(list(request.keys))
        return node_pb2.KeysReply(done=done, missing=missing)

    async def Demote(self, request, context):
        await self._check_order(request, context, "Demote")
        done, missing = await self.store.demote(list(request.keys))
        return node_pb2.KeysReply(done=done, missing=missing)

    async def Promote(self, request, context):
        await self._check_order(request, context, "Promote")
        try:
            done, missing = await self.store.promote(list(request.keys))
        except StoreError as exc:
            await self._fail(context, exc)
        return node_pb2.KeysReply(done=done, missing=missing)


class StorageNode:
    """Owns every component of one node; ``start`` binds everything, ``stop`` tears it down."""

    def __init__(self, config: NodeConfig) -> None:
        unknown = set(config.transports) - set(TRANSPORTS)
        if unknown or "tcp" not in config.transports:
            raise ValueError(
                f"transports must include tcp and be among {TRANSPORTS}, got {config.transports}"
            )
        self.config = config
        self.pool = SharedPool(config.capacity, stamp_slots=config.stamp_slots)
        if config.prefault:
            self.pool.prefault()
        self.store = ObjectStore(self.pool, config.ssd_path, config.ssd_capacity, config.max_object)
        self.store.auto_promote = config.master is None
        self.endpoint = common_pb2.NodeEndpoint(host=config.host, host_id=host_id())
        self.tcp: TcpDataServer | None = None
        self.ucx = None
        self.grpc_server: GrpcServer | None = None
        self.master: MasterRegistration | None = None
        self._reaper: asyncio.Task | None = None
        self.transport_bytes = TransportBytes()
        self.metrics: MetricsHttpServer | None = None

    async def start(self) -> None:
        cfg = self.config
        self.tcp = TcpDataServer(
            TransportTap(self.store, "tcp", self.transport_bytes),  # type: ignore[arg-type]
            cfg.host,
            cfg.tcp_port,
            cfg.frame_timeout_s,
            shm_enabled="shm" in cfg.transports,
            reservation_ttl_s=cfg.reservation_ttl_s,
        )
        self.tcp.start()
        self.endpoint.tcp_port = self.tcp.port
        if "ucx" in cfg.transports:
            from kvpool.kvstore.node.ucx_server import UcxDataServer  # ucxx only when asked for

            self.ucx = UcxDataServer(
                TransportTap(self.store, "ucx", self.transport_bytes),  # type: ignore[arg-type]
                cfg.ucx_port,
                cfg.frame_timeout_s,
            )
            self.endpoint.ucx_port = self.ucx.port
        if "shm" in cfg.transports:
            self.endpoint.shm_name = self.pool.name
        service = StorageNodeService(
            TransportTap(self.store, "grpc", self.transport_bytes),  # type: ignore[arg-type]
            lambda: self.endpoint,
        )
        server = GrpcServer(  # 64 MiB messages: Delete/Demote batches from the master
            {SERVICE_NAME: lambda s: node_pb2_grpc.add_StorageNodeServicer_to_server(service, s)},
            cfg.host,
            cfg.grpc_port,
        )
        port = await server.start()
        self.grpc_server = server
        self.endpoint.grpc_port = port
        self.endpoint.node_id = cfg.node_id or f"{socket.gethostname()}-{port}"
        if cfg.metrics_port is not None and cfg.metrics_port >= 0:
            registry = node_registry(self.store, self.transport_bytes, lambda: self.endpoint.node_id)
            self.metrics = MetricsHttpServer(registry, cfg.host, cfg.metrics_port)
            await self.metrics.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_reservations())
        if cfg.master:
            self.master = MasterRegistration(cfg.master, self.store, self.endpoint)
            await self.master.register_until_done()
            self.master.start_heartbeats()

    async def _reap_reservations(self) -> None:
        """Free shm put reservations whose writer vanished before sealing (their extents would leak)."""
        while True:
            await asyncio.sleep(min(RESERVATION_REAP_S, self.config.reservation_ttl_s / 2))
            self.store.reap_reservations()

    def readiness(self) -> dict:
        ep = self.endpoint
        return {
            "node_id": ep.node_id,
            "host": ep.host,
            "grpc_port": ep.grpc_port,
            "tcp_port": ep.tcp_port,
            "ucx_port": ep.ucx_port,
            "shm_name": ep.shm_name,
            "host_id": ep.host_id,
            "pid": os.getpid(),
            "capacity": self.pool.capacity,
            "metrics_port": self.metrics.port if self.metrics else None,
        }

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        if self.master:
            await self.master.close()
        if self.metrics:
            await self.metrics.stop()
        if self.grpc_server:
            await self.grpc_server.stop(grace_s=0.5)
        if self.ucx:
            await self.ucx.close()
        if self.tcp:
            await self.tcp.close()
        self.pool.close()


async def serve(config: NodeConfig) -> None:
    """Run a node until SIGTERM/SIGINT."""
    node = StorageNode(config)
    try:
        await node.start()
        print_ready(node.readiness())
        await wait_for_stop_signal()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.stop(), 5.0)
        node.pool.close()


def run(config: NodeConfig) -> int:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s node %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(config))
    return 0
