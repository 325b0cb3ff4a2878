"""``StoreClient``: the synchronous store client, an ``AsyncStoreClient`` on a private event-loop thread.

Quick start::

    with StoreClient("127.0.0.1:50051", transport="auto") as c:
        c.put(b"Bkey", b"payload")
        assert c.get(b"Bkey") == b"payload"
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kvpool.kvstore.client.async_client import (
    RPC_SHARE_OF_BUDGET,
    AsyncStoreClient,
    LocatedPrefix,
    PinResult,
    PutItem,
)
from kvpool.kvstore.errors import (
    StoreError,
    StoreUnavailableError,
    TransportTimeoutError,
)
from kvpool.kvstore.transport.base import Buffer, Visit
from kvpool.proto import common_pb2, master_pb2

T = TypeVar("T")


class StoreClient:
    """Synchronous facade: runs an ``AsyncStoreClient`` on a private event-loop thread.

    Same methods and arguments as the async client (documented there); safe to call from several threads:
    each call is handed to the loop, where concurrent calls' transfers overlap.

    ``deadline_s`` bounds every call, transfers included: past it the call is cancelled on the loop and
    raises ``TransportTimeoutError``. Callers inside another engine's step (the vLLM connector) need that
    guarantee whatever the store does; None leaves each call to the client's own RPC timeouts. With a
    deadline and no ``rpc_timeout_s`` of their own, master calls get ``RPC_SHARE_OF_BUDGET`` of it.
    """

    def __init__(
        self, master: str, transport: str = "auto", deadline_s: float | None = None, **kwargs: Any
    ) -> None:
        self.deadline_s = deadline_s
        if deadline_s is not None:
            kwargs.setdefault("rpc_timeout_s", RPC_SHARE_OF_BUDGET * deadline_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvpool-store-client", daemon=True
        )
        self._thread.start()
        self._async: AsyncStoreClient = self._call(_make_async(master, transport, kwargs), bounded=False)

    def _bounded(self, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        return coro if self.deadline_s is None else _within(coro, self.deadline_s)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start a call without waiting for it (bounded by ``deadline_s`` like every call): the vLLM
        connector's asynchronous loads run on the client's loop while the engine steps."""
        if not self._thread.is_alive():
            coro.close()
            raise StoreUnavailableError("client is closed")
        return asyncio.run_coroutine_threadsafe(self._bounded(coro), self._loop)

    def _call(self, coro: Coroutine[Any, Any, T], bounded: bool = True) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise StoreUnavailableError("client is closed")
        return asyncio.run_coroutine_threadsafe(self._bounded(coro) if bounded else coro, self._loop).result()

    def put(
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
        return self._call(
            self._async.put(
                key,
                data,
                kind=kind,
                tenant=tenant,
                parent=parent,
                ttl_ms=ttl_ms,
                replace_if_corrupt=replace_if_corrupt,
            )
        )

    def batch_put(self, items: Sequence[PutItem | tuple[bytes, Buffer]]) -> list[StoreError | None]:
        return self._call(self._async.batch_put(items))

    def get(self, key: bytes) -> bytes:
        return self._call(self._async.get(key))

    def get_into(self, key: bytes, out: Buffer) -> int:
        return self._call(self._async.get_into(key, out))

    def batch_get(self, keys: Sequence[bytes], route: bytes | None = None) -> list[bytes | StoreError]:
        return self._call(self._async.batch_get(keys, route))

    def fetch_into(
        self, locations: Sequence[common_pb2.ObjectLocation], outs: Sequence[Buffer]
    ) -> list[int | StoreError]:
        return self._call(self._async.fetch_into(locations, outs))

    def read_in_place_soon(
        self, locations: Sequence[common_pb2.ObjectLocation], visit: Visit
    ) -> Future[list[Exception | None]]:
        """``AsyncStoreClient.read_in_place`` started now and awaited later (``Future.result()``): ``visit``
        runs on the client's loop thread; bounded by ``deadline_s``, and once the future is done no ``visit``
        runs any more."""
        return self._submit(self._async.read_in_place(locations, visit))

    def exists(self, key: bytes) -> bool:
        return self._call(self._async.exists(key))

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._call(self._async.batch_exists(keys))

    def lookup(
        self, keys: Sequence[bytes], acquire: bool = False, route: bytes | None = None
    ) -> master_pb2.LookupReply:
        return self._call(self._async.lookup(keys, acquire, route))

    def match_prefix(
        self,
        block_hashes: Sequence[bytes],
        tenant: str | None = None,
        require_checkpoint: bool = True,
        acquire: bool = False,
        lease_ms: int | None = None,
        route: bytes | None = None,
    ) -> LocatedPrefix:
        return self._call(
            self._async.match_prefix(block_hashes, tenant, require_checkpoint, acquire, lease_ms, route)
        )

    def route_of(self, block_hashes: Sequence[bytes]) -> bytes:
        """The route of a request's chain with master shards (pure: no call)."""
        return self._async.route_of(block_hashes)

    def release(self, lease_id: str) -> None:
        self._call(self._async.release(lease_id))

    def remove(self, keys: bytes | Sequence[bytes], route: bytes | None = None) -> int:
        return self._call(self._async.remove(keys, route))

    def pin(
        self, keys: Sequence[bytes], ttl_ms: int, route: bytes | None = None, session: str = ""
    ) -> PinResult:
        return self._call(self._async.pin(keys, ttl_ms, route, session))

    def stats(self, shard: int = 0) -> master_pb2.StatsReply:
        return self._call(self._async.stats(shard))

    def metrics(self) -> dict[str, float]:
        return self._call(_metrics(self._async))  # read on the loop, which writes the counters

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._async.close())
            # e.g. ucxx's progress task, bound to this loop; unbounded: it cancels every other task on the
            # loop, which would include a deadline's own
            self._call(_cancel_background_tasks(), bounded=False)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _within(coro: Coroutine[Any, Any, T], deadline_s: float) -> T:
    try:
        return await asyncio.wait_for(coro, deadline_s)
    except TimeoutError:
        raise TransportTimeoutError(f"store call exceeded its {deadline_s} s deadline") from None


async def _metrics(client: AsyncStoreClient) -> dict[str, float]:
    return client.metrics()


async def _cancel_background_tasks() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make_async(master: str, transport: str, kwargs: dict[str, Any]) -> AsyncStoreClient:
    return AsyncStoreClient(master, transport, **kwargs)
