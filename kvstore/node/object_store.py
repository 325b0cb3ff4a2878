"""What a storage node holds: object table over the shared-memory pool plus the optional SSD tier.

All methods run on the node's single asyncio loop, so the table needs no locks. Reads take a reader count on
the object; a Delete or Demote arriving mid-read defers freeing the extent until the last reader leaves, so a
transfer never streams bytes that were reallocated under it (the master's read-pin lease is the cross-process
guarantee; this is the in-process one). Checksums (xxh3-64) are checked when a put lands and on every read.

Generation stamps (``shm_segment``, in the pool segment): an object gets a slot and a fresh generation when
it becomes readable in DRAM (``_publish``) and loses it the moment it stops being readable (``_retire``:
Delete, Demote, drop, corrupt replace) — before its extent can be freed, and without waiting for tcp/ucx
readers that defer the free — so a same-host reader never trusts a remembered extent of a retired object.

HA fencing (``EpochFence``): with HA on, the master leader holds an etcd lease and its **epoch** is the etcd
revision at which it created the leader key, so every later leader has a larger one. A leader that was paused
(SIGSTOP, a GC stall) or cut off from etcd can wake up believing it still leads; the node is where its word
would turn into deleted or written bytes, so the node keeps the newest epoch it has heard (from RegisterNode
and Heartbeat replies, and from the orders and puts themselves) and refuses anything older with
``StaleEpochError``. Epoch 0 means "no HA" and is never fenced, so single-master clusters are unchanged.

SSD tier layout: ``<stem>.bin`` (the payload) + ``<stem>.meta`` (the serialized ObjectMeta). The ``.meta`` is
renamed into place only after the ``.bin`` is complete, so a torn write never looks like an object, and a
restarted node re-adopts exactly the pairs that are whole (``adopt``). The file name is derived from the key
(``ssd_file_stem``); the real key lives in the ``.meta``, so a name is never parsed back. The file helpers are
plain blocking I/O, called from worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash
from kvpool.kvstore.errors import (
    BadRequestError,
    CapacityExceededError,
    ChecksumMismatchError,
    CorruptObjectError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StaleEpochError,
)
from kvpool.kvstore.node.pool import Extent, SharedPool
from kvpool.kvstore.protocol.data_frame import MAX_KEY
from kvpool.proto import common_pb2

log = logging.getLogger(__name__)
checksum_of = xxhash.xxh3_64_intdigest
STALE_DELETE_WINDOW_S = 10.0
SSD_SUFFIXES = (".meta", ".bin")  # removal order: the .meta first, so a half-removed pair is never adopted


@dataclass
class StoredObject:
    """One object: its meta and where its bytes are (DRAM extent and/or SSD file)."""

    meta: common_pb2.ObjectMeta
    extent: Extent | None = None
    ssd_file: Path | None = None
    readers: int = 0
    doomed: bool = False  # deleted while being read: free when the last reader leaves
    demoted: bool = False  # moved to SSD while being read: free the extent when the last reader leaves
    busy: bool = False  # an SSD write or read of it is running in a worker thread
    slot: int = 0  # stamp slot in the pool segment; meaningful only while generation != 0
    generation: int = 0  # 0 = no stamp (not in DRAM, retired, or no free slot): shm readers LOCATE
    # master shards that hold this object (docs/design/sharding.md §2): keys are content hashes, so when a
    # chain's blocks are put by two shards (a short chain routed by its own last block, extended later) the
    # bytes are one copy owned by both; each shard's orders act on its ownership, the bytes go with the last
    owners: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.owners:
            self.owners.add(self.meta.shard)


@dataclass
class PendingPut:
    """An extent reserved for a put whose bytes are still arriving."""

    put_id: str
    meta: common_pb2.ObjectMeta
    extent: Extent
    deadline: float = field(default=0.0)
    # xxh3-64 of the bytes as they landed, computed chunk by chunk by the receiver (tcp) while each chunk
    # was still in cache; None = finish_put hashes the whole extent itself
    landed_checksum: int | None = None


class ObjectStore:
    """Object table of one node. ``max_object`` caps a single object (default: the pool capacity)."""

    def __init__(
        self,
        pool: SharedPool,
        ssd_path: Path | None = None,
        ssd_capacity: int = 0,
        max_object: int | None = None,
    ) -> None:
        self.pool = pool
        self.objects: dict[bytes, StoredObject] = {}
        self.pending: dict[str, PendingPut] = {}
        self.max_object = max_object or pool.capacity
        self.ssd_path = ssd_path
        self.ssd_capacity = ssd_capacity if ssd_path else 0
        self.ssd_used = 0
        self.counters: dict[str, int] = {}
        # Promote SSD objects on read. Off when a master manages the tiers: it promotes in its index on
        # acquire and orders Promote; a node promoting on its own would use DRAM the master does not count.
        self.auto_promote = True
        self._stale_deletes: dict[bytes, float] = {}  # key -> until when a Delete targets a replaced copy
        # HA: puts and orders of deposed master leaders are refused; one fence per master shard (each shard
        # is its own HA group, and etcd revisions of different groups are not comparable)
        self.fences: dict[int, EpochFence] = {0: EpochFence()}
        if ssd_path is not None:
            ssd_path.mkdir(parents=True, exist_ok=True)
            self._load_ssd()

    # --- bookkeeping -------------------------------------------------------------------------------------
    def fence_of(self, shard: int) -> EpochFence:
        fence = self.fences.get(shard)
        if fence is None:
            fence = self.fences[shard] = EpochFence()
        return fence

    def fenced(self, epoch: int, what: str, shard: int = 0) -> None:
        """Pass ``epoch`` through shard ``shard``'s HA fence (counted and raised as ``StaleEpochError`` when
        stale)."""
        try:
            self.fence_of(shard).check(epoch, what)
        except StaleEpochError:
            self.count("stale_epoch_refused")
            raise

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _publish(self, obj: StoredObject) -> None:
        """Stamp an object whose DRAM bytes are complete and verified (readers may now skip LOCATE)."""
        if obj.extent is None or obj.generation:
            return
        obj.slot, obj.generation = self.pool.stamps.stamp(obj.extent.offset, obj.meta.size, obj.meta.checksum)
        if not obj.generation:
            self.count("stamps_exhausted")

    def _retire(self, obj: StoredObject) -> None:
        """Clear the object's stamp: from now on shm readers must LOCATE (call before freeing the extent)."""
        if obj.generation:
            self.pool.stamps.clear(obj.slot, obj.generation)
            obj.generation = 0

    def inventory(self, shard: int | None = None) -> list[common_pb2.ObjectMeta]:
        """What this node holds; with ``shard``, only what that master shard owns (what it may adopt)."""
        return [
            obj.meta
            for obj in self.objects.values()
            if not obj.doomed and (shard is None or shard in obj.owners)
        ]

    def _owned(self, key: bytes, shard: int) -> StoredObject | None:
        """The live object ``key`` if master shard ``shard`` owns it (else counted and None)."""
        obj = self.objects.get(key)
        if obj is None or obj.doomed:
            return None
        if shard not in obj.owners:
            self.count("orders_for_other_shards")
            return None
        return obj

    # --- puts --------------------------------------------------------------------------------------------
    def begin_put(self, put_id: str, meta: common_pb2.ObjectMeta) -> PendingPut | None:
        """Reserve space for ``meta``; None when the same object is already here (duplicate put = no-op)."""
        if not self._admit(meta):
            return None
        extent = self.pool.allocator.allocate(meta.size)
        pending = PendingPut(put_id, common_pb2.ObjectMeta(), extent)
        pending.meta.CopyFrom(meta)
        pending.meta.tier = common_pb2.DRAM
        return pending

    def _admit(self, meta: common_pb2.ObjectMeta) -> bool:
        """Checks every put passes before it may take space; False for a duplicate (a no-op success)."""
        if not meta.key or len(meta.key) > MAX_KEY:
            raise BadRequestError(f"key must be 1..{MAX_KEY} bytes, got {len(meta.key)}")
        self.fenced(meta.epoch, "put", meta.shard)
        if meta.size > self.max_object:
            raise ObjectTooLargeError(
                f"object of {meta.size} B exceeds the node's limit of {self.max_object} B"
            )
        existing = self.objects.get(meta.key)
        if existing is not None and not existing.doomed:
            # checksum 0: declared at SEAL (a same-host writer hashes while copying); same key, same size
            differs = meta.checksum and existing.meta.checksum != meta.checksum
            if differs or existing.meta.size != meta.size:
                raise ObjectExistsError(f"key {meta.key[:8].hex()}… already holds a different object")
            if self._intact(existing):
                self.count("puts_duplicate")
                if meta.shard not in existing.owners:  # the same bytes, now held for this shard too
                    existing.owners.add(meta.shard)
                    self.count("puts_shared_between_shards")
                return False
            self.count("puts_replacing_corrupt")  # damaged copy (a reader re-puts it): take the new one
            self._remove(existing)
            # the master's Delete of the damaged copy may still be in flight: it must not hit the new copy
            self._stale_deletes[meta.key] = time.monotonic() + STALE_DELETE_WINDOW_S
        return True

    def _intact(self, obj: StoredObject) -> bool:
        if obj.extent is not None:
            return checksum_of(self.pool.view(obj.extent)) == obj.meta.checksum
        return obj.ssd_file is not None and obj.ssd_file.exists()  # verified when it is read back

    def finish_put(self, pending: PendingPut) -> None:
        """Verify the landed bytes against the declared checksum and publish the object (the receiver's
        ``pending.landed_checksum`` when it hashed the bytes as they arrived, else the whole extent)."""
        got = pending.landed_checksum
        if got is None:
            got = checksum_of(self.pool.view(pending.extent))
        if got != pending.meta.checksum:
            self.pool.allocator.free(pending.extent)
            self.count("puts_checksum_rejected")
            raise ChecksumMismatchError(
                f"payload hashes to {got:#x}, the put declared {pending.meta.checksum:#x}"
            )
        existing = self.objects.get(pending.meta.key)
        if existing is not None and not existing.doomed:  # a concurrent duplicate won the race
            self.pool.allocator.free(pending.extent)
            self.count("puts_duplicate")
            existing.owners.add(pending.meta.shard)
            return
        obj = StoredObject(pending.meta, pending.extent)
        self.objects[pending.meta.key] = obj
        self._publish(obj)
        self.count("puts")
        self.count("bytes_in", pending.meta.size)

    def abort_put(self, pending: PendingPut) -> None:
        self.pool.allocator.free(pending.extent)
        self.count("puts_aborted")

    # --- reads -------------------------------------------------------------------------------------------
    async def acquire(self, key: bytes) -> StoredObject:
        """Take a reader reference; an SSD-only object is first promoted to DRAM when space allows (and
        ``auto_promote``), else it is read from its file."""
        obj = self.objects.get(key)
        if obj is None or obj.doomed:
            raise ObjectNotFoundError(f"key {key[:8].hex()}… not on this node")
        obj.readers += 1
        try:
            if obj.extent is None and self.auto_promote:
                await self._promote(obj, required=False)
        except BaseException:
            self.release(obj)
            raise
        return obj

    async def locate(self, key: bytes) -> Extent:
        """The object's DRAM extent for a same-host reader (promoting an SSD-only object first).

        ``ObjectNotFoundError`` when absent or when no DRAM extent can be had for it right now.
        """
        obj = await self.acquire(key)
        try:
            if obj.extent is None:  # shm readers need DRAM: promote even when the master manages tiers
                await self._promote(obj, required=False)
            if obj.extent is None:
                raise ObjectNotFoundError(f"key {key[:8].hex()}… is on SSD only and DRAM is full")
            self._publish(obj)  # an object that found no free stamp slot earlier may get one now
            self.count("locates")
            return obj.extent
        finally:
            self.release(obj)

    def release(self, obj: StoredObject) -> None:
        obj.readers -= 1
        if obj.readers == 0:
            if obj.doomed:
                self._drop(obj)
            elif obj.demoted and obj.extent is not None:
                self._retire(obj)  # already done by demote(); the extent must never be freed stamped
                self.pool.allocator.free(obj.extent)
                obj.extent = None
                obj.demoted = False

    async def read(self, obj: StoredObject, verify: bool = True) -> memoryview | bytes:
        """The object's bytes, verified: a view of its extent, or the SSD file's bytes (read off the loop)
        when it could not be promoted. The caller holds a reader reference (``acquire``). ``verify=False``:
        the caller hashes the bytes chunk by chunk as it sends them (tcp) and reports a mismatch itself."""
        if obj.extent is not None:
            data: memoryview | bytes = self.pool.view(obj.extent)
        else:
            assert obj.ssd_file is not None
            data = await asyncio.to_thread(obj.ssd_file.read_bytes)
        if verify and checksum_of(data) != obj.meta.checksum:
            self.count("reads_corrupt")
            raise CorruptObjectError(f"key {obj.meta.key[:8].hex()}… failed its checksum on the node")
        self.count("gets")
        self.count("bytes_out", obj.meta.size)
        return data

    # --- lifecycle (master-driven) -----------------------------------------------------------------------
    def delete(self, keys: list[bytes], shard: int = 0) -> tuple[int, list[bytes]]:
        """Master shard ``shard`` lets go of ``keys``; an object goes when no shard holds it any more."""
        done, missing = 0, []
        now = time.monotonic()
        for key in keys:
            if self._stale_deletes.pop(key, 0.0) > now:
                self.count("deletes_of_replaced_copy")
                done += 1
                continue
            obj = self._owned(key, shard)
            if obj is None:
                missing.append(key)
                continue
            done += 1
            obj.owners.discard(shard)
            if not obj.owners:  # else another shard still holds these bytes
                self._remove(obj)
        self.count("deletes", done)
        return done, missing

    def _remove(self, obj: StoredObject) -> None:
        """Take the object away now for every reader that comes (its bytes go when the last one leaves)."""
        self._retire(obj)  # shm readers stop at once, even while tcp/ucx readers defer the free
        if obj.readers:
            obj.doomed = True
        else:
            self._drop(obj)

    def _drop(self, obj: StoredObject) -> None:
        self._retire(obj)
        if self.objects.get(obj.meta.key) is obj:
            del self.objects[obj.meta.key]
        if obj.extent is not None:
            self.pool.allocator.free(obj.extent)
            obj.extent = None
        if obj.ssd_file is not None:
            self._remove_ssd_file(obj)

    async def demote(self, keys: list[bytes], shard: int = 0) -> tuple[int, list[bytes]]:
        """Move DRAM objects to the SSD tier and free their extents; keys not moved are reported missing.

        File writes run in a worker thread so the data plane keeps serving during a large demotion; the
        object keeps a reader reference meanwhile, so its extent cannot be freed under the writer. An
        object two shards hold is not moved for one of them (reported missing: that shard drops it).
        """
        done, missing = 0, []
        for key in keys:
            obj = self._owned(key, shard)
            if obj is None or len(obj.owners) > 1 or self.ssd_path is None or obj.busy:
                missing.append(key)
                continue
            if obj.ssd_file is None:
                if obj.extent is None or self.ssd_used + obj.meta.size > self.ssd_capacity:
                    missing.append(key)
                    continue
                if not await self._write_ssd(obj):
                    missing.append(key)
                    continue
            if obj.extent is not None:
                self._retire(obj)  # readers of the DRAM copy stop now, even if a send defers the free
                if obj.readers:
                    obj.demoted = True
                else:
                    self.pool.allocator.free(obj.extent)
                    obj.extent = None
            obj.meta.tier = common_pb2.SSD
            done += 1
        self.count("demotes", done)
        return done, missing

    async def promote(self, keys: list[bytes], shard: int = 0) -> tuple[int, list[bytes]]:
        done, missing = 0, []
        for key in keys:
            obj = self._owned(key, shard)
            if obj is None:
                missing.append(key)
                continue
            obj.readers += 1
            try:
                await self._promote(obj, required=True)
            except CapacityExceededError:
                missing.append(key)
                continue
            finally:
                self.release(obj)
            if obj.extent is None:  # another promotion of it was in flight
                missing.append(key)
                continue
            done += 1
        return done, missing

    async def _promote(self, obj: StoredObject, required: bool) -> None:
        """Bring an SSD object into DRAM (file read in a thread). Caller holds a reader reference."""
        if obj.extent is not None:
            obj.demoted = False  # demoted while being sent: the extent is still ours, readable again
            obj.meta.tier = common_pb2.DRAM
            self._publish(obj)
            return
        if obj.busy:
            return  # a promotion or demotion of it is in flight: serve from the file this time
        try:
            extent = self.pool.allocator.allocate(obj.meta.size)
        except CapacityExceededError:
            if required:
                raise
            return  # served from SSD this time
        assert obj.ssd_file is not None
        view = self.pool.view(extent)
        obj.busy = True
        try:
            n = await asyncio.to_thread(read_file_into, obj.ssd_file, view)
        except OSError as exc:
            self.pool.allocator.free(extent)
            raise CorruptObjectError(f"SSD copy of {obj.meta.key[:8].hex()}… unreadable: {exc}") from exc
        finally:
            obj.busy = False
        if n != obj.meta.size or checksum_of(view) != obj.meta.checksum:
            self.pool.allocator.free(extent)
            self.count("reads_corrupt")
            raise CorruptObjectError(f"SSD copy of {obj.meta.key[:8].hex()}… is damaged")
        obj.extent = extent
        obj.meta.tier = common_pb2.DRAM
        self._remove_ssd_file(obj)
        self._publish(obj)
        self.count("promotes")

    # --- SSD tier (file layout in the module docstring: a restarted node re-adopts it) --------------------
    async def _write_ssd(self, obj: StoredObject) -> bool:
        """Write the object's files in a thread; False if it was deleted meanwhile or the write failed."""
        assert self.ssd_path is not None and obj.extent is not None
        base = self.ssd_path / ssd_file_stem(obj.meta.key)
        meta = common_pb2.ObjectMeta()
        meta.CopyFrom(obj.meta)
        meta.tier = common_pb2.SSD
        self.ssd_used += obj.meta.size  # reserved while writing
        obj.readers += 1
        obj.busy = True
        try:
            await asyncio.to_thread(write_files, base, self.pool.view(obj.extent), meta.SerializeToString())
            ok = True
        except OSError:
            ok = False
        finally:
            obj.busy = False
            gone = obj.doomed or self.objects.get(obj.meta.key) is not obj
            self.release(obj)
        if not ok or gone:
            self.ssd_used -= obj.meta.size
            remove_files(base)
            return False
        obj.ssd_file = base.with_suffix(".bin")
        return True

    def _remove_ssd_file(self, obj: StoredObject) -> None:
        assert obj.ssd_file is not None
        remove_files(obj.ssd_file)
        self.ssd_used -= obj.meta.size
        obj.ssd_file = None

    def _load_ssd(self) -> None:
        assert self.ssd_path is not None
        for meta, data_file in adopt(self.ssd_path):
            self.objects[meta.key] = StoredObject(meta, None, data_file)
            self.ssd_used += meta.size
        self.count("ssd_adopted", len(self.objects))

    # --- shm puts: reservations live until sealed or their deadline -----------------------------------------
    def reserve(self, put_id: str, meta: common_pb2.ObjectMeta, ttl_s: float) -> PendingPut | None:
        if put_id in self.pending:
            raise BadRequestError(f"put {put_id} already reserved")
        pending = self.begin_put(put_id, meta)
        if pending is not None:
            pending.deadline = time.monotonic() + ttl_s
            self.pending[put_id] = pending
        return pending

    def seal(self, put_id: str, abort: bool, checksum: int = 0) -> None:
        """Publish (or abort) a reservation. A reservation made without a checksum takes the one SEAL
        declares: the same-host writer hashed the bytes in this pool as it wrote them
        (``Payload.copy_hashing_into``), so hashing them again here would be a second pass that proves
        nothing more; every reader verifies it.
        A reservation that declared one is verified against the bytes as before."""
        pending = self.pending.get(put_id)
        if pending is None:
            raise ObjectNotFoundError(f"no reservation {put_id} (expired or never made)")
        if not abort and not pending.meta.checksum:
            if not checksum:
                raise BadRequestError(f"reservation {put_id} left its checksum to SEAL, which has none")
            pending.meta.checksum = pending.landed_checksum = checksum
            self.count("puts_checksum_at_seal")
        del self.pending[put_id]
        if abort:
            self.abort_put(pending)
        else:
            self.finish_put(pending)

    def reap_reservations(self) -> int:
        """Free reservations whose writer vanished before sealing (their extents would leak)."""
        now = time.monotonic()
        stale = [pid for pid, p in self.pending.items() if p.deadline < now]
        for pid in stale:
            self.abort_put(self.pending.pop(pid))
        return len(stale)


