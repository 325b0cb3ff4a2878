"""The StorageNode gRPC control plane (proto/node.proto) over a node's ``ObjectStore``.

Typed store errors become gRPC statuses (missing → NOT_FOUND, full → RESOURCE_EXHAUSTED, bad input →
INVALID_ARGUMENT, corrupt → DATA_LOSS) so the master and clients can tell them apart; the service keeps
serving after any of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
from kvpool.kvstore.errors import (
    StoreError,
)
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.protocol.grpc_errors import status_of
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime import cluster_auth

SERVICE_NAME = "kvpool.v1.StorageNode"
MAX_KEYS_PER_CALL = 100_000


def grpc_code_for(exc: StoreError) -> grpc.StatusCode:
    return status_of(exc)


class StorageNodeService(node_pb2_grpc.StorageNodeServicer):
    """gRPC handlers; ``endpoint`` is filled in by the node once all ports are bound."""

    def __init__(
        self,
        store: ObjectStore,
        endpoint: Callable[[], common_pb2.NodeEndpoint],
        reservation_ttl_s: float = 30.0,
    ) -> None:
        self.store = store
        self._endpoint = endpoint
        self.reservation_ttl_s = reservation_ttl_s

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, exc: StoreError) -> None:
        await context.abort(grpc_code_for(exc), f"{type(exc).__name__}: {exc}")

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

    async def Locate(self, request, context):
        """Extents for the shm path; SSD-only objects are promoted first (missing if no DRAM space)."""
        await self._check_keys(request, context)
        reply = node_pb2.LocateReply(shm_name=self.store.pool.name)
        for key in request.keys:
            try:
                extent = await self.store.locate(key)
            except StoreError:  # absent, SSD-only without DRAM room, or a damaged SSD copy
                reply.missing.append(key)
                continue
            checksum = self.store.objects[key].meta.checksum
            reply.extents.append(
                node_pb2.ShmExtent(key=key, offset=extent.offset, size=extent.size, checksum=checksum)
            )
        return reply

    async def ShmReserve(self, request, context):
        self.store.reap_reservations()
        try:
            pending = self.store.reserve(request.put_id, request.meta, self.reservation_ttl_s)
        except StoreError as exc:
            await self._fail(context, exc)
        if pending is None:
            return node_pb2.ShmReserveReply(shm_name=self.store.pool.name, exists=True)
        return node_pb2.ShmReserveReply(shm_name=self.store.pool.name, offset=pending.extent.offset)

    async def ShmSeal(self, request, context):
        try:
            self.store.seal(request.put_id, request.abort)
        except StoreError as exc:
            await self._fail(context, exc)
        return node_pb2.ShmSealReply()
