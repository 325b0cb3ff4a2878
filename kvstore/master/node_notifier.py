"""The master's outbound calls to storage nodes: Delete / Demote / Promote over node.proto.

One worker task per node sends that node's queued keys in order, in chunks, each call under a deadline.
A slow or dead node only delays its own queue: the master never awaits these calls while answering a
client, and a failure is logged and counted (the node's next RegisterNode reconciles any drift, and a dead
node is dropped by the heartbeat sweep anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from kvpool.kvstore.master.core import NodeAction, PendingActions
from kvpool.proto import common_pb2, node_pb2, node_pb2_grpc
from kvpool.runtime import cluster_auth

log = logging.getLogger(__name__)

MAX_KEYS_PER_NODE_CALL = 10_000


class _NodeWorker:
    def __init__(self, endpoint: common_pb2.NodeEndpoint) -> None:
        self.node_id = endpoint.node_id
        self.address = f"{endpoint.host}:{endpoint.grpc_port}"
        self.channel = cluster_auth.aio_channel(self.address)
        self.stub = node_pb2_grpc.StorageNodeStub(self.channel)
        # (action, keys, epoch, sent), in order; ``sent`` resolves once the call was made (answered or failed)
        self.queue: list[tuple[NodeAction, list[bytes], int, asyncio.Future[None]]] = []
        self.deleting: dict[bytes, asyncio.Future[None]] = {}  # key -> its latest queued delete's ``sent``
        self.task: asyncio.Task[None] | None = None


class NodeNotifier:
    """Delivers :class:`PendingActions` to nodes; ``count(name, n)`` records outcomes and ``on_missing``
    hears which keys a node could not act on (e.g. a demotion its SSD had no room for, or a demotion call
    that failed: the node may not have moved them)."""

    def __init__(
        self,
        timeout_s: float,
        count: Callable[[str, int], None],
        on_missing: Callable[[str, NodeAction, list[bytes]], None] | None = None,
        shard: int = 0,
    ) -> None:
        self.timeout_s = timeout_s
        self.shard = shard  # master shards: nodes act only on objects this shard placed
        self._count = count
        self._on_missing = on_missing
        self._workers: dict[str, _NodeWorker] = {}

    def submit(self, batches: list[PendingActions]) -> None:
        """Queue the calls and return: the master never waits for nodes while answering (a removed key's
        node drops it moments later; clients find keys only through the master, which no longer lists it)."""
        loop = asyncio.get_running_loop()
        for batch in batches:
            worker = self._worker(batch.node)
            for action in (NodeAction.PROMOTE, NodeAction.DEMOTE, NodeAction.DELETE):
                keys = batch.keys.get(action)
                if keys:
                    sent = loop.create_future()
                    worker.queue.append((action, keys, batch.epoch, sent))
                    if action == NodeAction.DELETE:
                        worker.deleting.update(dict.fromkeys(keys, sent))
            if worker.task is None or worker.task.done():
                worker.task = loop.create_task(self._drain(worker))

    def delete_pending(self, node_id: str, key: bytes) -> asyncio.Future[None] | None:
        """The delete of ``key`` still to be sent to ``node_id``, if any: a new put of that key on that node
        is answered only after it (else the node would refuse the new bytes as a duplicate, or a late
        delete would erase them)."""
        worker = self._workers.get(node_id)
        sent = worker.deleting.get(key) if worker is not None else None
        return sent if sent is not None and not sent.done() else None

    def deletes_queued(self) -> bool:
        """Whether any node has a delete still to be sent (else no put needs :meth:`delete_pending`)."""
        return any(worker.deleting for worker in self._workers.values())

    async def idle(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until every queued call has been sent; used at shutdown and by tests."""
        tasks = [w.task for w in self._workers.values() if w.task is not None and not w.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        for worker in self._workers.values():
            if worker.task is not None:
                worker.task.cancel()
        await asyncio.gather(*(w.task for w in self._workers.values() if w.task), return_exceptions=True)
        for worker in self._workers.values():
            for *_, sent in worker.queue:
                if not sent.done():
                    sent.set_result(None)
            worker.queue.clear()
            worker.deleting.clear()
        await asyncio.gather(*(w.channel.close() for w in self._workers.values()), return_exceptions=True)
        self._workers.clear()

    def _worker(self, endpoint: common_pb2.NodeEndpoint) -> _NodeWorker:
        address = f"{endpoint.host}:{endpoint.grpc_port}"
        worker = self._workers.get(endpoint.node_id)
        if worker is None or worker.address != address:  # new node, or it came back on another port
            if worker is not None:
                asyncio.get_running_loop().create_task(worker.channel.close())
            worker = self._workers[endpoint.node_id] = _NodeWorker(endpoint)
        return worker

    async def _drain(self, worker: _NodeWorker) -> None:
        while worker.queue:
            action, keys, epoch, sent = worker.queue.pop(0)
            try:
                await self._deliver(worker, action, keys, epoch)
            finally:
                if not sent.done():
                    sent.set_result(None)
                if action == NodeAction.DELETE:
                    for key in keys:
                        if worker.deleting.get(key) is sent:
                            del worker.deleting[key]

    async def _deliver(self, worker: _NodeWorker, action: NodeAction, keys: list[bytes], epoch: int) -> None:
        for start in range(0, len(keys), MAX_KEYS_PER_NODE_CALL):
            chunk = keys[start : start + MAX_KEYS_PER_NODE_CALL]
            order = node_pb2.KeysRequest(keys=chunk, epoch=epoch, shard=self.shard)
            reply = await self._call(worker, action, order)
            if reply is None and action == NodeAction.DEMOTE:
                # The index counted these keys on SSD when it ordered the demotion, and a call that was not
                # answered may or may not have moved them. Demote is idempotent on the node (a key already
                # on SSD is done), so it is asked once more; if that fails too, the keys are treated as
                # refused (dropped and deleted): the master's per-tier bytes stay true either way, where
                # left alone they would count on SSD bytes the node may hold in DRAM until it registers.
                reply = await self._call(worker, action, order)
                if reply is None:
                    self._report_missing(worker, action, chunk)
            if reply is None:
                continue
            self._count(f"node_{action.value}_done", reply.done)
            self._count(f"node_{action.value}_missing", len(reply.missing))
            if reply.missing:
                self._report_missing(worker, action, list(reply.missing))

    async def _call(
        self, worker: _NodeWorker, action: NodeAction, order: node_pb2.KeysRequest
    ) -> node_pb2.KeysReply | None:
        """The node's answer to one order, or None (counted and logged) when the call failed."""
        method = {
            NodeAction.DELETE: worker.stub.Delete,
            NodeAction.DEMOTE: worker.stub.Demote,
            NodeAction.PROMOTE: worker.stub.Promote,
        }[action]
        try:
            return await method(order, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._count(f"node_{action.value}_failed", len(order.keys))
            count, code = len(order.keys), exc.code().name
            log.warning("%s of %d keys on %s failed: %s", action.value, count, worker.address, code)
            return None

    def _report_missing(self, worker: _NodeWorker, action: NodeAction, keys: list[bytes]) -> None:
        if self._on_missing is None:
            return
        try:
            self._on_missing(worker.node_id, action, keys)
        except Exception:  # reconciliation is best effort; the worker must keep draining
            log.exception("handling missing keys from %s failed", worker.address)
