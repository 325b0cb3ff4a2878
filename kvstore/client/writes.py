"""The store client's write path: two-phase puts (PutStart → bytes to the chosen node → PutCommit,
PutAbort on any failure), speculative same-host shm reservations, capacity retries and pipelined batches.

A duplicate put (EXISTS / IN_PROGRESS) is a successful no-op; a batch returns one result per item. A put the
master's admission control turns away (NOT_ADMITTED) writes nothing: ``put`` returns False, ``batch_put``
gives that item an ``ObjectNotAdmittedError`` so the caller can count it (it is not a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from kvpool.kvstore.client.core import ClientCore
from kvpool.kvstore.client.records import PutItem
from kvpool.kvstore.errors import (
    CapacityExceededError,
    ObjectNotAdmittedError,
    ObjectTooLargeError,
    StoreError,
    StoreUnavailableError,
)
from kvpool.kvstore.protocol.grpc_errors import typed_error_from
from kvpool.kvstore.transport.base import Buffer, Payload, Transport
from kvpool.kvstore.transport.shm import ShmTransport
from kvpool.proto import common_pb2, master_pb2

CAPACITY_RETRIES = 4  # 50+100+200+400 ms: covers a master->node Delete in flight


class StoreWrites(ClientCore):
    """Puts of the async store client (``AsyncStoreClient``)."""

    # --- writes ------------------------------------------------------------------------------------------
    async def put(
        self,
        key: bytes,
        data: Buffer,
        *,
        kind: int = common_pb2.BLOB,
        tenant: str | None = None,
        parent: bytes = b"",
        ttl_ms: int = 0,
        replace_if_corrupt: bool = False,
    ) -> bool:
        """Store ``data`` under ``key``; True if written now, False if it already existed (no-op success).

        ``replace_if_corrupt``: a reader that got ``CorruptObjectError`` and recomputed the object re-puts it
        with this set, so the damaged copy is replaced instead of the put being a no-op.
        """
        item = PutItem(key, data, kind, tenant, parent, ttl_ms)
        return await self._timed("put", self._put(item, replace_if_corrupt))

    async def _put(self, item: PutItem, replace_if_corrupt: bool = False) -> bool:
        view = Payload.of(item.data)  # one buffer or a cache unit's parts: never joined on the way
        meta = self._meta(item.key, view.nbytes, item.kind, item.tenant, item.parent, item.ttl_ms)
        meta.epoch = self.leader_epoch  # the speculative reserve below runs before this put's PutStart
        # built now: the speculative copy below fills meta.checksum as it goes, the master must not see it
        request = master_pb2.PutStartRequest(
            meta=meta, replace_if_corrupt=replace_if_corrupt, checksum_at_commit=True
        )
        shm, guess, spec, token = None, self._last_put_node, None, ""
        if guess is not None and not replace_if_corrupt:
            with contextlib.suppress(StoreError):
                t = self.transports.for_node(guess)
                if isinstance(t, ShmTransport):
                    shm, token = t, f"spec-{secrets.token_hex(8)}"
                    spec = asyncio.get_running_loop().create_task(_copy_ahead(shm, guess, token, meta, view))
        try:
            start = await self.master.put_start(request)
        except BaseException:
            await self._drop_speculative_put(shm, guess, spec)
            raise
        if start.status != master_pb2.PutStartReply.STARTED:
            await self._drop_speculative_put(shm, guess, spec)
            if start.status == master_pb2.PutStartReply.NOT_ADMITTED:
                self._count("put.not_admitted")
            return False  # EXISTS / IN_PROGRESS / NOT_ADMITTED: nothing to write
        self._last_put_node = start.node
        meta.epoch = self.leader_epoch = start.epoch  # HA fencing: nodes refuse puts of deposed leaders
        try:
            seal: _Unsealed | None = None
            if await self._keep_speculative_put(shm, guess, spec, start):
                seal = _Unsealed(shm, guess, spec.result())  # type: ignore[arg-type, union-attr]
            else:
                transport = self.transports.for_node(start.node)
                seal = await self._transfer(transport, start, meta, view, defer_seal=True)
        except BaseException as exc:
            await self._abort(start.put_id, exc)
            raise
        await self._commit(start, meta, seal)
        self._remember(common_pb2.ObjectLocation(meta=meta, node=start.node))
        return True

    async def _commit(self, start: Any, meta: common_pb2.ObjectMeta, seal: _Unsealed | None) -> None:
        """PutCommit; a shm put's SEAL goes out at the same moment, so the two cost one round trip, not two.

        Read-your-writes holds: the call returns only after both answered. Another reader may, for the
        ~0.1 ms between the master's commit and the node's seal, be told where the object is and not find
        it there: a miss, never wrong bytes. A seal that fails after the master committed is withdrawn
        (``Remove``), so the index does not keep an entry the node never published.
        """
        commit = master_pb2.PutCommitRequest(put_id=start.put_id, checksum=meta.checksum)
        if seal is None:
            await self.master.put_commit(commit)
            return
        sealing = asyncio.get_running_loop().create_task(seal.shm.seal(seal.node, seal.token, meta.size))
        try:
            await self.master.put_commit(commit)
        finally:
            await _settle(sealing)
        failure = None if sealing.cancelled() else sealing.exception()
        if failure is not None:
            self._count("put.seal_withdrawn")
            with contextlib.suppress(StoreError):
                await self.master.remove(master_pb2.RemoveRequest(keys=[meta.key]))
            raise failure

    async def _keep_speculative_put(
        self,
        shm: ShmTransport | None,
        guess: common_pb2.NodeEndpoint | None,
        spec: asyncio.Task[str | None] | None,
        start: Any,
    ) -> bool:
        """shm puts: the RESERVE + copy ran on the node of this client's previous put while PutStart was in
        flight (one round trip and the copy off the critical path). Kept only if the master placed the put
        on that same node; then its SEAL goes out with the PutCommit (``_commit``) exactly as the plain
        path's would. Otherwise the reservation is aborted and the caller runs the plain transfer. A
        speculative RESERVE never touches a copy the node already holds (FLAG_SPECULATIVE: a plain RESERVE
        would replace a corrupt copy, which only the master may order); then the plain path runs.
        """
        if spec is None or shm is None or guess is None:
            return False
        await _settle(spec)
        ok = not spec.cancelled() and spec.exception() is None
        if ok and spec.result() and start.node.node_id == guess.node_id:
            self._count("put.overlapped")
            return True
        await self._drop_speculative_put(shm, guess, spec)
        self._count("put.overlap_discarded")
        return False

    async def _drop_speculative_put(
        self,
        shm: ShmTransport | None,
        guess: common_pb2.NodeEndpoint | None,
        spec: asyncio.Task[str | None] | None,
    ) -> None:
        if spec is None or shm is None or guess is None:
            return
        await _settle(spec)
        if not spec.cancelled() and spec.exception() is None and spec.result():
            with contextlib.suppress(StoreError):  # else the node's reaper frees it at its deadline
                await shm.seal(guess, spec.result(), 0, abort=True)  # type: ignore[arg-type]

    async def _transfer(
        self,
        transport: Transport,
        start: Any,
        meta: common_pb2.ObjectMeta,
        view: Payload,
        defer_seal: bool = False,
    ) -> _Unsealed | None:
        """Send the bytes; a node that is momentarily full (the master's evictions reach it asynchronously,
        as Delete/Demote calls) is retried with a short backoff before the put fails. ``defer_seal``: a shm
        put stops after the copy and returns the SEAL still owed (sent with the commit); else None."""
        delay = 0.05
        for attempt in range(CAPACITY_RETRIES + 1):
            try:
                if defer_seal and isinstance(transport, ShmTransport):
                    node, put_id = start.node, start.put_id
                    landed = await transport.reserve_and_copy(node, put_id, meta, view, speculative=False)
                    return _Unsealed(transport, node, put_id) if landed else None
                await transport.put(start.node, start.put_id, meta, view)
                return None
            except ObjectTooLargeError:
                raise
            except CapacityExceededError:
                if attempt == CAPACITY_RETRIES:
                    raise
                self._count("retries.node_full")
                await asyncio.sleep(delay)
                delay *= 2

    async def _abort(self, put_id: str, exc: BaseException) -> None:
        with contextlib.suppress(StoreError):  # the master aborts it at its deadline anyway
            await self.master.put_abort(master_pb2.PutAbortRequest(put_id=put_id, reason=repr(exc)[:500]))

    async def batch_put(self, items: Sequence[PutItem | tuple[bytes, Buffer]]) -> list[StoreError | None]:
        """Per item: None on success (duplicates included), ``ObjectNotAdmittedError`` when admission turned
        it away, or the typed error; pipelined per node."""
        return await self._timed(
            "batch_put", self._batch_put([i if isinstance(i, PutItem) else PutItem(*i) for i in items])
        )

    async def _batch_put(self, items: list[PutItem]) -> list[StoreError | None]:
        """One PutStartBatch for all items, one pipelined transfer per node, one PutCommitBatch per node:
        three control round trips for a whole push instead of two per object."""
        results: list[StoreError | None] = [None] * len(items)
        views = [Payload.of(i.data) for i in items]
        metas = [
            self._meta(i.key, v.nbytes, i.kind, i.tenant, i.parent, i.ttl_ms)
            for i, v in zip(items, views, strict=True)
        ]
        try:
            batch = await self.master.put_start_batch(
                master_pb2.PutStartBatchRequest(
                    items=[master_pb2.PutStartRequest(meta=m, checksum_at_commit=True) for m in metas]
                )
            )
        except Exception as exc:
            return [_store_error(exc)] * len(items)
        starts = list(batch.items)
        groups: dict[tuple[int, str], tuple[Transport, Any, list[int]]] = {}
        for i, (start, err) in enumerate(zip(starts, batch.errors, strict=True)):
            if err.code:
                results[i] = _item_error(err)
                continue
            if start.status == master_pb2.PutStartReply.NOT_ADMITTED:
                results[i] = ObjectNotAdmittedError(f"put of {metas[i].key[:9].hex()}… not admitted")
                self._count("put.not_admitted")
                continue
            if start.status != master_pb2.PutStartReply.STARTED:
                continue
            metas[i].epoch = start.epoch  # HA fencing: a node refuses puts placed by a deposed leader
            try:
                transport = self.transports.for_node(start.node)
            except StoreError as exc:
                results[i] = exc
                await self._abort(start.put_id, exc)
                continue
            key = (id(transport), start.node.node_id)
            groups.setdefault(key, (transport, start.node, []))[2].append(i)

        async def run(transport: Transport, node: Any, idx: list[int]) -> None:
            got = await transport.batch_put(node, [(starts[i].put_id, metas[i], views[i]) for i in idx])
            for j, (i, err) in enumerate(zip(idx, got, strict=True)):
                if isinstance(err, CapacityExceededError) and not isinstance(err, ObjectTooLargeError):
                    try:  # node momentarily full: the single-put path retries with backoff
                        await self._transfer(transport, starts[i], metas[i], views[i])
                        got[j] = None
                    except StoreError as exc:
                        got[j] = exc
            sent = [i for i, err in zip(idx, got, strict=True) if err is None]
            failed = [(i, err) for i, err in zip(idx, got, strict=True) if err is not None]
            await asyncio.gather(*(self._abort(starts[i].put_id, err) for i, err in failed))
            for i, err in failed:
                results[i] = err
            if not sent:
                return
            try:
                commits = await self.master.put_commit_batch(
                    master_pb2.PutCommitBatchRequest(
                        put_ids=[starts[i].put_id for i in sent], checksums=[metas[i].checksum for i in sent]
                    )
                )
            except Exception as exc:
                for i in sent:
                    results[i] = _store_error(exc)
                return
            for i, err in zip(sent, commits.errors, strict=True):
                results[i] = _item_error(err) if err.code else None
                if not err.code:
                    self._remember(common_pb2.ObjectLocation(meta=metas[i], node=starts[i].node))

        await asyncio.gather(*(run(*group) for group in groups.values()))
        return results


@dataclass(slots=True, frozen=True)
class _Unsealed:
    """A shm put whose bytes are in the node's pool, waiting for the SEAL that publishes them."""

    shm: ShmTransport
    node: common_pb2.NodeEndpoint
    token: str


