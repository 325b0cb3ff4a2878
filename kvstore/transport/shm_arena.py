"""A same-host writer's arena leases: pool space held on a node so that a put's copy starts at once.

Why: a shm put whose RESERVE must come back before the copy pays a round trip (~0.1-0.2 ms) on a 4 MB
put of ~1.2 ms. The writer instead holds an arena per node (``ARENA_BYTES``, opened with one RESERVE, see
``kvstore/node/arenas.py``), takes the next free bytes of it for each object (``take``: no message), and
names the offset in the SEAL that publishes the object. Bookkeeping only; the frames are sent by
``ShmTransport``.

A lease takes new slots for at most ``USE_S`` seconds and a sixth of the lifetime the node granted (its
reaper deadline, 30 s by default), so a slot is sealed long before the reaper could take the arena back.
A lease that is full, too old or failed is *retired*: it takes no new slots and is closed (its unused
bytes given back) once the last slot taken from it is sealed or dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.kvstore.errors import ProtocolError, StoreError
from kvpool.kvstore.protocol.data_frame import (
    FLAG_ABORT,
    FLAG_ARENA,
    OP_RESERVE,
    OP_SEAL,
    Frame,
    FrameError,
    ShmExtent,
)
from kvpool.kvstore.protocol.shm_segment import ReaderMapping
from kvpool.kvstore.transport.payload import Payload
from kvpool.kvstore.transport.tcp import TcpTransport
from kvpool.proto import common_pb2, node_pb2

ARENA_BYTES = 64 << 20  # asked for; a node grants at most 1/8 of its pool
MAX_OBJECT_SHARE = 4  # objects up to a quarter of the arena go through it, larger ones RESERVE their own
USE_S = 5.0  # a lease takes new slots this long after it was granted
ALIGN = 64  # the node's extent alignment (node/pool.py)
REFUSED_BACKOFF_S = 1.0  # a node that could not grant an arena is asked again after this long


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(slots=True)
class ArenaLease:
    """One arena granted by one node: ``[offset, offset + size)`` of its segment."""

    token: str
    segment: str
    offset: int
    size: int
    use_until: float
    cursor: int = 0  # bytes handed out so far
    outstanding: int = 0  # slots taken and not yet sealed or dropped
    retired: bool = False

    def fits(self, size: int) -> bool:
        return _round_up(size) <= self.size // MAX_OBJECT_SHARE

    def take(self, size: int) -> int | None:
        """The pool offset of a fresh ``size``-byte slot, or None (the lease is then retired)."""
        span = _round_up(size)
        if self.retired or self.cursor + span > self.size or time.monotonic() > self.use_until:
            self.retired = True
            return None
        offset = self.offset + self.cursor
        self.cursor += span
        self.outstanding += 1
        return offset

    def release_slot(self) -> bool:
        """A slot was sealed or dropped; True when the lease should now be closed on the node."""
        self.outstanding -= 1
        return self.retired and self.outstanding == 0


@dataclass(slots=True)
class ArenaSlot:
    """An object copied into a lease, waiting for the SEAL that publishes it there."""

    lease: ArenaLease
    offset: int
    meta: common_pb2.ObjectMeta


class ArenaWriter:
    """The arena side of a ``ShmTransport``: one lease per node, slots copied into, SEALs that name them.

    ``map_extent`` maps (and checks) an extent of a node's segment; ``remember`` keeps a SEAL reply as a
    read hint. Runs on the transport's event loop.
    """

    def __init__(
        self,
        control: TcpTransport,
        map_extent: Callable[[ShmExtent], ReaderMapping],
        remember: Callable[[common_pb2.NodeEndpoint, bytes, Frame], None],
    ) -> None:
        self._control = control
        self._map_extent = map_extent
        self._remember = remember
        self._leases: dict[str, ArenaLease] = {}
        self._opening: dict[str, asyncio.Future[ArenaLease | None]] = {}
        self._refused_until: dict[str, float] = {}
        self._slots: dict[str, ArenaSlot] = {}
        self._nodes: dict[str, common_pb2.NodeEndpoint] = {}
        self._ids = itertools.count(1)
        self.opened = 0  # counters for metrics and tests
        self.sealed = 0

    def holds(self, token: str) -> bool:
        return token in self._slots

    async def copy_in(
        self, node: common_pb2.NodeEndpoint, meta: common_pb2.ObjectMeta, payload: Payload
    ) -> str | None:
        """Copy ``payload`` into this writer's arena on ``node``, hashing it on the way (``meta.checksum`` is
        filled in); the slot's token for ``seal``, or None when the put should RESERVE its own extent
        (object too large for an arena, the node cannot grant one, a checksum already declared)."""
        if meta.checksum:
            return None
        lease = self._leases.get(node.node_id)
        offset = lease.take(meta.size) if lease is not None and lease.fits(meta.size) else None
        if offset is None:
            if lease is not None and not lease.fits(meta.size):
                return None
            lease = await self._renew(node, meta.epoch)
            if lease is None or not lease.fits(meta.size):
                return None
            offset = lease.take(meta.size)
            if offset is None:
                return None
        try:
            mapping = self._map_extent(ShmExtent(lease.segment, offset, meta.size))
            meta.checksum = payload.copy_hashing_into(mapping.buf[offset : offset + meta.size])
        except BaseException:
            await self._close_if_done(node, lease)
            raise
        token = f"slot-{next(self._ids)}"
        self._slots[token] = ArenaSlot(lease, offset, meta)
        return token

    async def seal(self, node: common_pb2.NodeEndpoint, token: str, abort: bool = False) -> Frame | None:
        """Publish the slot (the node's SEAL reply) or drop it (None: its bytes go back with the arena).
        A failed SEAL retires the lease (the node may have lost the arena: expired, restarted)."""
        slot = self._slots.pop(token)
        if abort:
            await self._close_if_done(node, slot.lease)
            return None
        header = node_pb2.PutHeader(put_id=slot.lease.token, meta=slot.meta, arena_offset=slot.offset)
        frames = [Frame(OP_SEAL, key=slot.meta.key, aux=header.SerializeToString(), flags=FLAG_ARENA)]
        if slot.lease.release_slot():
            frames.append(_close_frame(slot.lease))
        reply = (await self._control.control(node, frames))[0]
        if isinstance(reply, StoreError):
            await self._retire(node, slot.lease)
            raise reply
        self.sealed += 1
        self._remember(node, slot.meta.key, reply)  # sealed, or FLAG_EXISTS: the copy already there
        return reply

    async def _renew(self, node: common_pb2.NodeEndpoint, epoch: int) -> ArenaLease | None:
        """Open a new arena on ``node`` (one RESERVE; concurrent callers share it), retiring the old one."""
        node_id = node.node_id
        pending = self._opening.get(node_id)
        if pending is not None:
            return await asyncio.shield(pending)
        if self._refused_until.get(node_id, 0.0) > time.monotonic():
            return None
        future: asyncio.Future[ArenaLease | None] = asyncio.get_running_loop().create_future()
        self._opening[node_id] = future
        lease = None
        try:
            lease = await self._open(node, epoch)
        finally:
            del self._opening[node_id]
            future.set_result(lease)
        return lease

    async def _open(self, node: common_pb2.NodeEndpoint, epoch: int) -> ArenaLease | None:
        old = self._leases.pop(node.node_id, None)
        token = f"arena-{secrets.token_hex(8)}"
        want = common_pb2.ObjectMeta(size=ARENA_BYTES, epoch=epoch)
        header = node_pb2.PutHeader(put_id=token, meta=want).SerializeToString()
        frames = [Frame(OP_RESERVE, aux=header, flags=FLAG_ARENA)]
        if old is not None:
            old.retired = True
            if old.outstanding == 0:
                frames.append(_close_frame(old))
        reply = (await self._control.control(node, frames))[0]
        if isinstance(reply, StoreError):  # full, too small, or no shm: plain RESERVEs for a while
            self._refused_until[node.node_id] = time.monotonic() + REFUSED_BACKOFF_S
            return None
        try:
            ext = ShmExtent.unpack(reply.aux)
        except (FrameError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"bad arena reply: {exc}") from exc
        life_s = reply.checksum / 1000 if reply.checksum else USE_S * 6  # the node's reaper deadline
        use_until = time.monotonic() + min(USE_S, life_s / 6)
        lease = ArenaLease(token, ext.segment, ext.offset, ext.size, use_until)
        self._leases[node.node_id] = lease
        self._nodes[node.node_id] = node
        self.opened += 1
        return lease

    async def _retire(self, node: common_pb2.NodeEndpoint, lease: ArenaLease) -> None:
        lease.retired = True
        if self._leases.get(node.node_id) is lease:
            del self._leases[node.node_id]
        if lease.outstanding == 0:
            await self._send_close(node, lease)

    async def _close_if_done(self, node: common_pb2.NodeEndpoint, lease: ArenaLease) -> None:
        if lease.release_slot():
            await self._send_close(node, lease)

    async def _send_close(self, node: common_pb2.NodeEndpoint, lease: ArenaLease) -> None:
        with contextlib.suppress(StoreError):  # else the node's reaper closes it at its deadline
            await self._control.control(node, [_close_frame(lease)])

    async def close(self) -> None:
        """Give every idle lease's unused bytes back (best effort: the node's reaper does it otherwise)."""
        leases, self._leases = self._leases, {}
        for node_id, lease in leases.items():
            lease.retired = True
            if lease.outstanding == 0:
                await self._send_close(self._nodes[node_id], lease)


def _close_frame(lease: ArenaLease) -> Frame:
    return Frame(OP_SEAL, aux=lease.token.encode(), flags=FLAG_ARENA | FLAG_ABORT)
