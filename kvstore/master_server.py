"""gRPC server for the Master service (grpc.aio) plus the standard gRPC health service.

Every handler runs the synchronous :class:`~kvpool.kvstore.master.MasterCore` method on the event loop
(one thread: no locks), maps :class:`~kvpool.kvstore.master.MasterError` to its status code with the
message, and turns any unexpected exception into INTERNAL without taking the server down. Node orders the
call produced are handed to :class:`~kvpool.kvstore.master_nodes.NodeNotifier` right away. A background
task runs :meth:`MasterCore.sweep` (dead nodes, abandoned puts, lease/pin/TTL expiry) every
``sweep_interval_s``. Sync and async client stubs both work against it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvpool.kvstore.master import MasterConfig, MasterCore, MasterError, NodeAction
from kvpool.kvstore.master_nodes import NodeNotifier
from kvpool.proto import master_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "kvpool.v1.Master"
MAX_MESSAGE_BYTES = 1 << 30  # a node's inventory of ~10M objects fits in one RegisterNode
Req = TypeVar("Req")


class MasterServicer(master_pb2_grpc.MasterServicer):
    """Adapter from gRPC calls to MasterCore methods."""

    def __init__(self, core: MasterCore, notifier: NodeNotifier) -> None:
        self.core = core
        self.notifier = notifier

    async def _run(
        self,
        fn: Callable[[Req], Any],
        request: Req,
        context: grpc.aio.ServicerContext,
        wait_nodes: bool = False,
    ) -> Any:
        try:
            reply = fn(request)
        except MasterError as exc:
            self.core.count(f"rpc_{exc.code.lower()}")
            await context.abort(grpc.StatusCode[exc.code], str(exc))
        except Exception as exc:  # a bug must cost one call, never the server
            log.exception("%s failed", getattr(fn, "__name__", fn))
            self.core.count("rpc_internal")
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        actions = self.core.take_actions()
        if actions:
            done = self.notifier.submit(actions)
            if wait_nodes and done:  # bounded: a dead node is dropped by the sweep anyway
                await asyncio.wait(done, timeout=self.notifier.timeout_s)
        return reply

    async def RegisterNode(self, request, context):
        return await self._run(self.core.register_node, request, context)

    async def Heartbeat(self, request, context):
        return await self._run(self.core.heartbeat, request, context)

    async def PutStart(self, request, context):
        return await self._run(self.core.put_start, request, context)

    async def PutCommit(self, request, context):
        return await self._run(self.core.put_commit, request, context)

    async def PutAbort(self, request, context):
        return await self._run(self.core.put_abort, request, context)

    async def MatchPrefix(self, request, context):
        return await self._run(self.core.match_prefix, request, context)

    async def Lookup(self, request, context):
        return await self._run(self.core.lookup, request, context)

    async def Release(self, request, context):
        return await self._run(self.core.release, request, context)

    async def Remove(self, request, context):
        # answer only once the nodes dropped the keys: clients read keys they know straight from nodes,
        # and a removed key must never be readable again after "removed"
        return await self._run(self.core.remove, request, context, wait_nodes=True)

    async def Pin(self, request, context):
        return await self._run(self.core.pin, request, context)

    async def SetQuota(self, request, context):
        return await self._run(self.core.set_quota, request, context)

    async def Stats(self, request, context):
        return await self._run(self.core.stats, request, context)


class MasterServer:
    """A running master: ``port = await server.start()`` ... ``await server.stop()``."""

    def __init__(self, config: MasterConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config or MasterConfig()
        self.host = host
        self.requested_port = port
        self.core = MasterCore(self.config)
        timeout_s = self.config.node_call_timeout_ms / 1000.0
        self.notifier = NodeNotifier(timeout_s, self.core.count, self._on_missing)
        self.health = health.aio.HealthServicer()
        self.sweep_interval_s = self.config.sweep_ms / 1000.0
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> int:
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
        )
        master_pb2_grpc.add_MasterServicer_to_server(MasterServicer(self.core, self.notifier), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(f"{self.host}:{self.requested_port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.host}:{self.requested_port}")
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        log.info("master serving on %s:%d (policy %s)", self.host, self.port, self.config.policy)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.notifier.idle(timeout_s=grace_s)
        await self.notifier.close()

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def _on_missing(self, node_id: str, action: NodeAction, keys: list[bytes]) -> None:
        self.core.node_could_not(node_id, action, keys)
        actions = self.core.take_actions()
        if actions:
            self.notifier.submit(actions)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                self.core.sweep()
                actions = self.core.take_actions()
                if actions:
                    self.notifier.submit(actions)
            except Exception:  # keep sweeping: one bad pass must not stop dead-node detection
                log.exception("master sweep failed")
                self.core.count("sweep_errors")