def _item_error(err: master_pb2.ItemError) -> StoreError:
    """A batch item's failure as the typed error the single call would have raised."""
    return typed_error_from(grpc.StatusCode[err.code], err.message)


async def _copy_ahead(
    shm: ShmTransport,
    node: common_pb2.NodeEndpoint,
    token: str,
    meta: common_pb2.ObjectMeta,
    view: Payload,
) -> str | None:
    """The speculative half of a shm put: copy into this client's arena on ``node`` (no round trip first),
    else RESERVE under ``token`` and copy. The token to seal, or None when the node already holds it."""
    slot = await shm.copy_into_arena(node, meta, view)
    if slot is not None:
        return slot
    return token if await shm.reserve_and_copy(node, token, meta, view) else None


async def _settle(task: asyncio.Task | None) -> None:
    """Wait for a speculative transfer to end (it writes into the caller's buffer, so it must not outlive
    the call); it has its own transfer deadline. If this call is being cancelled, cancel it too."""
    if task is None:
        return
    if not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait([task])
            raise
    if not task.cancelled():
        task.exception()  # retrieved: a failed speculation is not an error of the call


def _store_error(exc: BaseException) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    if not isinstance(exc, Exception):
        raise exc
    return StoreUnavailableError(f"{type(exc).__name__}: {exc}")
