"""Store client library: ``AsyncStoreClient`` (asyncio) and ``StoreClient`` (sync, own loop thread).

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

Why one module of ~850 lines: ``AsyncStoreClient`` owns one piece of state every call shares (the master
link, the known-location cache behind direct reads, the transports, the use reporter), and ``StoreClient`` is
its thin synchronous shell; the pieces with a life of their own are already apart (``master_link``,
``master_wire``, ``touch``, ``kvpool.kvstore.transport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import xxhash
from kvpool.kvstore.client.master_link import MasterLink
from kvpool.kvstore.client.touch import TouchReporter
from kvpool.kvstore.errors import (
    CapacityExceededError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    ProtocolError,
    StoreError,
    StoreUnavailableError,
    TransportTimeoutError,
)
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG
from kvpool.kvstore.transport.base import DEFAULT_DEADLINES, Buffer, Deadlines, Transport, as_bytes_view
from kvpool.kvstore.transport.select import TransportSelector
from kvpool.kvstore.transport.shm import ShmTransport
from kvpool.proto import common_pb2, master_pb2

T = TypeVar("T")
CAPACITY_RETRIES = 4  # 50+100+200+400 ms: covers a master->node Delete in flight
TOUCH_FLUSH_AT_CLOSE_S = 1.0  # last use reports at close: worth a short wait, not a master's deadline
LOCATION_CACHE = 16_384  # keys whose last known location is remembered for direct reads (<1 KB each)
ObjectKind = common_pb2.ObjectKind


@dataclass
class PutItem:
    """One object of a ``batch_put``."""

    key: bytes
    data: Buffer
    kind: int = common_pb2.BLOB
    tenant: str | None = None
    parent: bytes = b""
    ttl_ms: int = 0


class LocationColumns:
    """A ``LocationTable`` (``match_prefix(compact=True)``) as numpy views over the reply's bytes.

    Decoding is O(number of distinct nodes), not O(rows): routers and schedulers read the columns
    (``size``, ``tier``, ``node_index``...) as arrays; a fetch turns the rows it needs into
    ``ObjectLocation`` messages with ``locations()`` only then.
    """

    def __init__(
        self,
        table: master_pb2.LocationTable,
        block_hashes: Sequence[bytes] | None = None,
        usable_blocks: int = 0,
    ) -> None:
        self.rows = table.rows
        self._hashes = block_hashes
        self._usable = usable_blocks
        self.nodes = list(table.nodes)
        self.node_index = np.frombuffer(table.node_index, dtype="<u2")
        self.key_width = table.key_width
        self.keys_blob = table.keys
        self.kind = np.frombuffer(table.kind, dtype=np.uint8)
        self.tier = np.frombuffer(table.tier, dtype=np.uint8)
        self.size = np.frombuffer(table.size, dtype="<u8")
        self.checksum = np.frombuffer(table.checksum, dtype="<u8")
        self.tenants = list(table.tenants)
        self.tenant_index = np.frombuffer(table.tenant_index, dtype="<u2") if table.tenant_index else None
        self.ttl_ms = np.frombuffer(table.ttl_ms, dtype="<u4") if table.ttl_ms else None
        for name in ("node_index", "kind", "tier", "size", "checksum"):
            got = len(getattr(self, name))
            if got != self.rows:
                raise ProtocolError(f"LocationTable column {name} has {got} rows, not {self.rows}")
        if self.keys_blob or self.rows == 0:
            if len(self.keys_blob) != self.rows * self.key_width:
                raise ProtocolError("LocationTable keys do not match rows * key_width")
        elif block_hashes is None or not usable_blocks or len(block_hashes) < usable_blocks:
            raise ProtocolError("LocationTable without keys: use LocationColumns.of_match(reply, hashes)")

    @classmethod
    def of_match(cls, reply: master_pb2.MatchPrefixReply, block_hashes: Sequence[bytes]) -> LocationColumns:
        """The compact locations of a ``match_prefix(block_hashes, compact=True)`` reply."""
        return cls(reply.table, block_hashes, reply.usable_blocks)

    def __len__(self) -> int:
        return self.rows

    def key(self, i: int) -> bytes:
        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} of {self.rows}")
        if self.keys_blob:
            w = self.key_width
            return self.keys_blob[i * w : (i + 1) * w]
        assert self._hashes is not None
        if i < self._usable:
            return MLA_TAG + bytes(self._hashes[i])
        return KDA_TAG + bytes(self._hashes[self._usable - 1])

    def location(self, i: int) -> common_pb2.ObjectLocation:
        loc = common_pb2.ObjectLocation(node=self.nodes[int(self.node_index[i])])
        m = loc.meta
        m.key = self.key(i)
        m.kind = int(self.kind[i])
        m.tier = int(self.tier[i])
        m.size = int(self.size[i])
        m.checksum = int(self.checksum[i])
        if self.tenant_index is not None:
            m.tenant = self.tenants[int(self.tenant_index[i])]
        if self.ttl_ms is not None:
            m.ttl_ms = int(self.ttl_ms[i])
        return loc

    def locations(self, start: int = 0, stop: int | None = None) -> list[common_pb2.ObjectLocation]:
        """Rows ``[start, stop)`` as ObjectLocation messages (what ``fetch_into`` takes)."""
        return [self.location(i) for i in range(*slice(start, stop).indices(self.rows))]


class AsyncStoreClient:
    """Talks to one master; picks a transport per storage node (``auto`` | ``tcp`` | ``shm`` | ``ucx``).

    Must be used from one event loop (gRPC aio channels and pooled sockets belong to it).
    """

    def __init__(
        self,
        master: str,
        transport: str = "auto",
        *,
        tenant: str = "",
        lease_ms: int = 10_000,
        rpc_timeout_s: float = 5.0,
        deadlines: Deadlines = DEFAULT_DEADLINES,
        master_wire: bool = True,
    ) -> None:
        self.master_address = master
        self.tenant = tenant
        self.lease_ms = lease_ms
        self.rpc_timeout_s = rpc_timeout_s
        self.transports = TransportSelector(transport, deadlines)
        self.master_wire = master_wire
        self._link: MasterLink | None = None
        self._counters: dict[str, float] = {}
        self._counters_lock = threading.Lock()
        self._pending_releases: set[asyncio.Task] = set()
        # key -> where this client last saw the object (its own puts, its lookups): lets a get start the
        # transfer while the master's Lookup is in flight (see _read_into)
        self._where: OrderedDict[bytes, common_pb2.ObjectLocation] = OrderedDict()
        self._last_put_node: common_pb2.NodeEndpoint | None = None  # where shm puts reserve speculatively
        self._touches: TouchReporter | None = None  # made on first use: it needs the running loop

    # --- plumbing ----------------------------------------------------------------------------------------
    @property
    def master(self) -> MasterLink:
        """The link to the master: its binary wire when the master advertises one, else gRPC."""
        if self._link is None:
            self._link = MasterLink(self.master_address, self.rpc_timeout_s, use_wire=self.master_wire)
        return self._link

    def _count(self, name: str, n: float = 1) -> None:
        with self._counters_lock:  # the sync client's same-host fast path counts from the caller's thread
            self._counters[name] = self._counters.get(name, 0) + n

    def metrics(self) -> dict[str, float]:
        """Counters: ops.*, failures.*, latency_s.* (sums), bytes_in.<transport>, bytes_out.<transport>."""
        return {**self._counters, **self.transports.metrics()}

    def _meta(
        self, key: bytes, view: memoryview, kind: int, tenant: str | None, parent: bytes, ttl_ms: int
    ) -> common_pb2.ObjectMeta:
        return common_pb2.ObjectMeta(
            key=bytes(key),
            kind=kind,
            size=len(view),
            checksum=xxhash.xxh3_64_intdigest(view),
            tenant=self.tenant if tenant is None else tenant,
            parent=parent,
            ttl_ms=ttl_ms,
        )

    async def _timed(self, op: str, coro: Coroutine[Any, Any, T]) -> T:
        t0 = time.perf_counter()
        self._count(f"ops.{op}")
        try:
            return await coro
        except BaseException:
            self._count(f"failures.{op}")
            raise
        finally:
            self._count(f"latency_s.{op}", time.perf_counter() - t0)

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
        view = as_bytes_view(item.data)
        meta = self._meta(item.key, view, item.kind, item.tenant, item.parent, item.ttl_ms)
        shm, guess, spec, token = None, self._last_put_node, None, ""
        if guess is not None and not replace_if_corrupt:
            with contextlib.suppress(StoreError):
                t = self.transports.for_node(guess)
                if isinstance(t, ShmTransport):
                    shm, token = t, f"spec-{secrets.token_hex(8)}"
                    spec = asyncio.get_running_loop().create_task(
                        shm.reserve_and_copy(guess, token, meta, view)
                    )
        try:
            start = await self.master.put_start(
                master_pb2.PutStartRequest(meta=meta, replace_if_corrupt=replace_if_corrupt)
            )
        except BaseException:
            await self._drop_speculative_put(shm, guess, spec, token, meta.size)
            raise
        if start.status != master_pb2.PutStartReply.STARTED:
            await self._drop_speculative_put(shm, guess, spec, token, meta.size)
            return False  # EXISTS / IN_PROGRESS: someone else stored (or is storing) the same object
        self._last_put_node = start.node
        try:
            if not await self._finish_speculative_put(shm, guess, spec, token, start, meta):
                transport = self.transports.for_node(start.node)
                await self._transfer(transport, start, meta, view)
        except BaseException as exc:
            await self._abort(start.put_id, exc)
            raise
        await self.master.put_commit(master_pb2.PutCommitRequest(put_id=start.put_id))
        self._remember(common_pb2.ObjectLocation(meta=meta, node=start.node))
        return True

    async def _finish_speculative_put(
        self,
        shm: ShmTransport | None,
        guess: common_pb2.NodeEndpoint | None,
        spec: asyncio.Task[bool] | None,
        token: str,
        start: Any,
        meta: common_pb2.ObjectMeta,
    ) -> bool:
        """shm puts: the RESERVE + copy ran on the node of this client's previous put while PutStart was in
        flight (one round trip and the copy off the critical path). Kept only if the master placed the put
        on that same node; then SEAL publishes it (the node verifies the checksum) exactly as the plain
        path would. Otherwise the reservation is aborted and the caller runs the plain transfer. A
        speculative RESERVE never touches a copy the node already holds (FLAG_SPECULATIVE: a plain RESERVE
        would replace a corrupt copy, which only the master may order); then the plain path runs.
        """
        if spec is None or shm is None or guess is None:
            return False
        await _settle(spec)
        ok = not spec.cancelled() and spec.exception() is None
        if ok and spec.result() and start.node.node_id == guess.node_id:
            await shm.seal(guess, token, meta.size)
            self._count("put.overlapped")
            return True
        await self._drop_speculative_put(shm, guess, spec, token, meta.size)
        self._count("put.overlap_discarded")
        return False

    async def _drop_speculative_put(
        self,
        shm: ShmTransport | None,
        guess: common_pb2.NodeEndpoint | None,
        spec: asyncio.Task[bool] | None,
        token: str,
        size: int,
    ) -> None:
        if spec is None or shm is None or guess is None:
            return
        await _settle(spec)
        if not spec.cancelled() and spec.exception() is None and spec.result():
            with contextlib.suppress(StoreError):  # else the node's reaper frees it at its deadline
                await shm.seal(guess, token, size, abort=True)

    def _remember(self, loc: common_pb2.ObjectLocation) -> None:
        """Note where a key lives (called on the loop): later gets of it read straight from that node."""
        if self._touches is None:
            self._touches = TouchReporter(self._report_touches, asyncio.get_running_loop())
        where = self._where
        where[loc.meta.key] = loc
        where.move_to_end(loc.meta.key)
        if len(where) > LOCATION_CACHE:
            where.popitem(last=False)

    async def _transfer(
        self, transport: Transport, start: Any, meta: common_pb2.ObjectMeta, view: memoryview
    ) -> None:
        """Send the bytes; a node that is momentarily full (the master's evictions reach it asynchronously,
        as Delete/Demote calls) is retried with a short backoff before the put fails."""
        delay = 0.05
        for attempt in range(CAPACITY_RETRIES + 1):
            try:
                await transport.put(start.node, start.put_id, meta, view)
                return
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
        """Per item: None on success (duplicates included) or the typed error; pipelined per node."""
        return await self._timed(
            "batch_put", self._batch_put([i if isinstance(i, PutItem) else PutItem(*i) for i in items])
        )

    async def _batch_put(self, items: list[PutItem]) -> list[StoreError | None]:
        results: list[StoreError | None] = [None] * len(items)
        views = [as_bytes_view(i.data) for i in items]
        metas = [
            self._meta(i.key, v, i.kind, i.tenant, i.parent, i.ttl_ms)
            for i, v in zip(items, views, strict=True)
        ]
        starts = await asyncio.gather(
            *(self.master.put_start(master_pb2.PutStartRequest(meta=m)) for m in metas),
            return_exceptions=True,
        )
        groups: dict[tuple[int, str], tuple[Transport, Any, list[int]]] = {}
        for i, start in enumerate(starts):
            if isinstance(start, BaseException):
                results[i] = _store_error(start)
                continue
            if start.status != master_pb2.PutStartReply.STARTED:
                continue
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
            finals = await asyncio.gather(
                *(
                    self.master.put_commit(master_pb2.PutCommitRequest(put_id=starts[i].put_id))
                    if err is None
                    else self._abort(starts[i].put_id, err)
                    for i, err in zip(idx, got, strict=True)
                ),
                return_exceptions=True,
            )
            for i, err, fin in zip(idx, got, finals, strict=True):
                results[i] = (
                    err
                    if err is not None
                    else (_store_error(fin) if isinstance(fin, BaseException) else None)
                )

        await asyncio.gather(*(run(*group) for group in groups.values()))
        return results

    # --- reads -------------------------------------------------------------------------------------------
    async def _lookup(self, keys: Sequence[bytes], acquire: bool) -> master_pb2.LookupReply:
        return await self.master.lookup(
            master_pb2.LookupRequest(keys=[bytes(k) for k in keys], acquire=acquire, lease_ms=self.lease_ms),
        )

    async def lookup(self, keys: Sequence[bytes], acquire: bool = False) -> master_pb2.LookupReply:
        """Locations of ``keys`` (found in request order, plus missing). ``acquire`` read-pins the found ones
        under a lease: ``fetch_into`` them, then ``release(reply.lease_id)``."""
        return await self._timed("lookup", self._lookup(keys, acquire))

    def _release_soon(self, lease_id: str) -> None:
        """Release off the critical path: the bytes are already here, so the caller need not wait for the
        master's answer (a lost Release only means the lease runs to its deadline)."""
        if lease_id:
            task = asyncio.get_running_loop().create_task(self.release(lease_id))
            self._pending_releases.add(task)
            task.add_done_callback(self._pending_releases.discard)

    async def release(self, lease_id: str) -> None:
        """Drop a read-pin lease (e.g. from ``match_prefix(acquire=True)``); failures are only counted."""
        if lease_id:
            try:
                await self.master.release(master_pb2.ReleaseRequest(lease_id=lease_id))
            except StoreError:
                self._count("failures.release")

    async def get(self, key: bytes) -> bytes:
        """The object's bytes (one copy more than ``get_into``); ``ObjectNotFoundError`` if absent."""

        async def body() -> bytes:
            got = await self._read_into(key, None)
            assert isinstance(got, bytearray)
            return bytes(got)

        return await self._timed("get", body())

    async def get_into(self, key: bytes, out: Buffer) -> int:
        """Copy the object into ``out`` (bytearray / numpy / contiguous CPU tensor); returns its size.

        On an error the contents of ``out`` are unspecified (a transfer may have started).
        """

        async def body() -> int:
            got = await self._read_into(key, out)
            assert isinstance(got, int)
            return got

        return await self._timed("get", body())

    async def _read_into(self, key: bytes, out: Buffer | None) -> int | bytearray:
        """One get. With ``out=None`` (``get``) a buffer of the object's size is allocated and returned.

        Direct read: when this client already knows where the key lives (its own put, an earlier lookup),
        the bytes come straight from that node with no master round trip (0.45-0.8 ms of Python gRPC,
        more than a 4 MB shm copy). That is safe because objects are immutable and the node is the
        authority on what it holds: it serves only published objects, a transfer verifies the bytes
        against the checksum this client knows (same key + checksum = the same object), a node that no
        longer holds the key says so (the master's Remove returns only after the nodes dropped the keys,
        so a removed key never comes back), tcp/ucx sends hold a reader reference on the node and shm
        copies are validated by the node's generation stamps. The read is reported to the master's
        eviction policy in a batch (``TouchReporter``). Any failure of the direct read other than a
        timeout forgets the location and runs the master path, whose answer is authoritative.

        Master path: ``Lookup(acquire)`` decides whether the object exists and read-pins it under a
        lease; the bytes come from the node it names, verified against the checksum in that answer.
        """
        key = bytes(key)
        cached = self._where.get(key)
        if cached is not None and out is not None and as_bytes_view(out).nbytes < cached.meta.size:
            cached = None  # not the size this client knew: the key may hold another object now
        if cached is not None:
            buf = bytearray(cached.meta.size) if out is None else out
            try:
                n = await self._fetch(cached, buf)
            except TransportTimeoutError as exc:
                self._where.pop(key, None)
                self._count("get.direct_fallback")
                # the node stalled (or is dead and does not refuse connections, as ucx listeners do):
                # the master knows whether it still holds the key; if it still names that node, a second
                # transfer would only wait out the same deadline again
                return await self._read_via_master(key, out, stalled=(cached.node.node_id, exc))
            except StoreError:
                self._where.pop(key, None)
                self._count("get.direct_fallback")
            else:
                self._count("get.direct")
                self._note_direct_read(key)
                return buf if out is None else n
        return await self._read_via_master(key, out)

    def _note_direct_read(self, key: bytes) -> None:
        if self._touches is not None:  # always made by _remember, which made the read possible
            self._touches.note(key)

    def read_cached_now(self, key: bytes, out: Buffer) -> int | None:
        """Same-host fast path callable from any thread, without the event loop: if this client knows
        where ``key`` lives and reaches that node over shm, copy the object out of the node's pool
        (validated by the node's generation stamp, verified by checksum) and return its size; else None
        and the caller takes the normal path. Saves the sync client's hop to its loop thread, which costs
        as much as the 4 MB copy itself."""
        t0 = time.perf_counter()
        loc = self._where.get(bytes(key))
        if loc is None or as_bytes_view(out).nbytes < loc.meta.size:
            return None
        read = getattr(self.transports.decided(loc.node), "read_cached", None)
        if read is None:
            return None
        n = read(loc.node, loc.meta.key, loc.meta.checksum, loc.meta.size, out)
        if n is None:
            return None
        self._note_direct_read(loc.meta.key)
        self._count("ops.get")
        self._count("get.direct")
        self._count("latency_s.get", time.perf_counter() - t0)
        return n

    async def _report_touches(self, keys: list[bytes]) -> None:
        try:
            await self.master.lookup(master_pb2.LookupRequest(keys=keys, touch=True))
        except StoreError:
            self._count("failures.touch_report")

    async def _read_via_master(
        self, key: bytes, out: Buffer | None, stalled: tuple[str, TransportTimeoutError] | None = None
    ) -> int | bytearray:
        reply = await self._lookup([key], acquire=True)
        try:
            try:
                loc = self._found_one(reply, key)
            except ObjectNotFoundError:
                self._where.pop(key, None)
                raise
            if stalled is not None and loc.node.node_id == stalled[0]:
                raise stalled[1]
            self._remember(loc)
            if out is None:
                buf = bytearray(loc.meta.size)
                await self._fetch(loc, buf)
                return buf
            return await self._fetch(loc, out)
        finally:
            self._release_soon(reply.lease_id)

    @staticmethod
    def _found_one(reply: master_pb2.LookupReply, key: bytes) -> common_pb2.ObjectLocation:
        if not reply.found:
            raise ObjectNotFoundError(f"key {bytes(key)[:8].hex()}… is not in the store")
        return reply.found[0]

    async def _fetch(self, loc: common_pb2.ObjectLocation, out: Buffer) -> int:
        return await self.transports.for_node(loc.node).get_into(loc, out)

    async def fetch_into(
        self, locations: Sequence[common_pb2.ObjectLocation], outs: Sequence[Buffer]
    ) -> list[int | StoreError]:
        """Move located (and pinned) objects into ``outs``: per-item size or error, pipelined per node."""
        results: list[int | StoreError] = [StoreError("not run")] * len(locations)
        groups: dict[int, tuple[Transport, list[int]]] = {}
        for i, loc in enumerate(locations):
            try:
                transport = self.transports.for_node(loc.node)
            except StoreError as exc:
                results[i] = exc
                continue
            groups.setdefault(id(transport), (transport, []))[1].append(i)

        async def run(transport: Transport, idx: list[int]) -> None:
            got = await transport.batch_get_into([(locations[i], outs[i]) for i in idx])
            for i, r in zip(idx, got, strict=True):
                results[i] = r

        await asyncio.gather(*(run(t, idx) for t, idx in groups.values()))
        return results

    async def batch_get(self, keys: Sequence[bytes]) -> list[bytes | StoreError]:
        """Per key: its bytes or the typed error (``ObjectNotFoundError`` for missing keys)."""

        async def body() -> list[bytes | StoreError]:
            reply = await self._lookup(keys, acquire=True)
            try:
                by_key = {loc.meta.key: loc for loc in reply.found}
                locs = [by_key[k] for k in keys if k in by_key]
                outs = [bytearray(loc.meta.size) for loc in locs]
                got = dict(
                    zip(
                        (loc.meta.key for loc in locs),
                        zip(outs, await self.fetch_into(locs, outs), strict=True),
                        strict=True,
                    )
                )
            finally:
                self._release_soon(reply.lease_id)
            results: list[bytes | StoreError] = []
            for k in keys:
                if k not in got:
                    results.append(ObjectNotFoundError(f"key {bytes(k)[:8].hex()}… is not in the store"))
                else:
                    buf, r = got[k]
                    results.append(bytes(buf) if isinstance(r, int) else r)
            return results

        return await self._timed("batch_get", body())

    async def exists(self, key: bytes) -> bool:
        """Whether ``key`` is stored (does not pin, so probing never blocks eviction)."""
        reply = await self._timed("exists", self._lookup([key], acquire=False))
        return bool(reply.found)

    async def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        reply = await self._timed("exists", self._lookup(keys, acquire=False))
        found = {loc.meta.key for loc in reply.found}
        return [bytes(k) in found for k in keys]

    async def match_prefix(
        self,
        block_hashes: Sequence[bytes],
        tenant: str | None = None,
        require_checkpoint: bool = True,
        acquire: bool = False,
        lease_ms: int | None = None,
        compact: bool = False,
    ) -> master_pb2.MatchPrefixReply:
        """Usable prefix, MLA run and locations in one call; after ``acquire`` call ``release(lease_id)``.

        ``compact=True``: the locations come as ``reply.table`` (``LocationColumns.of_match(reply,
        block_hashes)``; rows
        ``[0, usable_blocks)`` are the MLA blocks, then the checkpoint) and ``mla``/``checkpoint`` stay
        empty: ~0.5 ms instead of ~5 ms for a 2,000-block chain.
        """
        req = master_pb2.MatchPrefixRequest(
            block_hashes=list(block_hashes),
            tenant=self.tenant if tenant is None else tenant,
            require_checkpoint=require_checkpoint,
            acquire=acquire,
            lease_ms=lease_ms or self.lease_ms,
            compact=compact,
        )
        return await self._timed("match_prefix", self.master.match_prefix(req))

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