class EpochFence:
    """The newest leader epoch this node has seen, and the check every master-ordered action passes."""

    __slots__ = ("epoch", "refused")

    def __init__(self) -> None:
        self.epoch = 0
        self.refused = 0

    def observe(self, epoch: int) -> None:
        """A leader with ``epoch`` spoke to this node (a reply to our RegisterNode/Heartbeat, or an order)."""
        if epoch > self.epoch:
            if self.epoch:
                log.info(
                    "leader epoch %d -> %d: orders and puts of older leaders are refused", self.epoch, epoch
                )
            self.epoch = epoch

    def check(self, epoch: int, what: str) -> None:
        """Raise ``StaleEpochError`` if ``epoch`` is older than the newest seen; else remember it."""
        if epoch and epoch < self.epoch:
            self.refused += 1
            log.warning("refused %s from a deposed leader (epoch %d < %d)", what, epoch, self.epoch)
            raise StaleEpochError(f"{what} carries leader epoch {epoch}, older than {self.epoch}: refused")
        self.observe(epoch)


def ssd_file_stem(key: bytes) -> str:
    """File name of a key's SSD copy: its hex when short, else a 160-bit digest (names are capped at 255
    bytes; keys at 1024). The ``.meta`` file holds the real key, so the name is never parsed back."""
    if len(key) <= 100:
        return key.hex()
    return "h" + hashlib.blake2b(key, digest_size=20).hexdigest()


