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

HA: ``address`` may list the masters of a group (``a,b``). A standby answers ``NotLeaderError`` naming the
leader; the node moves there (or to the next master when one cannot be reached) and registers again, with
its inventory, which is how a new leader rebuilds its index. Every leader reply carries its epoch, which the
node's fence (``fence.EpochFence``) remembers so that a deposed leader's later orders and puts are refused.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from kvpool.kvstore.errors import NotLeaderError, StoreUnavailableError
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.protocol.grpc_errors import CHANNEL_OPTIONS, typed_error
from kvpool.kvstore.protocol.master_addresses import MasterAddresses
from kvpool.proto import common_pb2, master_pb2, master_pb2_grpc
from kvpool.runtime import cluster_auth

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 5.0


class MasterRegistration:
    """Registers ``endpoint`` with the master at ``address`` and keeps it alive."""

    def __init__(self, address: str, store: ObjectStore, endpoint: common_pb2.NodeEndpoint) -> None:
        self.masters = MasterAddresses(address)
        self.store = store
        self.endpoint = endpoint
        self.heartbeat_interval_s = 1.0
        self.registrations = 0
        self._channel = cluster_auth.aio_channel(self.address, CHANNEL_OPTIONS)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self._task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        """The master this node talks to now (the leader, as far as it knows)."""
        return self.masters.current

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
        self.store.fence.observe(reply.epoch)
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
                if await self._follow_leader(exc):
                    continue
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
                self.store.fence.observe(reply.epoch)
                if reply.reregister:
                    await self.register()
            except grpc.aio.AioRpcError as exc:
                self.store.count("heartbeat_failures")
                log.debug("heartbeat to %s failed: %s", self.address, exc.code().name)
                if await self._follow_leader(exc):
                    await self._register_soon()
                elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    await self._new_channel()

    async def _follow_leader(self, exc: grpc.aio.AioRpcError) -> bool:
        """After a failed call: with several masters, move to the leader a standby named (or the next master
        when this one is unreachable or silent) on a new channel. False when staying put."""
        err = typed_error(exc)
        if not isinstance(err, StoreUnavailableError) or not self.masters.several:
            return False
        before = self.address
        if not self.masters.follow(err.leader if isinstance(err, NotLeaderError) else None):
            return False
        log.info("master %s is not the leader (%s): moving to %s", before, type(err).__name__, self.address)
        self.store.count("master_moves")
        await self._new_channel()
        return True

    async def _register_soon(self) -> None:
        """Register at the master just moved to (bounded; the heartbeat loop retries on failure)."""
        try:
            await self.register()
        except grpc.aio.AioRpcError as exc:
            log.debug("RegisterNode at %s failed: %s", self.address, exc.code().name)

    @property
    def heartbeat_timeout_s(self) -> float:
        return min(max(2 * self.heartbeat_interval_s, 1.0), CALL_TIMEOUT_S)

    async def _new_channel(self) -> None:
        old = self._channel
        self._channel = cluster_auth.aio_channel(self.address, CHANNEL_OPTIONS)
        self._stub = master_pb2_grpc.MasterStub(self._channel)
        self.store.count("master_reconnects")
        await old.close(grace=None)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()
