"""Read hints of the shm transport: where a same-host reader last saw each object, checked by its stamp.

Why: a 4 MB shm get was LOCATE (a round trip) + copy + verify, though the reader usually knew the extent
from the last time and only needed "is it still that object?". The node answers that in shared memory: its
stamp table (``shm_stamps``). A hint per (node, key) — filled from LOCATE / SEAL / EXISTS replies — lets
``read`` copy the object with no message at all, and never return bytes of an object that was deleted,
demoted or replaced (the ordering argument is in ``shm_stamps``).

Bounded LRU (``HINTS_MAX``, ~200 B each). ``read`` is plain synchronous code callable from any thread: its
lookup takes no lock; writes of the table take a small one.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import xxhash
from kvpool.kvstore.protocol import shm_stamps
from kvpool.kvstore.protocol.data_frame import ShmExtent
from kvpool.kvstore.protocol.shm_segment import ReaderMapping
from kvpool.kvstore.protocol.shm_stamps import StampReader
from kvpool.kvstore.transport.payload import Buffer, as_bytes_view
from kvpool.proto import common_pb2

HINTS_MAX = 16_384  # same bound as the client's location cache; ~200 B each
_hash = xxhash.xxh3_64_intdigest


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


class ReadHints:
    """The hint table. Counters: ``hits`` (served by ``read``), ``misses`` (no hint), ``stale`` (hint
    dropped: stamp changed, node gone, checksum/size mismatch)."""

    def __init__(self, capacity: int = HINTS_MAX) -> None:
        self._hints: OrderedDict[tuple[str, bytes], ReadHint] = OrderedDict()
        self._lock = threading.Lock()  # writers only; read's lookup takes no lock
        self._capacity = capacity
        self.hits = 0
        self.misses = 0
        self.stale = 0

    def __len__(self) -> int:
        return len(self._hints)

    def get(self, node_id: str, key: bytes) -> ReadHint | None:
        return self._hints.get((node_id, key))

    def remember(
        self, node_id: str, key: bytes, mapping: ReaderMapping | None, ext: ShmExtent, checksum: int
    ) -> None:
        """Keep a stamped extent of ``mapping`` as the hint for ``key``; an unstamped one drops the old."""
        if not ext.generation or mapping is None or mapping.stamps is None:
            self.forget(node_id, key)
            return
        hint = ReadHint(mapping, mapping.stamps, ext.offset, ext.size, ext.slot, ext.generation, checksum)
        with self._lock:
            self._hints[(node_id, key)] = hint
            self._hints.move_to_end((node_id, key))
            while len(self._hints) > self._capacity:
                self._hints.popitem(last=False)

    def forget(self, node_id: str, key: bytes) -> None:
        with self._lock:
            self._hints.pop((node_id, key), None)

    def clear(self) -> None:
        with self._lock:
            self._hints.clear()

    def _drop(self, hint_key: tuple[str, bytes], hint: ReadHint) -> None:
        self.stale += 1
        with self._lock:
            if self._hints.get(hint_key) is hint:  # not a fresher one a LOCATE put there meanwhile
                del self._hints[hint_key]

    def read(
        self, node: common_pb2.NodeEndpoint, key: bytes, checksum: int, size: int, out: Buffer
    ) -> int | None:
        """Copy a remembered object into ``out``; None = no usable hint (take the LOCATE path).

        The bytes are returned only if the node's stamp for the object holds the remembered generation
        before and after the copy (the object was readable for the whole copy, see ``shm_stamps``) and the
        copy hashes to ``checksum``. A mismatch is not a ``CorruptObjectError``: the object may have been
        legitimately deleted or replaced; the hint is dropped and None returned. On None, ``out``'s
        contents are unspecified.
        """
        if not shm_stamps.READS_TRUSTED:
            return None
        hint_key = (node.node_id, key)
        hint = self._hints.get(hint_key)
        if hint is None:
            self.misses += 1
            return None
        moved = bool(node.shm_name) and node.shm_name != hint.mapping.name  # a restarted node's new segment
        if hint.checksum != checksum or hint.size != size or moved:
            self._drop(hint_key, hint)
            return None
        view = as_bytes_view(out)
        if len(view) < size:
            return None  # the regular path reports the small buffer
        stamps, slot, generation = hint.stamps, hint.slot, hint.generation
        if (
            stamps.generation(slot) != generation
            or stamps.fields(slot) != (hint.offset, size, checksum)
            or hint.mapping.unlinked()
        ):
            self._drop(hint_key, hint)
            return None
        dst = view[:size] if len(view) != size else view
        try:
            dst[:] = hint.mapping.buf[hint.offset : hint.offset + size]
        except ValueError:  # the mapping was closed under us (transport closing)
            self._drop(hint_key, hint)
            return None
        # second load after every copy load: G still there => the copy read only the object given G
        if stamps.generation(slot) != generation or _hash(dst) != checksum:
            self._drop(hint_key, hint)
            return None
        with contextlib.suppress(KeyError):  # LRU order; a concurrent eviction may have removed it
            self._hints.move_to_end(hint_key)
        self.hits += 1
        return size
