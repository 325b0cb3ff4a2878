"""A storage node process: shared-memory pool, optional SSD tier, data planes (tcp / shm / ucx), gRPC
control plane + health, the link to the master, and ``/metrics``.

Everything runs on one asyncio loop (the object table needs no locks; ucxx's blocking progress mode is driven
by the same loop). Startup prints exactly one JSON readiness line on stdout once every port is bound and the
master has accepted the registration; SIGTERM/SIGINT shut down cleanly and unlink the pool segment.
Start one programmatically with ``tests/store_helpers.start_node`` or ``kvpool store node ...``.

The gRPC control plane (``StorageNodeService``, proto/node.proto) carries the master's orders (Delete, Demote,
Promote, fenced by leader epoch) and what an operator or a test asks (Info, Inventory); bytes and the shm
control ops (LOCATE / RESERVE / SEAL) go over the tcp data plane (``tcp_server``). Typed store errors become
gRPC statuses (missing → NOT_FOUND, full → RESOURCE_EXHAUSTED, bad input → INVALID_ARGUMENT, corrupt →
DATA_LOSS) so the master and clients can tell them apart; the service keeps serving after any of them.

**The link to the master** (``MasterRegistration``): RegisterNode with the full inventory, then heartbeats.
Registration is retried with backoff until the master answers (a node may start before its master, and a
restarted master must get the node's objects back). A heartbeat reply with ``reregister`` (the master
restarted and does not know this node) triggers a fresh RegisterNode carrying the inventory, which is how the
index is rebuilt without any data moving. Every call has a deadline; an unreachable master never blocks
the data plane. A heartbeat waits at most two intervals (at least 1 s): longer than that the master has
stopped counting it anyway. All calls go through a :class:`~kvpool.kvstore.protocol.master_link.MasterLink`,
which drops a connection that let a call time out (a partition leaves it in TCP's retransmission backoff long
after the link heals; a new connection's handshake goes out at once), so a healed node is back in the index
within about one heartbeat. HA: the master address may list the masters of a group (``a,b``). The link
follows a standby's ``NotLeaderError`` to the leader it names (or the next master when one cannot be
reached); whenever the link has moved, the node registers again, with its inventory, which is how a new
leader rebuilds its index. Every leader reply carries its epoch, which the node's ``EpochFence`` remembers so
that a deposed leader's later orders and puts are refused.

**Metrics** (``--metrics-port``, served by ``kvpool.runtime.metrics_http``): the object table is read at
scrape time on the loop that mutates it, so every scrape is a consistent snapshot and no lock is needed. Each
node renders its own ``CollectorRegistry`` (never prometheus_client's global default), so tests that run
several services in one interpreter do not mix their series. The data servers and the gRPC control plane see
the store through a ``TransportTap`` (a thin proxy over ``ObjectStore``) that attributes landed puts and
served reads to the transport that carried them: ``tcp`` / ``ucx`` frames, and ``shm`` for reserve+seal puts
and located extents (the reader copies a located extent out of the shared segment itself; the node counts
the bytes it handed out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from kvpool.kvstore.errors import BadRequestError, StoreError, UnauthenticatedError
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.node.pool import SharedPool
from kvpool.kvstore.node.tcp_server import TcpDataServer
from kvpool.kvstore.protocol.master_link import MasterLink
from kvpool.kvstore.protocol.shm_segment import host_id
from kvpool.kvstore.shards import DEFAULT_DEPTH, ShardSet, master_groups
from kvpool.proto import common_pb2, master_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime import cluster_auth
from kvpool.runtime.grpc_server import GrpcServer
from kvpool.runtime.lifecycle import print_ready, wait_for_stop_signal
from kvpool.runtime.metrics_http import MetricsHttpServer
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
TRANSPORTS = ("tcp", "shm", "ucx")
RESERVATION_REAP_S = 5.0
SERVICE_NAME = "kvpool.v1.StorageNode"
MAX_KEYS_PER_CALL = 100_000
MASTER_CALL_TIMEOUT_S = 5.0


@dataclass
class NodeConfig:
    """Everything ``kvpool store node`` accepts."""

    capacity: int = 1 << 30
    master: str | None = None  # HOST:PORT (A,B: an HA group; G0;G1: shards); None = standalone
    shard_depth: int = DEFAULT_DEPTH  # with master shards: blocks of a chain that choose its shard
    # with master shards: how long start() waits for every shard to have the node before it is ready anyway
    shard_register_wait_s: float = 10.0
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
            self.store.fenced(request.epoch, what, request.shard)
        except StoreError as exc:
            await self._fail(context, exc)

    async def Delete(self, request, context):
        await self._check_order(request, context, "Delete")
        done, missing = self.store.delete(list(request.keys), request.shard)
        return node_pb2.KeysReply(done=done, missing=missing)

    async def Demote(self, request, context):
        await self._check_order(request, context, "Demote")
        # Shielded: a master whose call timed out cancels this handler, and a demotion cut between its SSD
        # write and its bookkeeping would leave files and reserved SSD bytes no object owns (adopted again
        # at the next start). The moves finish; the master learns the outcome by asking again.
        done, missing = await asyncio.shield(self.store.demote(list(request.keys), request.shard))
        return node_pb2.KeysReply(done=done, missing=missing)

    async def Promote(self, request, context):
        await self._check_order(request, context, "Promote")
        try:
            done, missing = await self.store.promote(list(request.keys), request.shard)
        except StoreError as exc:
            await self._fail(context, exc)
        return node_pb2.KeysReply(done=done, missing=missing)


# -- the link to the master -----------------------------------------------------------------------------
class MasterRegistration:
    """Registers ``endpoint`` with the master at ``address`` and keeps it alive."""

    def __init__(
        self,
        address: str,
        store: ObjectStore,
        endpoint: common_pb2.NodeEndpoint,
        shards: ShardSet | None = None,
        shard: int = 0,
    ) -> None:
        self.link = MasterLink(address, MASTER_CALL_TIMEOUT_S)
        self.store = store
        self.endpoint = endpoint
        self.shards = shards or ShardSet()
        self.shard = shard  # master shards: this link's shard gets 1/count of the pool and its own objects
        self.heartbeat_interval_s = 1.0
        self._registered_at = ""  # the master the last registration went to
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        """The master this node talks to now (the leader, as far as it knows)."""
        return self.link.address

    async def register(self) -> master_pb2.RegisterNodeReply:
        reply = await self.link.register_node(
            master_pb2.RegisterNodeRequest(
                node=self.endpoint,
                dram_capacity_bytes=self.store.pool.capacity // self.shards.count,
                ssd_capacity_bytes=self.store.ssd_capacity // self.shards.count,
                inventory=self.store.inventory(self.shard if self.shards.sharded else None),
                shard_set=str(self.shards) if self.shards.sharded else "",
            )
        )
        self._registered_at = self.address
        self.store.fence_of(self.shard).observe(reply.epoch)
        if reply.heartbeat_interval_ms:
            self.heartbeat_interval_s = reply.heartbeat_interval_ms / 1000
        self.store.count("registrations")
        return reply

    async def register_until_done(self, backoff_max_s: float = 2.0) -> master_pb2.RegisterNodeReply:
        delay = 0.05
        while True:
            try:
                return await self.register()
            except (BadRequestError, UnauthenticatedError) as exc:
                # e.g. ShardSetError, or no / another cluster secret: retrying cannot help, the operator must
                log.error("RegisterNode at %s refused: %s", self.address, exc)
                raise
            except StoreError as exc:
                log.warning(
                    "RegisterNode at %s failed (%s: %s); retrying", self.address, type(exc).__name__, exc
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, backoff_max_s)

    def start_heartbeats(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            alloc = self.store.pool.allocator
            try:
                if self.address != self._registered_at:  # the link moved to another master (HA)
                    self.store.count("master_moves")
                    await self.register()
                    continue
                reply = await self.link.heartbeat(
                    master_pb2.HeartbeatRequest(
                        node_id=self.endpoint.node_id,
                        dram_used_bytes=alloc.used_bytes,
                        ssd_used_bytes=self.store.ssd_used,
                        fragmentation=alloc.fragmentation,
                    ),
                    self.heartbeat_timeout_s,
                )
                self.store.fence_of(self.shard).observe(reply.epoch)
                if reply.reregister:
                    await self.register()
            except StoreError as exc:
                self.store.count("heartbeat_failures")
                log.debug("heartbeat to %s failed: %s", self.address, type(exc).__name__)

    @property
    def heartbeat_timeout_s(self) -> float:
        return min(max(2 * self.heartbeat_interval_s, 1.0), MASTER_CALL_TIMEOUT_S)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.link.close()


# -- metrics --------------------------------------------------------------------------------------------
class TransportBytes:
    """Bytes and objects moved per (transport, direction), filled by the ``TransportTap`` proxies."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = {}
        self.objects: dict[tuple[str, str], int] = {}

    def add(self, transport: str, direction: str, size: int) -> None:
        k = (transport, direction)
        self.bytes[k] = self.bytes.get(k, 0) + size
        self.objects[k] = self.objects.get(k, 0) + 1


