"""Worker side of the connector's saves: off the engine step, bounded, and never a reason to wait.

The step only copies its new objects' blocks out of vLLM's paged KV (``PagedKV.gather``: one copy into
host tensors recycled from earlier saves, and the blocks may be freed or rewritten as soon as the step
returns) and queues them; a background thread hashes
and encodes each object and puts a step's objects in one ``batch_put``. The queue is bounded in bytes
(``max_bytes``): a step whose objects do not fit is dropped and counted (``saves_dropped``) instead of
making the engine wait for a slow or dead store, and a dropped save is only a future miss. ``close`` lets
the thread drain the queue until a deadline, then abandons (and counts) what is left.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvpool.integrations.vllm.chunks import GroupLayout
from kvpool.integrations.vllm.codec import Part, encode
from kvpool.integrations.vllm.metrics import ConnectorStats
from kvpool.integrations.vllm.paged import PagedKV
from kvpool.integrations.vllm.plan import Transfer
from kvpool.kvstore.client.async_client import PutItem
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import ObjectNotAdmittedError, StoreError
from kvpool.kvstore.transport.base import Payload

log = logging.getLogger("kvpool.vllm")


@dataclass(slots=True)
class _Copied:
    """One object's blocks, copied out of the paged KV by the step that completed it."""

    transfer: Transfer
    parts: list[Part]
    payload: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class Saver:
    """The background sender of one worker."""

    def __init__(
        self,
        store: StoreClient,
        paged: PagedKV,
        fp: bytes,
        groups: Sequence[GroupLayout],
        stats: ConnectorStats,
        max_bytes: int,
    ) -> None:
        self.store, self.paged, self.fp, self.groups, self.stats = store, paged, fp, list(groups), stats
        self.max_bytes = max_bytes
        self._queue: queue.Queue[list[_Copied] | None] = queue.Queue()
        self._queued_bytes = 0
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self._abandon = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-vllm-saver", daemon=True)
        self._thread.start()

    def submit(self, transfers: Sequence[Transfer]) -> None:
        """On the step: copy the objects' blocks out and queue them, or drop them if the queue is full."""
        layers = [[self.groups[g].layer_names for g in tr.groups] for tr in transfers]
        parts = [self.paged.parts(ls, tr.blocks) for ls, tr in zip(layers, transfers, strict=True)]
        size = sum(p.nbytes for ps in parts for p in ps)
        with self._lock:
            fits = self._queued_bytes + size <= self.max_bytes and not self._abandon.is_set()
            if fits:
                self._queued_bytes += size
        if not fits:
            self.stats.add("saves_dropped", len(transfers))
            log.warning(
                "kvpool save queue full (%d B queued, %d B more): %d objects dropped",
                self._queued_bytes,
                size,
                len(transfers),
            )
            return
        self._queue.put(
            [
                _Copied(tr, ps, self.paged.gather(ls, tr.blocks, self._staging))
                for tr, ls, ps in zip(transfers, layers, parts, strict=True)
            ]
        )

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if self._abandon.is_set():
                    self.stats.add("saves_dropped", len(job))
                else:
                    self._put(job)
            except Exception:  # the sender must outlive any one batch
                log.exception("kvpool save of %d objects failed", len(job))
                self.stats.add("save_errors", len(job))
            finally:
                with self._lock:
                    self._queued_bytes -= sum(c.nbytes for c in job)
                    for c in job:  # sent (or given up): the copies can take the next step's blocks
                        for buf in c.payload:
                            self._recycle(buf)

    def _staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for one part of a step's copy: a recycled one of that shape, else a new one."""
        with self._lock:
            free = self._free.get((shape, dtype))
            if free:
                buf = free.pop()
                self._free_bytes -= buf.nbytes
                return buf
        return torch.empty(shape, dtype=dtype)

    def _recycle(self, buf: torch.Tensor) -> None:
        """Keep a sent copy's tensor for reuse, up to ``max_bytes`` of them (called under the lock)."""
        if self._free_bytes + buf.nbytes <= self.max_bytes:
            self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)
            self._free_bytes += buf.nbytes

    def _put(self, job: list[_Copied]) -> None:
        items = [
            PutItem(
                c.transfer.key,
                Payload(encode(self.fp, c.transfer.kind, c.parts, [_bytes_of(t) for t in c.payload])),
                kind=c.transfer.kind,
                parent=c.transfer.parent,
                route=c.transfer.route,
            )
            for c in job
        ]
        try:
            results = self.store.batch_put(items)
        except StoreError as exc:
            results = [exc] * len(items)
        for item, err in zip(items, results, strict=True):
            if err is None:
                self.stats.add("saved_objects")
                self.stats.add("saved_bytes", item.nbytes)
            elif isinstance(err, ObjectNotAdmittedError):
                self.stats.add("not_admitted")
            else:
                self.stats.add("save_errors")
                log.warning("kvpool save of %s failed: %s", item.key[:9].hex(), err)

    def close(self, deadline_s: float) -> bool:
        """Drain the queue for at most ``deadline_s``, then abandon what is left (counted as dropped);
        True when everything queued was sent."""
        self._queue.put(None)
        self._thread.join(deadline_s)
        if not self._thread.is_alive():
            return True
        self._abandon.set()  # the batch in flight ends within the store's deadline; the rest is dropped
        t0 = time.monotonic()
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if job:
                self.stats.add("saves_dropped", len(job))
        self._queue.put(None)  # the thread stops after its batch in flight
        log.warning("kvpool saves abandoned at shutdown after %.1f s", deadline_s + time.monotonic() - t0)
        return False


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes, flat (the codec counts parts in bytes)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
