"""gRPC server for the Master service (grpc.aio), the standard gRPC health service, and the master wire
listener (``master_wire``: the clients' hot calls without gRPC's per-call cost) next to them.

Every handler runs the synchronous :class:`~kvpool.kvstore.master.core.MasterCore` method on the event loop
(one thread: no locks) through :class:`~kvpool.kvstore.master.dispatch.CoreDispatch`, shared with the wire: a
:class:`~kvpool.kvstore.master.core.MasterError` becomes its status code with the message, any other exception
INTERNAL without taking the server down, and the node orders the call produced go to the
:class:`~kvpool.kvstore.master.node_notifier.NodeNotifier` right away. ``Describe`` tells clients the wire
port. A background task runs :meth:`MasterCore.sweep` (dead nodes, abandoned puts, lease/pin/TTL expiry) every
``sweep_interval_s``. Sync and async client stubs both work against it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from kvpool.kvstore.master.config import MasterConfig
from kvpool.kvstore.master.core import MasterCore
from kvpool.kvstore.master.dispatch import CoreCallError, CoreDispatch
from kvpool.kvstore.master.node_notifier import NodeNotifier
from kvpool.kvstore.master.records import NodeAction
from kvpool.kvstore.master.wire_server import MasterWireServer
from kvpool.kvstore.protocol.master_wire import METHODS as WIRE_METHODS
from kvpool.proto import master_pb2, master_pb2_grpc
from kvpool.runtime.grpc_server import GrpcServer

log = logging.getLogger(__name__)

SERVICE_NAME = "kvpool.v1.Master"
MAX_MESSAGE_BYTES = 1 << 30  # a node's inventory of ~10M objects fits in one RegisterNode
Req = TypeVar("Req")


class MasterServicer(master_pb2_grpc.MasterServicer):
    """Adapter from gRPC calls to MasterCore methods (through the :class:`CoreDispatch` the wire shares)."""

    def __init__(
        self,
        dispatch: CoreDispatch,
        wire_port: int = 0,
        leadership: Callable[[], tuple[int, bool, str]] = lambda: (0, True, ""),
    ) -> None:
        self.dispatch = dispatch
        self.wire_port = wire_port  # 0: no wire listener
        self.leadership = leadership  # (epoch, leader?, leader address) for Describe; no HA: (0, True, "")

    async def _run(self, method: str, request: Req, context: grpc.aio.ServicerContext) -> Any:
        try:
            reply, done = self.dispatch.run(method, request)
        except CoreCallError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        await self.dispatch.settle(done)  # Remove: only once its nodes dropped the keys (WAITS_FOR_NODES)
        return reply

    async def RegisterNode(self, request, context):
        return await self._run("register_node", request, context)

    async def Heartbeat(self, request, context):
        return await self._run("heartbeat", request, context)

    async def PutStart(self, request, context):
        return await self._run("put_start", request, context)

    async def PutCommit(self, request, context):
        return await self._run("put_commit", request, context)

    async def PutStartBatch(self, request, context):
        return await self._run("put_start_batch", request, context)

    async def PutCommitBatch(self, request, context):
        return await self._run("put_commit_batch", request, context)

    async def PutAbort(self, request, context):
        return await self._run("put_abort", request, context)

    async def MatchPrefix(self, request, context):
        return await self._run("match_prefix", request, context)

    async def Lookup(self, request, context):
        return await self._run("lookup", request, context)

    async def Release(self, request, context):
        return await self._run("release", request, context)

    async def Remove(self, request, context):
        return await self._run("remove", request, context)

    async def Pin(self, request, context):
        return await self._run("pin", request, context)

    async def SetQuota(self, request, context):
        return await self._run("set_quota", request, context)

    async def Stats(self, request, context):
        return await self._run("stats", request, context)

    async def Describe(self, request, context):
        epoch, leader, leader_address = self.leadership()
        return master_pb2.DescribeReply(
            wire_port=self.wire_port,
            instance=self.dispatch.core.instance,
            wire_methods=sorted(WIRE_METHODS) if self.wire_port else [],
            epoch=epoch,
            leader=leader,
            leader_address=leader_address,
        )


class MasterServer:
    """A running master: ``port = await server.start()`` ... ``await server.stop()``; ``wire_port`` is the
    wire listener's port once started (0 when ``config.wire_port == -1``)."""

    def __init__(self, config: MasterConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config or MasterConfig()
        self.host = host
        self.requested_port = port
        timeout_s = self.config.node_call_timeout_ms / 1000.0
        self.notifier = NodeNotifier(timeout_s, lambda name, n: self.core.count(name, n), self._on_missing)
        self.dispatch = CoreDispatch(MasterCore(self.config), self.notifier)
        # HA (``ha.HaMaster``): (epoch, leader?, leader address) for Describe, and whether sweeps may act
        self.leadership: Callable[[], tuple[int, bool, str]] = lambda: (0, True, "")
        self.may_sweep: Callable[[], bool] = lambda: True
        self.sweep_interval_s = self.config.sweep_ms / 1000.0
        self.port = 0
        self.wire_port = 0
        self.wire: MasterWireServer | None = None
        self._server: GrpcServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def core(self) -> MasterCore:
        """The core serving now (with HA, a new one per election)."""
        return self.dispatch.core

    def replace_core(self, core: MasterCore) -> None:
        """HA: serve from ``core`` from now on; the old one's state (and unsent node orders) is dropped."""
        self.core.take_actions()
        self.dispatch.core = core

    async def start(self) -> int:
        if self.config.wire_port >= 0:
            self.wire = MasterWireServer(self.dispatch)
            self.wire_port = await self.wire.start(self.host, self.config.wire_port)
        try:
            return await self._start_grpc()
        except BaseException:
            if self.wire is not None:
                await self.wire.close()
            raise

    async def _start_grpc(self) -> int:
        servicer = MasterServicer(self.dispatch, self.wire_port, lambda: self.leadership())
        server = GrpcServer(
            {SERVICE_NAME: lambda s: master_pb2_grpc.add_MasterServicer_to_server(servicer, s)},
            self.host,
            self.requested_port,
            MAX_MESSAGE_BYTES,
        )
        self.port = await server.start()
        self._server = server
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        log.info(
            "master serving on %s:%d, wire %s (policy %s)",
            self.host,
            self.port,
            self.wire_port or "off",
            self.config.policy,
        )
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self.wire is not None:
            await self.wire.close()
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.notifier.idle(timeout_s=grace_s)
        await self.notifier.close()

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait()

    def _on_missing(self, node_id: str, action: NodeAction, keys: list[bytes]) -> None:
        self.core.node_could_not(node_id, action, keys)
        self.dispatch.flush()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            if not self.may_sweep():  # an HA standby, or a leader not sure it still leads: act on nothing
                continue
            try:
                self.core.sweep()
                self.dispatch.flush()
            except Exception:  # keep sweeping: one bad pass must not stop dead-node detection
                log.exception("master sweep failed")
                self.core.count("sweep_errors")