class TransportTap:
    """Delegates everything to the wrapped ``ObjectStore``; counts what ``transport`` carried.

    ``finish_put`` / ``read`` are the frame transport's own puts and gets; ``seal`` (a non-aborted shm
    reservation) and ``locate`` are the shm path. Internal calls of the store (``seal`` -> ``finish_put``)
    reach the real store, so nothing is counted twice.
    """

    def __init__(self, store, transport: str, counts: TransportBytes) -> None:  # type: ignore[no-untyped-def]
        self._store = store
        self._transport = transport
        self._counts = counts

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._store, name)

    def finish_put(self, pending) -> None:  # type: ignore[no-untyped-def]
        before = self._store.counters.get("puts", 0)
        self._store.finish_put(pending)
        if self._store.counters.get("puts", 0) > before:  # landed (not a duplicate)
            self._counts.add(self._transport, "in", pending.meta.size)

    async def read(self, obj, verify: bool = True):  # type: ignore[no-untyped-def]
        data = await self._store.read(obj, verify)
        self._counts.add(self._transport, "out", obj.meta.size)
        return data

    def seal(self, put_id: str, abort: bool, checksum: int = 0) -> None:
        pending = self._store.pending.get(put_id)
        before = self._store.counters.get("puts", 0)
        self._store.seal(put_id, abort, checksum)
        if pending is not None and not abort and self._store.counters.get("puts", 0) > before:
            self._counts.add("shm", "in", pending.meta.size)

    async def locate(self, key: bytes):  # type: ignore[no-untyped-def]
        extent = await self._store.locate(key)
        self._counts.add("shm", "out", extent.size)
        return extent


