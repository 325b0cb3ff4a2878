"""The node's link to the master: RegisterNode with the full inventory, then heartbeats.

Registration is retried with backoff until the master answers (a node may start before its master, and a
restarted master must get the node's objects back). A heartbeat reply with ``reregister`` (the master
restarted and does not know this node) triggers a fresh RegisterNode carrying the inventory, which is how the
index is rebuilt without any data moving. Every call has a deadline; an unreachable master never blocks
the data plane.

A heartbeat waits at most two intervals (at least 1 s): longer than that the master has stopped counting it
anyway. After a heartbeat that timed out the node opens a new channel: a partition leaves the old TCP
connection in exponential retransmission backoff (seconds by the time the link heals), while a new
connection's handshake goes out at once, so a healed node is back in the index within about one heartbeat.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.protocol.grpc_errors import CHANNEL_OPTIONS
from kvpool.proto import common_pb2, master_pb2, master_pb2_grpc

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 5.0


class MasterRegistration:
    """Registers ``endpoint`` with the master at ``address`` and keeps it alive."""

    def __init__(self, address: str, store: ObjectStore, endpoint: common_pb2.NodeEndpoint) -> None:
        self.address = address
        self.store = store
        self.endpoint = endpoint
        self.heartbeat_interval_s = 1.0
        self.registrations = 0
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self._task: asyncio.Task | None = None

    async def register(self) -> master_pb2.RegisterNodeReply:
        reply = await self._stub.RegisterNode(
            master_pb2.RegisterNodeRequest(
                node=self.endpoint,
                dram_capacity_bytes=self.store.pool.capacity,
                ssd_capacity_bytes=self.store.ssd_capacity,
                inventory=self.store.inventory(),
            ),
            timeout=CALL_TIMEOUT_S,
        )
        if reply.heartbeat_interval_ms:
            self.heartbeat_interval_s = reply.heartbeat_interval_ms / 1000
        self.registrations += 1
        self.store.count("registrations")
        return reply

    async def register_until_done(self, backoff_max_s: float = 2.0) -> master_pb2.RegisterNodeReply:
        delay = 0.05
        while True:
            try:
                return await self.register()
            except grpc.aio.AioRpcError as exc:
                log.warning("RegisterNode at %s failed (%s); retrying", self.address, exc.code().name)
                await asyncio.sleep(delay)
                delay = min(delay * 2, backoff_max_s)

    def start_heartbeats(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            alloc = self.store.pool.allocator
            try:
                reply = await self._stub.Heartbeat(
                    master_pb2.HeartbeatRequest(
                        node_id=self.endpoint.node_id,
                        dram_used_bytes=alloc.used_bytes,
                        ssd_used_bytes=self.store.ssd_used,
                        fragmentation=alloc.fragmentation,
                    ),
                    timeout=self.heartbeat_timeout_s,
                )
                if reply.reregister:
                    await self.register()
            except grpc.aio.AioRpcError as exc:
                self.store.count("heartbeat_failures")
                log.debug("heartbeat to %s failed: %s", self.address, exc.code().name)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    await self._new_channel()

    @property
    def heartbeat_timeout_s(self) -> float:
        return min(max(2 * self.heartbeat_interval_s, 1.0), CALL_TIMEOUT_S)

    async def _new_channel(self) -> None:
        old = self._channel
        self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self.store.count("master_reconnects")
        await old.close(grace=None)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()