def write_files(base: Path, data: memoryview, meta: bytes) -> None:
    """``.bin`` first, then the ``.meta`` renamed into place: a torn write never looks like an object."""
    with base.with_suffix(".bin").open("wb") as f:
        f.write(data)
    tmp = base.with_suffix(".meta.tmp")
    tmp.write_bytes(meta)
    os.replace(tmp, base.with_suffix(".meta"))


def remove_files(base: Path) -> None:
    for suffix in SSD_SUFFIXES:
        base.with_suffix(suffix).unlink(missing_ok=True)


def read_file_into(path: Path, view: memoryview) -> int:
    with path.open("rb") as f:
        return f.readinto(view)


def adopt(directory: Path) -> Iterator[tuple[common_pb2.ObjectMeta, Path]]:
    """Every complete pair in ``directory``: its meta (tier SSD) and its data file. A torn or unreadable
    ``.meta``, or a ``.bin`` of the wrong size, is skipped: that object is simply not adopted."""
    for meta_file in sorted(directory.glob("*.meta")):
        data_file = meta_file.with_suffix(".bin")
        meta = common_pb2.ObjectMeta()
        try:
            meta.ParseFromString(meta_file.read_bytes())
        except Exception:
            continue
        if not data_file.exists() or data_file.stat().st_size != meta.size:
            continue
        meta.tier = common_pb2.SSD
        yield meta, data_file