class NodeCollector(Collector):
    """Reads the node's ``ObjectStore`` at scrape time (on the node's loop)."""

    def __init__(self, store, counts: TransportBytes, node_id: Callable[[], str]) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.counts = counts
        self.node_id = node_id

    def describe(self) -> Iterator:  # no up-front describe: the collector is only ever scraped live
        return iter(())

    def collect(self) -> Iterator:
        s = self.store
        alloc = s.pool.allocator
        counters = dict(s.counters)
        n = "kvpool_node_"

        def gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(n + name, help_, value=value)

        def counter(name: str, help_: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(n + name, help_, value=value)

        yield gauge("dram_used_bytes", "DRAM pool bytes allocated", alloc.used_bytes)
        yield gauge("dram_capacity_bytes", "DRAM pool size", alloc.capacity)
        yield gauge("ssd_used_bytes", "SSD tier bytes used (writes in flight included)", s.ssd_used)
        yield gauge("ssd_capacity_bytes", "SSD tier size (0 = no SSD tier)", s.ssd_capacity)
        yield gauge(
            "fragmentation", "DRAM free-space fragmentation (0 = one free extent)", alloc.fragmentation
        )
        objects = GaugeMetricFamily(n + "objects", "objects held, by tier", labels=["tier"])
        dram = sum(1 for o in list(s.objects.values()) if o.extent is not None)
        objects.add_metric(["dram"], dram)
        objects.add_metric(["ssd"], len(s.objects) - dram)
        yield objects
        yield gauge("pending_puts", "shm put reservations not yet sealed", len(s.pending))
        moved = CounterMetricFamily(
            n + "transport_bytes",
            "object bytes moved, by transport and direction",
            labels=["transport", "direction"],
        )
        ops = CounterMetricFamily(
            n + "transport_objects",
            "objects moved, by transport and direction",
            labels=["transport", "direction"],
        )
        for (transport, direction), v in sorted(dict(self.counts.bytes).items()):
            moved.add_metric([transport, direction], v)
        for (transport, direction), v in sorted(dict(self.counts.objects).items()):
            ops.add_metric([transport, direction], v)
        yield moved
        yield ops
        yield counter("bytes_in", "object bytes landed (every transport)", counters.get("bytes_in", 0))
        yield counter("bytes_out", "object bytes served by tcp/ucx reads", counters.get("bytes_out", 0))
        failures = CounterMetricFamily(
            n + "checksum_failures", "payloads that failed their checksum on the node", labels=["where"]
        )
        failures.add_metric(["put"], counters.get("puts_checksum_rejected", 0))
        failures.add_metric(["read"], counters.get("reads_corrupt", 0))
        yield failures
        yield counter("demotions", "objects moved DRAM -> SSD", counters.get("demotes", 0))
        yield counter("promotions", "objects moved SSD -> DRAM", counters.get("promotes", 0))
        events = CounterMetricFamily(n + "events", "the node's own event counters", labels=["event"])
        for name, v in sorted(counters.items()):
            events.add_metric([name], v)
        yield events
        info = GaugeMetricFamily(n + "info", "node identity", labels=["node_id"])
        info.add_metric([self.node_id()], 1)
        yield info


def node_registry(store, counts: TransportBytes, node_id: Callable[[], str]) -> CollectorRegistry:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(store, counts, node_id))
    return registry


