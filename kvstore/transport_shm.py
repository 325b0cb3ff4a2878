"""shm transport: same-host copies straight into / out of the node's shared-memory pool (one memcpy).

Reads: the node's ``Locate`` returns the object's extent; the client copies it out of the mapped segment and
verifies the checksum after the copy. The master's read-pin lease (taken by Lookup/MatchPrefix with
acquire=true) keeps the extent from being evicted during the copy; the checksum catches anything else.
Writes: ``ShmReserve`` allocates an extent for the put, the client copies into it, ``ShmSeal`` makes the node
verify the checksum and publish the object (or ``abort`` frees it). Control calls are gRPC with deadlines.

Only usable when the node is on this host (same ``host_id``) and advertises its segment; asking for shm
otherwise raises ``TransportUnavailableError`` (no silent fallback).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from multiprocessing import shared_memory

import grpc
from kvpool.kvstore.client_rpc import CHANNEL_OPTIONS, raise_typed
from kvpool.kvstore.errors import (
    BadRequestError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
    TransportUnavailableError,
)
from kvpool.kvstore.pool import attach_segment
from kvpool.kvstore.transport_base import (
    DEFAULT_DEADLINES,
    Buffer,
    Deadlines,
    Transport,
    as_bytes_view,
    verify_checksum,
)
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc


class ShmTransport(Transport):
    """Keeps one gRPC channel and one segment mapping per node."""

    name = "shm"

    def __init__(self, local_host_id: str, deadlines: Deadlines = DEFAULT_DEADLINES) -> None:
        super().__init__(deadlines)
        self.local_host_id = local_host_id
        self._channels: dict[str, tuple[grpc.aio.Channel, node_pb2_grpc.StorageNodeStub]] = {}
        self._segments: dict[str, shared_memory.SharedMemory] = {}

    def reachable(self, node: common_pb2.NodeEndpoint) -> bool:
        return bool(node.shm_name) and node.host_id == self.local_host_id

    def _check(self, node: common_pb2.NodeEndpoint) -> None:
        if not self.reachable(node):
            why = "does not export a shm pool" if not node.shm_name else "is on another host"
            raise TransportUnavailableError(f"shm: node {node.node_id} {why}")

    def _stub(self, node: common_pb2.NodeEndpoint) -> node_pb2_grpc.StorageNodeStub:
        target = f"{node.host}:{node.grpc_port}"
        entry = self._channels.get(target)
        if entry is None:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            entry = (channel, node_pb2_grpc.StorageNodeStub(channel))
            self._channels[target] = entry
        return entry[1]

    def _segment(self, name: str) -> memoryview:
        shm = self._segments.get(name)
        if shm is None:
            try:
                shm = attach_segment(name)
            except FileNotFoundError as exc:
                raise StoreUnavailableError(f"shm segment {name} is gone (node stopped?)") from exc
            self._segments[name] = shm
        return shm.buf

    async def _call(self, method, request, size: int):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=self.deadlines.for_size(size))
        except grpc.aio.AioRpcError as exc:
            raise_typed(exc)

    async def put(
        self, node: common_pb2.NodeEndpoint, put_id: str, meta: common_pb2.ObjectMeta, data: Buffer
    ) -> None:
        self._check(node)
        view = as_bytes_view(data)
        if len(view) != meta.size:
            raise ValueError(f"data is {len(view)} B, meta says {meta.size} B")
        stub = self._stub(node)
        reply = await self._call(stub.ShmReserve, node_pb2.ShmReserveRequest(put_id=put_id, meta=meta), 0)
        if reply.exists:
            return
        try:
            seg = self._segment(reply.shm_name)
            seg[reply.offset : reply.offset + meta.size] = view
        except BaseException:
            with contextlib.suppress(StoreError):
                await self._call(stub.ShmSeal, node_pb2.ShmSealRequest(put_id=put_id, abort=True), 0)
            raise
        await self._call(stub.ShmSeal, node_pb2.ShmSealRequest(put_id=put_id), meta.size)
        self.bytes_out += meta.size

    async def _get_into(self, location: common_pb2.ObjectLocation, out: memoryview) -> int:
        node = location.node
        self._check(node)
        reply = await self._call(self._stub(node).Locate, node_pb2.KeysRequest(keys=[location.meta.key]), 0)
        if not reply.extents:
            raise ObjectNotFoundError(f"key {location.meta.key[:8].hex()}… not in node {node.node_id}'s DRAM")
        ext = reply.extents[0]
        if ext.size > len(out):
            raise ValueError(f"buffer of {len(out)} B is smaller than the object ({ext.size} B)")
        seg = self._segment(reply.shm_name)
        out[: ext.size] = seg[ext.offset : ext.offset + ext.size]
        return ext.size

    async def batch_get_into(
        self, items: Sequence[tuple[common_pb2.ObjectLocation, Buffer]]
    ) -> list[int | StoreError]:
        """One ``Locate`` per node for the whole batch (not one per object), then plain copies."""
        results: list[int | StoreError] = [StoreError("not run")] * len(items)
        by_node: dict[str, list[int]] = {}
        for i, (loc, _out) in enumerate(items):
            by_node.setdefault(f"{loc.node.host}:{loc.node.grpc_port}", []).append(i)

        async def run(idx: list[int]) -> None:
            node = items[idx[0]][0].node
            try:
                self._check(node)
                keys = [items[i][0].meta.key for i in idx]
                reply = await self._call(self._stub(node).Locate, node_pb2.KeysRequest(keys=keys), 0)
                seg = self._segment(reply.shm_name)
            except StoreError as exc:
                for i in idx:
                    results[i] = exc
                return
            extents = {e.key: e for e in reply.extents}
            for i in idx:
                loc, out = items[i]
                ext = extents.get(loc.meta.key)
                try:
                    if ext is None:
                        raise ObjectNotFoundError(
                            f"key {loc.meta.key[:8].hex()}… not in {node.node_id}'s DRAM"
                        )
                    view = as_bytes_view(out)
                    if ext.size > len(view):
                        raise BadRequestError(
                            f"buffer of {len(view)} B is smaller than the object ({ext.size} B)"
                        )
                    view[: ext.size] = seg[ext.offset : ext.offset + ext.size]
                    verify_checksum(view[: ext.size], loc.meta.checksum, loc.meta.key)
                    self.bytes_in += ext.size
                    results[i] = ext.size
                except StoreError as exc:
                    results[i] = exc

        await asyncio.gather(*(run(idx) for idx in by_node.values()))
        return results

    async def close(self) -> None:
        for channel, _stub in self._channels.values():
            await channel.close()
        self._channels.clear()
        for shm in self._segments.values():
            with contextlib.suppress(Exception):
                shm.close()
        self._segments.clear()