class StoreClient:
    """Synchronous facade: runs an ``AsyncStoreClient`` on a private event-loop thread.

    Same methods and arguments as the async client (documented there); safe to call from several threads:
    each call is handed to the loop, where concurrent calls' transfers overlap.
    """

    def __init__(self, master: str, transport: str = "auto", **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvpool-store-client", daemon=True
        )
        self._thread.start()
        self._async: AsyncStoreClient = self._call(_make_async(master, transport, kwargs))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise StoreUnavailableError("client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def transport(self) -> str:
        """The transport choice (``auto`` | ``tcp`` | ``shm`` | ``ucx``)."""
        return self._async.transports.choice

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
        loc = self._async._where.get(bytes(key))
        if loc is not None:
            buf = bytearray(loc.meta.size)
            if self._async.read_cached_now(key, buf) is not None:
                return bytes(buf)
        return self._call(self._async.get(key))

    def get_into(self, key: bytes, out: Buffer) -> int:
        n = self._async.read_cached_now(key, out)  # same-host shm hit: no hop to the loop thread
        return self._call(self._async.get_into(key, out)) if n is None else n

    def batch_get(self, keys: Sequence[bytes]) -> list[bytes | StoreError]:
        return self._call(self._async.batch_get(keys))

    def fetch_into(
        self, locations: Sequence[common_pb2.ObjectLocation], outs: Sequence[Buffer]
    ) -> list[int | StoreError]:
        return self._call(self._async.fetch_into(locations, outs))

    def exists(self, key: bytes) -> bool:
        return self._call(self._async.exists(key))

    def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._call(self._async.batch_exists(keys))

    def lookup(self, keys: Sequence[bytes], acquire: bool = False) -> master_pb2.LookupReply:
        return self._call(self._async.lookup(keys, acquire))

    def match_prefix(
        self,
        block_hashes: Sequence[bytes],
        tenant: str | None = None,
        require_checkpoint: bool = True,
        acquire: bool = False,
        lease_ms: int | None = None,
        compact: bool = False,
    ) -> master_pb2.MatchPrefixReply:
        return self._call(
            self._async.match_prefix(block_hashes, tenant, require_checkpoint, acquire, lease_ms, compact)
        )

    def release(self, lease_id: str) -> None:
        self._call(self._async.release(lease_id))

    def remove(self, keys: bytes | Sequence[bytes]) -> int:
        return self._call(self._async.remove(keys))

    def pin(self, keys: Sequence[bytes], ttl_ms: int) -> int:
        return self._call(self._async.pin(keys, ttl_ms))

    def stats(self) -> master_pb2.StatsReply:
        return self._call(self._async.stats())

    def metrics(self) -> dict[str, float]:
        return self._call(_value(self._async.metrics()))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._async.close())
            self._call(_cancel_background_tasks())  # e.g. ucxx's progress task, bound to this loop
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _value(value: T) -> T:
    return value


async def _cancel_background_tasks() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make_async(master: str, transport: str, kwargs: dict[str, Any]) -> AsyncStoreClient:
    return AsyncStoreClient(master, transport, **kwargs)