# -- the node ---------------------------------------------------------------------------------------------
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
        self.masters: list[MasterRegistration] = []  # one per master shard
        self._registrations: list[asyncio.Task] = []  # each shard's first registration
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
            groups = master_groups(cfg.master)
            shards = ShardSet(len(groups), cfg.shard_depth)
            self.masters = [
                MasterRegistration(group, self.store, self.endpoint, shards, shard)
                for shard, group in enumerate(groups)
            ]
            # each shard on its own: heartbeats start as soon as that shard has the node. One master: ready
            # once it has the node (as always). Shards: ready once each has it or after shard_register_wait_s,
            # the rest keep trying in the background, so a dead shard never keeps the node from the others
            first = []
            for m in self.masters:
                task = asyncio.get_running_loop().create_task(m.register_until_done())
                task.add_done_callback(
                    lambda t, m=m: None if t.cancelled() or t.exception() else m.start_heartbeats()
                )
                first.append(task)
            self._registrations = first
            timeout = None if len(first) == 1 else cfg.shard_register_wait_s
            await asyncio.wait(first, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
            for task in first:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]  # refused: the node does not start

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
        for task in self._registrations:
            task.cancel()
        for m in self.masters:
            await m.close()
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
    try:
        asyncio.run(serve(config))
    except (BadRequestError, UnauthenticatedError) as exc:  # a master refused this node (another shard set,
        print(f"kvpool store node: {type(exc).__name__}: {exc}", file=sys.stderr)  # no or another secret):
        return 2  # said once, exit 2
    return 0
