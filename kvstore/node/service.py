"""The StorageNode gRPC control plane (proto/node.proto) over a node's ``ObjectStore``: the master's orders
(Delete, Demote, Promote, fenced by leader epoch) and what an operator or a test asks (Info, Inventory).
Bytes and the shm control ops (LOCATE / RESERVE / SEAL) go over the tcp data plane (``tcp_server``).

Typed store errors become gRPC statuses (missing → NOT_FOUND, full → RESOURCE_EXHAUSTED, bad input →
INVALID_ARGUMENT, corrupt → DATA_LOSS) so the master and clients can tell them apart; the service keeps
serving after any of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.protocol.grpc_errors import status_of
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime import cluster_auth

SERVICE_NAME = "kvpool.v1.StorageNode"
MAX_KEYS_PER_CALL = 100_000


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
        await context.abort(status_of(exc), f"{type(exc).__name__}: {exc}")

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
