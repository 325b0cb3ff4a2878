"""shm transport: same-host copies straight into / out of the node's shared-memory pool (one memcpy).

Puts: RESERVE (the node allocates an extent) → the client copies the bytes in, hashing them on the way (the
checksum is left to the put: ``checksum_at_commit``) → SEAL publishes the object under that checksum, or
aborts the reservation. The client then declares the same checksum at PutCommit. A batch pipelines all its
RESERVEs, the copies, then all its SEALs: two round trips per node for a whole push.

Reads: the node's LOCATE answers where the object lies; the client copies it out of the mapped segment and
verifies the checksum after the copy. The master's read-pin lease (taken by Lookup/MatchPrefix with
acquire=true) keeps the extent from being evicted during the copy; the checksum catches anything else.

Read hints: every LOCATE / SEAL reply also names the object's stamp (slot, generation) in the node's stamp
table (``protocol/shm_segment``). The transport keeps it per (node, key), bounded LRU (``HINTS_MAX``, ~200 B
each), and a later get of that object (``read_cached``) copies it with no message when the stamp still holds
that generation before and after the copy and the copy verifies; anything else drops the hint and the get
asks the node again. A retired object's stamp is cleared before its extent can be reused, so a hint never
yields bytes of a deleted, demoted or replaced object.

The control frames go over the node's tcp data-plane connection (pipelined, ~0.1 ms). Only usable when the
node is on this host (same ``host_id``) and advertises its segment; asking for shm otherwise raises
``TransportUnavailableError`` (no silent fallback).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash
from kvpool.kvstore.errors import (
    BadRequestError,
    ProtocolError,
    StaleReadError,
    StoreError,
    StoreUnavailableError,
    TransportUnavailableError,
)
from kvpool.kvstore.protocol import shm_segment
from kvpool.kvstore.protocol.data_frame import (
    FLAG_ABORT,
    FLAG_EXISTS,
    OP_LOCATE,
    OP_RESERVE,
    OP_SEAL,
    Frame,
    FrameError,
    ShmExtent,
)
from kvpool.kvstore.protocol.shm_segment import ReaderMapping, StampReader
from kvpool.kvstore.transport.base import (
    DEFAULT_DEADLINES,
    Buffer,
    Deadlines,
    Payload,
    Transport,
    Visit,
    as_bytes_view,
    verify_checksum,
    visited,
)
from kvpool.kvstore.transport.tcp import TcpTransport
from kvpool.proto import common_pb2, node_pb2

HINTS_MAX = 16_384  # remembered objects per transport, ~200 B each


@dataclass(frozen=True, slots=True)
class ReadHint:
    """What a LOCATE / SEAL reply said about one object, to be revalidated by its stamp before each use."""

    mapping: ReaderMapping
    stamps: StampReader
    offset: int
    size: int
    slot: int
    generation: int
    checksum: int


class ShmTransport(Transport):
    """Maps each node's segment once; control frames ride ``control``'s pooled tcp connections.

    Counters (plain ints): ``fast_hits`` (served by ``read_cached``), ``fast_stale`` (hint dropped: stamp
    changed, node gone, checksum/size mismatch), ``locates`` (LOCATE frames sent).
    """

    name = "shm"

    def __init__(
        self,
        local_host_id: str,
        deadlines: Deadlines = DEFAULT_DEADLINES,
        control: TcpTransport | None = None,
        hint_capacity: int = HINTS_MAX,
    ) -> None:
        super().__init__(deadlines)
        self.local_host_id = local_host_id
        self._control = control or TcpTransport(deadlines)
        self._owns_control = control is None
        self._segments: dict[str, ReaderMapping] = {}
        self.hints: OrderedDict[tuple[str, bytes], ReadHint] = OrderedDict()  # (node_id, key) -> hint
        self._hint_capacity = hint_capacity
        self.fast_hits = 0
        self.fast_stale = 0
        self.locates = 0

    def reachable(self, node: common_pb2.NodeEndpoint) -> bool:
        return bool(node.shm_name) and node.host_id == self.local_host_id

    def _check(self, node: common_pb2.NodeEndpoint) -> None:
        if not self.reachable(node):
            why = "does not export a shm pool" if not node.shm_name else "is on another host"
            raise TransportUnavailableError(f"shm: node {node.node_id} {why}")

    def _segment(self, name: str) -> ReaderMapping:
        mapping = self._segments.get(name)
        if mapping is None:
            try:
                mapping = ReaderMapping(name, background=True)  # map the pool off the request path
            except FileNotFoundError as exc:
                raise StoreUnavailableError(f"shm segment {name} is gone (node stopped?)") from exc
            self._segments[name] = mapping
        return mapping

    @staticmethod
    def _parse(reply: Frame) -> ShmExtent:
        try:
            return ShmExtent.unpack(reply.aux)
        except (FrameError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"bad shm extent reply: {exc}") from exc

    def _map(self, ext: ShmExtent) -> ReaderMapping:
        """The segment of ``ext``, checked to contain it and mapped over it."""
        mapping = self._segment(ext.segment)
        if ext.offset + ext.size > len(mapping.buf):
            raise BadRequestError(
                f"node answered extent {ext.offset}+{ext.size} beyond its {len(mapping.buf)} B segment"
            )
        mapping.prepare(ext.offset, ext.size)
        return mapping

    # --- read hints ----------------------------------------------------------------------------------------
    def _remember(self, node: common_pb2.NodeEndpoint, key: bytes, ext: ShmExtent, checksum: int) -> None:
        """Keep a stamped extent as the hint for ``key`` on ``node``; an unstamped one drops the old hint."""
        hint_key = (node.node_id, key)
        mapping = self._segments.get(ext.segment)
        if not ext.generation or mapping is None or mapping.stamps is None:
            self.hints.pop(hint_key, None)
            return
        stamps = mapping.stamps
        self.hints[hint_key] = ReadHint(
            mapping, stamps, ext.offset, ext.size, ext.slot, ext.generation, checksum
        )
        self.hints.move_to_end(hint_key)
        while len(self.hints) > self._hint_capacity:
            self.hints.popitem(last=False)

    def _remember_reply(self, node: common_pb2.NodeEndpoint, key: bytes, reply: Frame) -> None:
        """A SEAL reply or an EXISTS RESERVE reply that describes the object: keep it as a read hint."""
        if not reply.aux:
            return
        try:
            ext = self._parse(reply)
            self._map(ext)
        except StoreError:
            return  # a hint is an optimisation: the put itself succeeded
        self._remember(node, key, ext, reply.checksum)

    def _drop_hint(self, hint_key: tuple[str, bytes]) -> None:
        self.fast_stale += 1
        self.hints.pop(hint_key, None)

    def read_cached(
        self, node: common_pb2.NodeEndpoint, key: bytes, checksum: int, size: int, out: Buffer
    ) -> int | None:
        """Copy a remembered object into ``out`` with no round trip; None = no usable hint (take the LOCATE
        path, which refreshes it).

        The bytes are returned only if the node's stamp for the object holds the remembered generation
        before and after the copy (the object was readable for the whole copy, see ``shm_segment``) and the
        copy hashes to ``checksum``. A mismatch is not a ``CorruptObjectError``: the object may have been
        legitimately deleted or replaced; the hint is dropped and None returned. On None, ``out``'s
        contents are unspecified.
        """
        if not shm_segment.READS_TRUSTED:
            return None
        hint_key = (node.node_id, key)
        hint = self._valid_hint(node, key, checksum, size)
        if hint is None:
            return None
        view = as_bytes_view(out)
        if len(view) < size:
            return None  # the regular path reports the small buffer
        stamps, slot, generation = hint.stamps, hint.slot, hint.generation
        dst = view[:size] if len(view) != size else view
        try:
            dst[:] = hint.mapping.buf[hint.offset : hint.offset + size]
        except ValueError:  # the mapping was closed under us (transport closing)
            self._drop_hint(hint_key)
            return None
        # second load after every copy load: G still there => the copy read only the object given G
        if stamps.generation(slot) != generation or xxhash.xxh3_64_intdigest(dst) != checksum:
            self._drop_hint(hint_key)
            return None
        self.hints.move_to_end(hint_key)
        self.fast_hits += 1
        self.bytes_in += size
        return size

    def _valid_hint(
        self, node: common_pb2.NodeEndpoint, key: bytes, checksum: int, size: int
    ) -> ReadHint | None:
        """The remembered extent of ``key`` if its stamp still names it now; a stale hint is dropped."""
        hint_key = (node.node_id, key)
        hint = self.hints.get(hint_key)
        if hint is None:
            return None
        moved = bool(node.shm_name) and node.shm_name != hint.mapping.name  # a restarted node's new segment
        if (
            hint.checksum != checksum
            or hint.size != size
            or moved
            or hint.stamps.generation(hint.slot) != hint.generation
            or hint.stamps.fields(hint.slot) != (hint.offset, size, checksum)
            or hint.mapping.unlinked()
        ):
            self._drop_hint(hint_key)
            return None
        return hint

    # --- puts ----------------------------------------------------------------------------------------------
    async def _one(self, node: common_pb2.NodeEndpoint, frame: Frame) -> Frame:
        reply = (await self._control.control(node, [frame]))[0]
        if isinstance(reply, StoreError):
            raise reply
        return reply

    def _copy_in(self, ext: ShmExtent, meta: common_pb2.ObjectMeta, payload: Payload) -> None:
        """Copy the payload (part by part) into its reserved extent; with the checksum left to us
        (``meta.checksum`` 0), hash it chunk by chunk as it lands (one pass) and fill it in for SEAL and
        the caller's PutCommit."""
        dst = self._map(ext).buf[ext.offset : ext.offset + meta.size]
        if meta.checksum:
            payload.copy_into(dst)
        else:
            meta.checksum = payload.copy_hashing_into(dst)

    @staticmethod
    def _reserve_frame(put_id: str, meta: common_pb2.ObjectMeta) -> Frame:
        return Frame(
            OP_RESERVE, key=meta.key, aux=node_pb2.PutHeader(put_id=put_id, meta=meta).SerializeToString()
        )

    async def put(
        self, node: common_pb2.NodeEndpoint, put_id: str, meta: common_pb2.ObjectMeta, data: Buffer
    ) -> None:
        """RESERVE, copy (hashing), SEAL. SEAL carries the checksum computed while copying when the put left
        it open (the node records it: it describes the bytes as they lie in its pool, and every reader
        verifies it); otherwise the node verifies the declared one."""
        self._check(node)
        view = Payload.of(data)
        if view.nbytes != meta.size:
            raise ValueError(f"data is {view.nbytes} B, meta says {meta.size} B")
        reply = await self._one(node, self._reserve_frame(put_id, meta))
        if reply.flags & FLAG_EXISTS:
            self._remember_reply(node, meta.key, reply)
            meta.checksum = meta.checksum or reply.checksum  # the copy already there (same key = same bytes)
            return
        try:
            self._copy_in(self._parse(reply), meta, view)
        except BaseException:
            with contextlib.suppress(StoreError):
                await self._one(node, Frame(OP_SEAL, aux=put_id.encode(), flags=FLAG_ABORT))
            raise
        sealed = await self._one(node, Frame(OP_SEAL, aux=put_id.encode(), checksum=meta.checksum))
        self.bytes_out += meta.size
        self._remember_reply(node, meta.key, sealed)

    async def batch_put(
        self, node: common_pb2.NodeEndpoint, items: Sequence[tuple[str, common_pb2.ObjectMeta, Buffer]]
    ) -> list[StoreError | None]:
        """All RESERVEs pipelined, the copies, then all SEALs pipelined: two round trips for the batch."""
        try:
            self._check(node)
        except StoreError as exc:
            return [exc] * len(items)
        results: list[StoreError | None] = [None] * len(items)
        reserves = await self._control.control(node, [self._reserve_frame(p, m) for p, m, _d in items])
        to_seal: list[int] = []
        for i, ((put_id, meta, data), reply) in enumerate(zip(items, reserves, strict=True)):
            if isinstance(reply, StoreError):
                results[i] = reply
                continue
            if reply.flags & FLAG_EXISTS:
                self._remember_reply(node, meta.key, reply)
                meta.checksum = meta.checksum or reply.checksum
                continue
            try:
                payload = Payload.of(data)
                if payload.nbytes != meta.size:
                    raise BadRequestError(f"data is {payload.nbytes} B, meta says {meta.size} B")
                self._copy_in(self._parse(reply), meta, payload)
                to_seal.append(i)
            except StoreError as exc:
                results[i] = exc
                await self._control.control(node, [Frame(OP_SEAL, aux=put_id.encode(), flags=FLAG_ABORT)])
        if not to_seal:
            return results
        seals = await self._control.control(
            node, [Frame(OP_SEAL, aux=items[i][0].encode(), checksum=items[i][1].checksum) for i in to_seal]
        )
        for i, reply in zip(to_seal, seals, strict=True):
            if isinstance(reply, StoreError):
                results[i] = reply
            else:
                self.bytes_out += items[i][1].size
                self._remember_reply(node, items[i][1].key, reply)
        return results

    # --- gets ----------------------------------------------------------------------------------------------
    def _copy_located(self, reply: Frame, out: memoryview) -> ShmExtent:
        """Copy the object a LOCATE reply names into ``out`` (not verified yet)."""
        ext = self._parse(reply)
        mapping = self._map(ext)
        if ext.size > len(out):
            raise BadRequestError(f"buffer of {len(out)} B is smaller than the object ({ext.size} B)")
        out[: ext.size] = mapping.buf[ext.offset : ext.offset + ext.size]
        return ext

    async def _get_into(self, location: common_pb2.ObjectLocation, out: memoryview) -> int:
        """LOCATE + copy (``get_into`` verifies). The reply refreshes the read hint right away: a hint is
        only ever used by ``read_cached``, which verifies the stamp and the checksum itself."""
        self._check(location.node)
        self.locates += 1
        reply = await self._one(location.node, Frame(OP_LOCATE, key=location.meta.key))
        ext = self._copy_located(reply, out)
        self._remember(location.node, location.meta.key, ext, reply.checksum)
        return ext.size

    async def get_into(self, location: common_pb2.ObjectLocation, out: Buffer) -> int:
        """``read_cached`` when a valid hint exists, else LOCATE + copy + verify (a checksum failure after a
        fresh LOCATE is a ``CorruptObjectError`` as on every transport)."""
        meta = location.meta
        n = self.read_cached(location.node, meta.key, meta.checksum, meta.size, out)
        return await super().get_into(location, out) if n is None else n

    async def batch_get_into(
        self, items: Sequence[tuple[common_pb2.ObjectLocation, Buffer]]
    ) -> list[int | StoreError]:
        """Remembered objects straight from their stamps; the rest: all LOCATEs of a node pipelined on one
        connection, then plain copies."""
        results: list[int | StoreError] = [StoreError("not run")] * len(items)
        by_node: dict[tuple[str, int], list[int]] = {}
        for i, (loc, out) in enumerate(items):
            try:
                n = self.read_cached(loc.node, loc.meta.key, loc.meta.checksum, loc.meta.size, out)
            except ValueError as exc:  # not a usable buffer
                results[i] = BadRequestError(str(exc))
                continue
            if n is not None:
                results[i] = n
                continue
            by_node.setdefault((loc.node.host, loc.node.tcp_port), []).append(i)
        for idx in by_node.values():
            node = items[idx[0]][0].node
            try:
                self._check(node)
            except StoreError as exc:
                for i in idx:
                    results[i] = exc
                continue
            self.locates += len(idx)
            replies = await self._control.control(
                node, [Frame(OP_LOCATE, key=items[i][0].meta.key) for i in idx]
            )
            for i, reply in zip(idx, replies, strict=True):
                loc, out = items[i]
                try:
                    if isinstance(reply, StoreError):
                        raise reply
                    view = as_bytes_view(out)
                    ext = self._copy_located(reply, view)
                    verify_checksum(view[: ext.size], loc.meta.checksum, loc.meta.key)
                    self.bytes_in += ext.size
                    self._remember(loc.node, loc.meta.key, ext, reply.checksum)
                    results[i] = ext.size
                except StoreError as exc:
                    results[i] = exc
        return results

    async def read_in_place(
        self, locations: Sequence[common_pb2.ObjectLocation], visit: Visit
    ) -> list[Exception | None]:
        """Visit each object where it lies in the node's pool: no copy at all (see ``Transport``).

        Remembered objects are visited straight from their hint; the rest after one pipelined LOCATE per
        node. A stamped object whose generation is not the same after the visit as before it (deleted,
        demoted or replaced meanwhile) is a ``StaleReadError``; an unstamped one (the node had no free stamp
        slot) is only as good as ``visit``'s own check, which is why ``visit`` must check."""
        if not shm_segment.READS_TRUSTED:  # no stamp protocol on this CPU: the copying path
            return await super().read_in_place(locations, visit)
        results: list[Exception | None] = [None] * len(locations)
        by_node: dict[tuple[str, int], list[int]] = {}
        for i, loc in enumerate(locations):
            hint = self._valid_hint(loc.node, loc.meta.key, loc.meta.checksum, loc.meta.size)
            if hint is not None:
                ext = ShmExtent(hint.mapping.name, hint.offset, hint.size, hint.slot, hint.generation)
                results[i] = self._visit_extent(hint.mapping, ext, i, visit)
                if not isinstance(results[i], StaleReadError):
                    self.fast_hits += 1
                    continue
                self._drop_hint((loc.node.node_id, loc.meta.key))
            by_node.setdefault((loc.node.host, loc.node.tcp_port), []).append(i)
        for idx in by_node.values():
            node = locations[idx[0]].node
            try:
                self._check(node)
                self.locates += len(idx)
                replies = await self._control.control(
                    node, [Frame(OP_LOCATE, key=locations[i].meta.key) for i in idx]
                )
            except StoreError as exc:
                for i in idx:
                    results[i] = exc
                continue
            for i, reply in zip(idx, replies, strict=True):
                try:
                    if isinstance(reply, StoreError):
                        raise reply
                    ext = self._parse(reply)
                    mapping = self._map(ext)
                except StoreError as exc:
                    results[i] = exc
                    continue
                results[i] = self._visit_extent(mapping, ext, i, visit)
                self._remember(node, locations[i].meta.key, ext, reply.checksum)
        return results

    def _visit_extent(self, mapping: ReaderMapping, ext: ShmExtent, i: int, visit: Visit) -> Exception | None:
        """``visit`` over the extent, then the stamp's second look (see ``read_cached``)."""
        stamps = mapping.stamps
        try:
            view = mapping.buf[ext.offset : ext.offset + ext.size]
        except ValueError:  # the mapping was closed under us (transport closing)
            return StoreUnavailableError(f"shm segment {mapping.name} was closed")
        result = visited(visit, i, view)
        with contextlib.suppress(BufferError):  # the visitor still holds a view of it: let it go with that
            view.release()
        if ext.generation and stamps is not None and stamps.generation(ext.slot) != ext.generation:
            return StaleReadError(f"shm object at {ext.offset} changed while it was read")
        self.bytes_in += ext.size
        return result

    async def close(self) -> None:
        if self._owns_control:
            await self._control.close()
        self.hints.clear()
        for mapping in self._segments.values():
            with contextlib.suppress(Exception):
                mapping.close()
        self._segments.clear()
