"""The node's link to the master: RegisterNode with the full inventory, then heartbeats.

Registration is retried with backoff until the master answers (a node may start before its master, and a
restarted master must get the node's objects back). A heartbeat reply with ``reregister`` (the master
restarted and does not know this node) triggers a fresh RegisterNode carrying the inventory, which is how the
index is rebuilt without any data moving. Every call has a deadline; an unreachable master never blocks
the data plane.

A heartbeat waits at most two intervals (at least 1 s): longer than that the master has stopped counting it
anyway. All calls go through a :class:`~kvpool.kvstore.protocol.master_link.MasterLink`, which drops a
connection that let a call time out (a partition leaves it in TCP's retransmission backoff long after the
link heals; a new connection's handshake goes out at once), so a healed node is back in the index within
about one heartbeat.

HA: ``address`` may list the masters of a group (``a,b``). The link follows a standby's ``NotLeaderError`` to
the leader it names (or the next master when one cannot be reached); whenever the link has moved, the node
registers again, with its inventory, which is how a new leader rebuilds its index. Every leader reply carries
its epoch, which the node's fence (``fence.EpochFence``) remembers so that a deposed leader's later orders
and puts are refused.
"""

from __future__ import annotations

import asyncio
import logging

from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.protocol.master_link import MasterLink
from kvpool.proto import common_pb2, master_pb2

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 5.0


class MasterRegistration:
    """Registers ``endpoint`` with the master at ``address`` and keeps it alive."""

    def __init__(self, address: str, store: ObjectStore, endpoint: common_pb2.NodeEndpoint) -> None:
        self.link = MasterLink(address, CALL_TIMEOUT_S)
        self.store = store
        self.endpoint = endpoint
        self.heartbeat_interval_s = 1.0
        self.registrations = 0
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
                dram_capacity_bytes=self.store.pool.capacity,
                ssd_capacity_bytes=self.store.ssd_capacity,
                inventory=self.store.inventory(),
            )
        )
        self._registered_at = self.address
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
            except StoreError as exc:
                log.warning("RegisterNode at %s failed (%s); retrying", self.address, type(exc).__name__)
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
                self.store.fence.observe(reply.epoch)
                if reply.reregister:
                    await self.register()
            except StoreError as exc:
                self.store.count("heartbeat_failures")
                log.debug("heartbeat to %s failed: %s", self.address, type(exc).__name__)

    @property
    def heartbeat_timeout_s(self) -> float:
        return min(max(2 * self.heartbeat_interval_s, 1.0), CALL_TIMEOUT_S)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.link.close()
