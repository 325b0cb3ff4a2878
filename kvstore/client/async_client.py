"""``AsyncStoreClient``: the asyncio store client (``StoreClient`` in ``sync_client`` is its sync facade).

Puts are two-phase through the master (PutStart → bytes to the chosen node over a transport → PutCommit;
PutAbort on any failure), so nobody ever reads a half-written object; a duplicate put (EXISTS / IN_PROGRESS)
is a successful no-op. Gets read-pin under a lease (Lookup / MatchPrefix with acquire=true), move the bytes,
verify the xxh3-64 checksum, and Release the lease in ``finally``. Data never passes through the master.

Errors are typed (``kvpool.kvstore.errors``): a missing key is ``ObjectNotFoundError`` (never ``b""``),
damaged bytes ``CorruptObjectError``, a dead master or node ``StoreUnavailableError``, a stalled one
``TransportTimeoutError``. Batch calls return one result per key (value or error) instead of failing whole.

Quick start::

    with StoreClient("127.0.0.1:50051", transport="auto") as c:
        c.put(b"Bkey", b"payload")
        assert c.get(b"Bkey") == b"payload"
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from kvpool.kvstore.client.reads import StoreReads
from kvpool.kvstore.client.writes import StoreWrites
from kvpool.kvstore.errors import StoreError
from kvpool.proto import master_pb2

TOUCH_FLUSH_AT_CLOSE_S = 1.0  # last use reports at close: worth a short wait, not a master's deadline


class AsyncStoreClient(StoreWrites, StoreReads):
    """Talks to one master; picks a transport per storage node (``auto`` | ``tcp`` | ``shm`` | ``ucx``).

    Must be used from one event loop (gRPC aio channels and pooled sockets belong to it).
    """

    async def close(self) -> None:
        if self._pending_releases:
            await asyncio.wait(self._pending_releases, timeout=self.rpc_timeout_s)
        if self._touches is not None:  # best effort: a dead master must not make close() slow
            with contextlib.suppress(StoreError, asyncio.TimeoutError):
                await self._touches.close(min(TOUCH_FLUSH_AT_CLOSE_S, self.rpc_timeout_s))
        await self.transports.close()
        if self._link is not None:
            await self._link.close()
            self._link = None

    async def __aenter__(self) -> AsyncStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- management --------------------------------------------------------------------------------------
    async def remove(self, keys: bytes | Sequence[bytes]) -> int:
        keys = [keys] if isinstance(keys, bytes | bytearray) else list(keys)
        for k in keys:
            self._where.pop(bytes(k), None)
        reply = await self._timed("remove", self.master.remove(master_pb2.RemoveRequest(keys=keys)))
        return reply.removed

    async def pin(self, keys: Sequence[bytes], ttl_ms: int) -> int:
        """Soft-pin ``keys`` for ``ttl_ms`` (0 removes the pin); returns how many were pinned."""
        reply = await self._timed(
            "pin", self.master.pin(master_pb2.PinRequest(keys=list(keys), ttl_ms=ttl_ms))
        )
        return reply.pinned

    async def stats(self) -> master_pb2.StatsReply:
        return await self.master.stats(master_pb2.StatsRequest())
