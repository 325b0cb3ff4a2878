"""``AsyncStoreClient``: the asyncio store client (``StoreClient`` in ``sync_client`` is its sync facade).

Every call has one path. A put is two-phase through the master: PutStart → the bytes to the chosen node over
a transport (hashed on the way: the checksum is declared at PutCommit, ``checksum_at_commit``) → PutCommit;
PutAbort on any failure, so nobody ever reads a half-written object; a duplicate put (EXISTS / IN_PROGRESS)
writes nothing and succeeds (EXISTS refreshes the object at the master). A get is Lookup(acquire) → fetch
from the node the master named → verify the xxh3-64 checksum → release the lease off the critical path
(``_release_soon``). A prefill's push is one
``batch_put``: one PutStartBatch, one pipelined stream per node, one PutCommitBatch per node. Data never
passes through the master.

Which transport talks to which node: ``kvstore.transport.selector.TransportSelector``.

Errors are typed (``kvpool.kvstore.errors``): a missing key is ``ObjectNotFoundError`` (never ``b""``),
damaged bytes ``CorruptObjectError``, a dead master or node ``StoreUnavailableError``, a stalled one
``TransportTimeoutError``. Batch calls return one result per key (value or error) instead of failing whole.
A put the master's admission control turns away (NOT_ADMITTED) writes nothing: ``put`` returns False,
``batch_put`` gives that item an ``ObjectNotAdmittedError`` so the caller can count it (not a failure).

Quick start::

    with StoreClient("127.0.0.1:50051", transport="auto") as c:
        c.put(b"Bkey", b"payload")
        assert c.get(b"Bkey") == b"payload"
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool.kvstore.errors import (
    CapacityExceededError,
    ObjectNotAdmittedError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    ShardSetError,
    StoreError,
    StoreUnavailableError,
    WrongShardError,
    error_for_code,
)
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG
from kvpool.kvstore.protocol.master_link import MasterLink
from kvpool.kvstore.protocol.master_wire import put_start_batch_request
from kvpool.kvstore.shards import DEFAULT_DEPTH, ShardSet, master_groups
from kvpool.kvstore.transport.base import (
    DEFAULT_DEADLINES,
    Buffer,
    Deadlines,
    Payload,
    Transport,
    Visit,
    payload_size,
)
from kvpool.kvstore.transport.selector import TransportSelector
from kvpool.proto import common_pb2, master_pb2

CAPACITY_RETRIES = 4  # 50+100+200+400 ms: covers a master->node Delete in flight
# A caller that wraps store calls in its own time budget (a worker's --store-timeout, the sync client's
# deadline_s) gives each master call this share of it: the call's own deadline then fires first, so the
# master link sees a silent master as a timeout and opens its breaker (master_link.py), instead of a
# cancellation it cannot tell from a caller going away.
RPC_SHARE_OF_BUDGET = 0.8
NO_MAP_BACKOFF_S = 2.0  # masters without HA cannot name the fleet's shards: ask them again this much later
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class PutItem:
    """One object of a ``batch_put``: ``data`` is one buffer, or a ``Payload`` of parts in order (a cache
    unit's header and tensors, put without being joined first)."""

    key: bytes
    data: Buffer | Payload
    kind: int = common_pb2.BLOB
    tenant: str | None = None
    parent: bytes = b""
    ttl_ms: int = 0
    route: bytes = b""  # master shards: the chain's route (ShardSet.route_of_chain); b"" = by the key
    # KV events (docs/design/kv_events.md): the block's token ids, for a master that publishes them to
    # routers which rehash tokens; () = not sent (the default: they cost ~2 B/token on the PutStart)
    token_ids: Sequence[int] = ()
    retain: bool = False  # a client's retention hint covers it: admission does not turn it away

    @property
    def nbytes(self) -> int:
        return payload_size(self.data)


@dataclass(frozen=True, slots=True)
class PinResult:
    """``pin``'s answer: objects found and pinned (or unpinned), and whether the store's pin budget
    refused the pin (then nothing was pinned)."""

    pinned: int
    refused: bool = False


@dataclass(frozen=True, slots=True)
class LocatedPrefix:
    """``match_prefix``'s answer with its usable objects located: the master's column-wise reply
    (``MatchPrefixReply``) turned into one ``ObjectLocation`` per object, keyed by the caller's hashes, which
    is what ``fetch_into`` and the transports take."""

    usable_blocks: int
    mla_run_blocks: int
    checkpoint_blocks: list[int]
    lease_id: str
    usable_blocks_on_ssd: int
    mla: list[common_pb2.ObjectLocation]  # MLA blocks [0, usable_blocks)
    checkpoint: common_pb2.ObjectLocation | None  # closing block usable_blocks-1, when one was required

    @classmethod
    def of(
        cls,
        reply: master_pb2.MatchPrefixReply,
        block_hashes: Sequence[bytes],
        require_checkpoint: bool,
        counts_only: bool = False,
    ) -> LocatedPrefix:
        p = reply.usable_blocks
        keys = [MLA_TAG + bytes(h) for h in block_hashes[:p]]
        if require_checkpoint and p:
            keys.append(KDA_TAG + bytes(block_hashes[p - 1]))
        located: list[common_pb2.ObjectLocation] = []
        nodes = list(reply.nodes)
        if counts_only:  # the numbers alone were asked for
            keys = []
        try:
            for key, node, size, checksum, tier in zip(
                keys, reply.node, reply.size, reply.checksum, reply.tier, strict=True
            ):
                loc = common_pb2.ObjectLocation(
                    meta=common_pb2.ObjectMeta(key=key, size=size, checksum=checksum, tier=tier)
                )
                loc.node.CopyFrom(nodes[node])
                located.append(loc)
        except (ValueError, IndexError):  # a master of another version, or a broken reply: a store problem
            raise StoreError(
                f"MatchPrefix located {len(reply.size)} objects of {len(keys)} over {len(nodes)} nodes"
            ) from None
        with_ck = require_checkpoint and p > 0 and not counts_only
        return cls(
            usable_blocks=p,
            mla_run_blocks=reply.mla_run_blocks,
            checkpoint_blocks=list(reply.checkpoint_blocks),
            lease_id=reply.lease_id,
            usable_blocks_on_ssd=reply.usable_blocks_on_ssd,
            mla=located[:p],
            checkpoint=located[p] if with_ck else None,
        )


class AsyncStoreClient:
    """Talks to the master (or its shards); picks a transport per storage node (``auto`` | ``tcp`` | ``shm``
    | ``ucx``).

    ``master`` is one address, an HA group ``a,b``, or master shards ``G0;G1;...`` (docs/design/sharding.md):
    then a call goes to the shard that owns its chain: ``match_prefix`` by the route of its hashes (or the
    caller's ``route``), ``batch_put`` by each item's ``route``, ``batch_get`` / ``lookup`` / ``remove`` /
    ``pin`` by the ``route`` given; without one (a single ``put``, ``get``, ``exists``, objects outside a
    chain) by the key itself. The function is the one the masters check it with (``kvstore/shards.py``).

    Must be used from one event loop (the master links and pooled sockets belong to it).
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
        shard_depth: int = DEFAULT_DEPTH,
    ) -> None:
        self.master_address = master
        self._groups = master_groups(master)
        self.shards = ShardSet(len(self._groups), shard_depth)
        self._shard_set = str(self.shards) if self.shards.sharded else ""  # what routed calls declare
        self.tenant = tenant
        self.lease_ms = lease_ms
        self.rpc_timeout_s = rpc_timeout_s
        self.transports = TransportSelector(transport, deadlines)
        self._links: list[MasterLink | None] = [None] * self.shards.count
        self._retiring: dict[asyncio.Task[None], MasterLink] = {}  # links of a shard set left behind
        self._lease_link: dict[str, MasterLink] = {}  # lease id -> the master that granted it (sharded only)
        self._generation = 0  # bumped each time the shard set is followed (_follow)
        self._no_map_until = 0.0  # no master named the fleet's shards: not asked again until then
        self._counters: dict[str, float] = {}
        self._pending_releases: set[asyncio.Task] = set()

    @property
    def master(self) -> MasterLink:
        """The link to the master (shard 0 with shards; made on first use: it belongs to the running loop)."""
        return self.link(0)

    def link(self, shard: int) -> MasterLink:
        """The link to master shard ``shard``."""
        link = self._links[shard]
        if link is None:
            link = self._links[shard] = MasterLink(self._groups[shard], self.rpc_timeout_s)
        return link

    def route_of(self, block_hashes: Sequence[bytes]) -> bytes:
        """The route of a request's chain (``ShardSet.route_of_chain``; b"" without shards)."""
        return self.shards.route_of_chain(block_hashes) if self.shards.sharded else b""

    def _shard_of(self, route: bytes) -> int:
        return self.shards.shard_of_route(route) if self.shards.sharded else 0

    def _by_shard(self, keys: Sequence[bytes], route: bytes | None) -> dict[int, list[int]]:
        """Indexes of ``keys`` per owning shard: all to ``route``'s shard when given, else each by its key."""
        if route or not self.shards.sharded:
            return {self._shard_of(route or b""): list(range(len(keys)))}
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._shard_of(bytes(key)), []).append(i)
        return groups

    async def _follow(self, seen: int) -> bool:
        """A master said this client's shard set is stale (``ShardSetError`` / ``WrongShardError``): ask the
        masters (Describe) for the fleet's set and its shard leaders, and take them when one names them all
        (masters with HA know them from etcd; without it the caller only gets the error, and nobody is asked
        again for ``NO_MAP_BACKOFF_S``). True when the set changed since generation ``seen`` (by this call
        or a concurrent one): the caller sends its call once more."""
        if self._generation != seen:
            return True
        loop = asyncio.get_running_loop()
        if loop.time() < self._no_map_until:
            return False
        for shard in range(self.shards.count):
            try:
                d = await self.link(shard).describe()
            except StoreError:
                continue
            if not d.shard_masters:
                continue
            fleet, groups = ShardSet.parse(d.shard_set), master_groups(d.shard_masters)
            if len(groups) != fleet.count or (fleet == self.shards and groups == self._groups):
                return False
            kept = {g: link for g, link in zip(self._groups, self._links, strict=True) if link is not None}
            self._links = [kept.pop(g, None) for g in groups]  # a group that did not change keeps its link
            self._groups, self.shards = groups, fleet
            self._shard_set = str(fleet) if fleet.sharded else ""
            for link in kept.values():  # the others are closed once calls in flight on them had their time
                self._retiring[asyncio.get_running_loop().create_task(self._retire(link))] = link
            self._generation += 1
            self._count("shard_set_followed")
            log.info("store client: following the fleet's shard set %s (%s)", fleet, d.shard_masters)
            return True
        self._no_map_until = loop.time() + NO_MAP_BACKOFF_S
        return False

    async def _retire(self, link: MasterLink) -> None:
        await asyncio.sleep(self.rpc_timeout_s)
        await link.close()
        self._retiring = {t: lk for t, lk in self._retiring.items() if lk is not link}

    def _leased(self, shard: int, lease_id: str) -> str:
        if lease_id and self.shards.sharded:
            self._lease_link[lease_id] = self.link(shard)
        return lease_id

    async def close(self) -> None:
        if self._pending_releases:
            await asyncio.wait(self._pending_releases, timeout=self.rpc_timeout_s)
        await self.transports.close()
        for task, retired in list(self._retiring.items()):
            task.cancel()
            await retired.close()
        self._retiring.clear()
        for i, link in enumerate(self._links):
            if link is not None:
                await link.close()
                self._links[i] = None

    async def __aenter__(self) -> AsyncStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def metrics(self) -> dict[str, float]:
        """Counters: ops.*, failures.*, latency_s.* (sums), retries.node_full, put.not_admitted,
        bytes_in.<transport>, bytes_out.<transport>, shm.fast_hits, master.* (the master link's)."""
        link: dict[str, float] = {}
        for one in self._links:
            for k, v in (one.counters if one is not None else {}).items():
                link[f"master.{k}"] = link.get(f"master.{k}", 0.0) + v
        return {**self._counters, **self.transports.metrics(), **link}

    def _count(self, name: str, n: float = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

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

    # --- puts --------------------------------------------------------------------------------------------
    def _meta(self, item: PutItem, size: int) -> common_pb2.ObjectMeta:
        """A put's meta with its checksum left open (0): the transport computes it on the way
        (``Transport.put``: the shm one while copying, tcp while sending) and PutCommit declares it."""
        return common_pb2.ObjectMeta(
            key=bytes(item.key),
            kind=item.kind,
            size=size,
            tenant=self.tenant if item.tenant is None else item.tenant,
            parent=item.parent,
            ttl_ms=item.ttl_ms,
        )

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
        """Store ``data`` under ``key``; True if written now, False if it already existed (no-op success) or
        admission turned it away.

        ``replace_if_corrupt``: a reader that got ``CorruptObjectError`` and recomputed the object re-puts it
        with this set, so the damaged copy is replaced instead of the put being a no-op.
        """
        item = PutItem(key, data, kind, tenant, parent, ttl_ms)
        return await self._timed("put", self._put(item, replace_if_corrupt))

    async def _put(self, item: PutItem, replace_if_corrupt: bool) -> bool:
        view = Payload.of(item.data)  # one buffer or a cache unit's parts: never joined on the way
        meta = self._meta(item, view.nbytes)
        master = self.link(self._shard_of(item.route or item.key))
        start = await master.put_start(
            master_pb2.PutStartRequest(
                meta=meta,
                replace_if_corrupt=replace_if_corrupt,
                checksum_at_commit=True,
                route=item.route,
                token_ids=item.token_ids,
                retain=item.retain,
            )
        )
        if start.status != master_pb2.PutStartReply.STARTED:
            if start.status == master_pb2.PutStartReply.NOT_ADMITTED:
                self._count("put.not_admitted")
            return False  # EXISTS / IN_PROGRESS / NOT_ADMITTED: nothing to write
        meta.epoch = start.epoch  # HA fencing: nodes refuse puts placed by a deposed leader
        meta.shard = start.shard  # nodes keep each shard's objects apart
        try:
            await self._transfer(self.transports.for_node(start.node), start.node, start.put_id, meta, view)
        except BaseException as exc:
            await self._abort(master, start.put_id, exc)
            raise
        await master.put_commit(master_pb2.PutCommitRequest(put_id=start.put_id, checksum=meta.checksum))
        return True

    async def _transfer(
        self,
        transport: Transport,
        node: common_pb2.NodeEndpoint,
        put_id: str,
        meta: common_pb2.ObjectMeta,
        view: Payload,
    ) -> None:
        """Send the bytes; a node that is momentarily full (the master's evictions reach it asynchronously,
        as Delete/Demote calls) is retried with a short backoff before the put fails."""
        delay = 0.05
        for attempt in range(CAPACITY_RETRIES + 1):
            try:
                await transport.put(node, put_id, meta, view)
                return
            except ObjectTooLargeError:
                raise
            except CapacityExceededError:
                if attempt == CAPACITY_RETRIES:
                    raise
                self._count("retries.node_full")
                await asyncio.sleep(delay)
                delay *= 2

    async def _abort(self, master: MasterLink, put_id: str, exc: BaseException) -> None:
        with contextlib.suppress(StoreError):  # the master aborts it at its deadline anyway
            await master.put_abort(master_pb2.PutAbortRequest(put_id=put_id, reason=repr(exc)[:500]))

    async def batch_put(self, items: Sequence[PutItem | tuple[bytes, Buffer]]) -> list[StoreError | None]:
        """Per item: None on success (duplicates included), ``ObjectNotAdmittedError`` when admission turned
        it away, or the typed error; pipelined per node."""
        return await self._timed(
            "batch_put", self._batch_put([i if isinstance(i, PutItem) else PutItem(*i) for i in items])
        )

    async def _batch_put(self, items: list[PutItem]) -> list[StoreError | None]:
        """:meth:`_batch_put_routed`; items a master refused for a stale shard set are sent once more after
        following the fleet's (:meth:`_follow`)."""
        seen = self._generation
        results = await self._batch_put_routed(items)
        stale = [i for i, r in enumerate(results) if isinstance(r, ShardSetError | WrongShardError)]
        if stale and await self._follow(seen):
            again = await self._batch_put_routed([items[i] for i in stale])
            for i, r in zip(stale, again, strict=True):
                results[i] = r
        return results

    async def _batch_put_routed(self, items: list[PutItem]) -> list[StoreError | None]:
        """Per master shard (all of one chain go to one): :meth:`_batch_put_at`."""
        if not self.shards.sharded:
            return await self._batch_put_at(self.master, items)
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(self._shard_of(item.route or item.key), []).append(i)
        results: list[StoreError | None] = [None] * len(items)

        async def run(shard: int, idx: list[int]) -> None:
            got = await self._batch_put_at(self.link(shard), [items[i] for i in idx])
            for i, r in zip(idx, got, strict=True):
                results[i] = r

        await asyncio.gather(*(run(shard, idx) for shard, idx in groups.items()))
        return results

    async def _batch_put_at(self, master: MasterLink, items: list[PutItem]) -> list[StoreError | None]:
        """One PutStartBatch for all items, one pipelined transfer per node, one PutCommitBatch per node:
        three control round trips for a whole push instead of two per object."""
        results: list[StoreError | None] = [None] * len(items)
        views = [Payload.of(i.data) for i in items]
        metas = [self._meta(i, v.nbytes) for i, v in zip(items, views, strict=True)]
        try:
            batch = await master.put_start_batch(
                put_start_batch_request(
                    metas,
                    token_ids=[i.token_ids for i in items],
                    routes=[i.route for i in items],
                    retain=[i.retain for i in items],
                    checksum_at_commit=True,
                    shard_set=self._shard_set,
                )
            )
        except Exception as exc:
            return [_store_error(exc)] * len(items)
        if not len(batch.status) == len(batch.put_ids) == len(batch.node) == len(items):
            # not this protocol's answer (an older master?): nothing was sent
            answered = len(batch.status)
            wrong = StoreUnavailableError(f"master answered {answered} puts for {len(items)} objects")
            return [wrong] * len(items)
        for err in batch.errors:
            results[err.index] = _item_error(err)
        put_ids = list(batch.put_ids)
        endpoints = list(batch.nodes)
        started = master_pb2.PutStartReply.STARTED
        groups: dict[tuple[int, str], tuple[Transport, Any, list[int]]] = {}
        for i, (status, at) in enumerate(zip(batch.status, batch.node, strict=True)):
            if status != started:
                if status == master_pb2.PutStartReply.NOT_ADMITTED:
                    results[i] = ObjectNotAdmittedError(f"put of {metas[i].key[:9].hex()}… not admitted")
                    self._count("put.not_admitted")
                continue  # EXISTS / IN_PROGRESS: nothing to write; an error: already in results
            metas[i].epoch = batch.epoch  # HA fencing: a node refuses puts placed by a deposed leader
            metas[i].shard = batch.shard  # nodes keep each shard's objects apart
            node = endpoints[at]
            try:
                transport = self.transports.for_node(node)
            except StoreError as exc:
                results[i] = exc
                await self._abort(master, put_ids[i], exc)
                continue
            key = (id(transport), node.node_id)
            groups.setdefault(key, (transport, node, []))[2].append(i)

        async def run(transport: Transport, node: Any, idx: list[int]) -> None:
            got = await transport.batch_put(node, [(put_ids[i], metas[i], views[i]) for i in idx])
            for j, (i, err) in enumerate(zip(idx, got, strict=True)):
                if isinstance(err, CapacityExceededError) and not isinstance(err, ObjectTooLargeError):
                    try:  # node momentarily full: the single-put path retries with backoff
                        await self._transfer(transport, node, put_ids[i], metas[i], views[i])
                        got[j] = None
                    except StoreError as exc:
                        got[j] = exc
            sent = [i for i, err in zip(idx, got, strict=True) if err is None]
            failed = [(i, err) for i, err in zip(idx, got, strict=True) if err is not None]
            await asyncio.gather(*(self._abort(master, put_ids[i], err) for i, err in failed))
            for i, err in failed:
                results[i] = err
            if not sent:
                return
            try:
                commits = await master.put_commit_batch(
                    master_pb2.PutCommitBatchRequest(
                        put_ids=[put_ids[i] for i in sent], checksums=[metas[i].checksum for i in sent]
                    )
                )
            except Exception as exc:
                for i in sent:
                    results[i] = _store_error(exc)
                return
            for err in commits.errors:
                results[sent[err.index]] = _item_error(err)

        await asyncio.gather(*(run(*group) for group in groups.values()))
        return results

    # --- reads -------------------------------------------------------------------------------------------
    async def _lookup(
        self, keys: Sequence[bytes], acquire: bool, route: bytes | None = None, exists_only: bool = False
    ) -> master_pb2.LookupReply:
        groups = self._by_shard(keys, route)
        answers = await asyncio.gather(
            *(
                self.link(shard).lookup(
                    master_pb2.LookupRequest(
                        keys=[bytes(keys[i]) for i in idx],
                        acquire=acquire,
                        lease_ms=self.lease_ms,
                        exists_only=exists_only,
                    )
                )
                for shard, idx in groups.items()
            ),
            return_exceptions=True,
        )
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:  # release what the other shards granted, then fail as one call would
            for shard, a in zip(groups, answers, strict=True):
                if isinstance(a, master_pb2.LookupReply) and a.lease_id:
                    self._release_soon(self._leased(shard, a.lease_id))
            raise failed[0]
        replies = [a for a in answers if isinstance(a, master_pb2.LookupReply)]
        if len(replies) == 1:
            self._leased(next(iter(groups)), replies[0].lease_id)
            return replies[0]
        # keys of several shards: one reply in request order, whose lease id lists each shard's (by spaces)
        found = {loc.meta.key: loc for reply in replies for loc in reply.found}
        out = master_pb2.LookupReply()
        out.found.extend(found[bytes(k)] for k in keys if bytes(k) in found)
        out.missing.extend(k for reply in replies for k in reply.missing)
        out.lease_id = " ".join(
            self._leased(shard, r.lease_id) for shard, r in zip(groups, replies, strict=True) if r.lease_id
        )
        return out

    async def lookup(
        self, keys: Sequence[bytes], acquire: bool = False, route: bytes | None = None
    ) -> master_pb2.LookupReply:
        """Locations of ``keys`` (found in request order, plus missing). ``acquire`` read-pins the found ones
        under a lease: ``fetch_into`` them, then ``release(reply.lease_id)``. ``route``: the keys' chain
        (master shards)."""
        return await self._timed("lookup", self._lookup(keys, acquire, route))

    def _release_soon(self, lease_id: str) -> None:
        """Release off the critical path: the bytes are already here, so the caller need not wait for the
        master's answer (a lost Release only means the lease runs to its deadline)."""
        if lease_id:
            task = asyncio.get_running_loop().create_task(self.release(lease_id))
            self._pending_releases.add(task)
            task.add_done_callback(self._pending_releases.discard)

    async def release(self, lease_id: str) -> None:
        """Drop a read-pin lease (e.g. from ``match_prefix(acquire=True)``); failures are only counted."""
        for one in lease_id.split():  # a lookup across shards holds one lease per shard
            try:
                link = self._lease_link.pop(one, None) or self.master
                await link.release(master_pb2.ReleaseRequest(lease_id=one))
            except StoreError:
                self._count("failures.release")

    async def get(self, key: bytes) -> bytes:
        """The object's bytes (one copy more than ``get_into``); ``ObjectNotFoundError`` if absent."""
        got = await self._timed("get", self._read_into(key, None))
        assert isinstance(got, bytearray)
        return bytes(got)

    async def get_into(self, key: bytes, out: Buffer) -> int:
        """Copy the object into ``out`` (bytearray / numpy / contiguous CPU tensor); returns its size.

        On an error the contents of ``out`` are unspecified (a transfer may have started).
        """
        got = await self._timed("get", self._read_into(key, out))
        assert isinstance(got, int)
        return got

    async def _read_into(self, key: bytes, out: Buffer | None) -> int | bytearray:
        """Lookup(acquire) decides whether the object exists and read-pins it; the bytes come from the node it
        names, verified against the checksum in that answer. ``out=None``: a buffer of the object's size is
        allocated and returned."""
        reply = await self._lookup([key], acquire=True)
        try:
            if not reply.found:
                raise ObjectNotFoundError(f"key {bytes(key)[:8].hex()}… is not in the store")
            loc = reply.found[0]
            transport = self.transports.for_node(loc.node)
            if out is None:
                buf = bytearray(loc.meta.size)
                await transport.get_into(loc, buf)
                return buf
            return await transport.get_into(loc, out)
        finally:
            self._release_soon(reply.lease_id)

    def _per_transport(
        self, locations: Sequence[common_pb2.ObjectLocation], results: list
    ) -> list[tuple[Transport, list[int]]]:
        """The item indexes each transport serves (one batch per transport, pipelined per node); an item no
        transport can reach gets its ``StoreError`` in ``results`` right away."""
        groups: dict[int, tuple[Transport, list[int]]] = {}
        for i, loc in enumerate(locations):
            try:
                transport = self.transports.for_node(loc.node)
            except StoreError as exc:
                results[i] = exc
                continue
            groups.setdefault(id(transport), (transport, []))[1].append(i)
        return list(groups.values())

    async def fetch_into(
        self, locations: Sequence[common_pb2.ObjectLocation], outs: Sequence[Buffer]
    ) -> list[int | StoreError]:
        """Move located (and pinned) objects into ``outs``: per-item size or error, pipelined per node."""
        results: list[int | StoreError] = [StoreError("not run")] * len(locations)

        async def run(transport: Transport, idx: list[int]) -> None:
            got = await transport.batch_get_into([(locations[i], outs[i]) for i in idx])
            for i, r in zip(idx, got, strict=True):
                results[i] = r

        await asyncio.gather(*(run(t, idx) for t, idx in self._per_transport(locations, results)))
        return results

    async def read_in_place(
        self, locations: Sequence[common_pb2.ObjectLocation], visit: Visit
    ) -> list[Exception | None]:
        """Hand located objects' bytes to ``visit(i, view)`` without copying them where the transport allows
        (shm: straight out of the node's pool); per item None, a ``StoreError`` or what ``visit`` raised. The
        bytes are not verified here: ``visit`` checks them (``Transport.read_in_place``)."""
        results: list[Exception | None] = [StoreError("not run")] * len(locations)

        async def run(transport: Transport, idx: list[int]) -> None:
            got = await transport.read_in_place([locations[i] for i in idx], lambda j, v: visit(idx[j], v))
            for i, r in zip(idx, got, strict=True):
                results[i] = r

        groups = self._per_transport(locations, results)
        await self._timed("read_in_place", asyncio.gather(*(run(t, idx) for t, idx in groups)))
        return results

    async def batch_get(self, keys: Sequence[bytes], route: bytes | None = None) -> list[bytes | StoreError]:
        """Per key: its bytes or the typed error (``ObjectNotFoundError`` for missing keys). ``route``: the
        keys' chain (master shards; default each key by itself)."""
        return await self._timed("batch_get", self._batch_get(keys, route))

    async def _batch_get(self, keys: Sequence[bytes], route: bytes | None) -> list[bytes | StoreError]:
        reply = await self._lookup(keys, acquire=True, route=route)
        try:
            by_key = {loc.meta.key: loc for loc in reply.found}
            locs = [by_key[k] for k in keys if k in by_key]
            outs = [bytearray(loc.meta.size) for loc in locs]
            fetched = await self.fetch_into(locs, outs)
            got = {loc.meta.key: (buf, r) for loc, buf, r in zip(locs, outs, fetched, strict=True)}
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

    async def exists(self, key: bytes) -> bool:
        """Whether ``key`` is stored (does not pin, so probing never blocks eviction)."""
        reply = await self._timed("exists", self._lookup([key], acquire=False))
        return bool(reply.found)

    async def batch_exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is committed: one exists-only Lookup (the master answers the missing keys, no
        locations), per shard."""
        reply = await self._timed("exists", self._lookup(keys, acquire=False, exists_only=True))
        missing = set(reply.missing)
        return [bytes(k) not in missing for k in keys]

    async def match_prefix(
        self,
        block_hashes: Sequence[bytes],
        tenant: str | None = None,
        require_checkpoint: bool = True,
        acquire: bool = False,
        lease_ms: int | None = None,
        route: bytes | None = None,
        resume: bool = False,
    ) -> LocatedPrefix:
        """Usable prefix, MLA run and locations in one call; after ``acquire`` call ``release(lease_id)``.
        ``route``: with master shards, the route of the request's whole chain when ``block_hashes`` is only
        its head (default: the route of ``block_hashes``). ``resume``: decode reading what prefill just
        stored for the same request, not a writer's lookup (the index learns nothing from it)."""
        ask = (block_hashes, tenant, require_checkpoint, acquire, lease_ms)
        seen = self._generation
        try:
            return await self._match_prefix(*ask, route, resume)
        except (ShardSetError, WrongShardError):
            if not await self._follow(seen):
                raise
        return await self._match_prefix(*ask, None, resume)  # the caller's route was from the old set

    async def _match_prefix(
        self,
        block_hashes: Sequence[bytes],
        tenant: str | None,
        require_checkpoint: bool,
        acquire: bool,
        lease_ms: int | None,
        route: bytes | None,
        resume: bool,
    ) -> LocatedPrefix:
        if not route:  # None or b"": the route of the hashes themselves
            route = self.shards.route_of_chain(block_hashes)
        shard = self._shard_of(route)
        req = master_pb2.MatchPrefixRequest(
            block_hashes=list(block_hashes),
            tenant=self.tenant if tenant is None else tenant,
            require_checkpoint=require_checkpoint,
            acquire=acquire,
            lease_ms=lease_ms or self.lease_ms,
            route=route if self.shards.sharded else b"",
            shard_set=self._shard_set,
            resume=resume,
        )
        reply = await self._timed("match_prefix", self.link(shard).match_prefix(req))
        self._leased(shard, reply.lease_id)
        return LocatedPrefix.of(reply, block_hashes, require_checkpoint)

    # --- management --------------------------------------------------------------------------------------
    async def remove(self, keys: bytes | Sequence[bytes], route: bytes | None = None) -> int:
        """Remove objects; how many were there. ``route``: the keys' chain (master shards)."""
        keys = [keys] if isinstance(keys, bytes | bytearray) else list(keys)
        groups = self._by_shard(keys, route)
        replies = await self._timed(
            "remove",
            asyncio.gather(
                *(
                    self.link(shard).remove(master_pb2.RemoveRequest(keys=[keys[i] for i in idx]))
                    for shard, idx in groups.items()
                )
            ),
        )
        return sum(r.removed for r in replies)

    async def pin(
        self, keys: Sequence[bytes], ttl_ms: int, route: bytes | None = None, session: str = ""
    ) -> PinResult:
        """Soft-pin ``keys`` for ``ttl_ms`` on behalf of ``session`` (0 removes that pin). ``route``: the
        keys' chain (master shards; default each key by itself). Over the store's pin budget nothing is
        pinned and ``refused`` says so: a pin is a hint, never an error."""
        keys = list(keys)
        groups = self._by_shard(keys, route)
        replies = await self._timed(
            "pin",
            asyncio.gather(
                *(
                    self.link(shard).pin(
                        master_pb2.PinRequest(keys=[keys[i] for i in idx], ttl_ms=ttl_ms, session=session)
                    )
                    for shard, idx in groups.items()
                )
            ),
        )
        return PinResult(sum(r.pinned for r in replies), any(r.refused for r in replies))

    async def stats(self, shard: int = 0) -> master_pb2.StatsReply:
        return await self.link(shard).stats(master_pb2.StatsRequest())


def _item_error(err: master_pb2.ItemError) -> StoreError:
    """A batch item's failure as the typed error the single call would have raised."""
    return error_for_code(err.code, err.message)


def _store_error(exc: BaseException) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    if not isinstance(exc, Exception):
        raise exc
    return StoreUnavailableError(f"{type(exc).__name__}: {exc}")
