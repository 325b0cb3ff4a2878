"""``KvpoolL2Adapter``: LMCache's L2 tier (multiprocess mode) over kvpool's store.

LMCache's cache server keeps chunks of KV cache in its L1 (host memory) and hands what it stores, looks up
and loads past L1 to its L2 adapters. This one is loaded by LMCache's plugin loader::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvpool.integrations.lmcache.l2_adapter", "class_name": "KvpoolL2Adapter",
        "adapter_params": {"master": "HOST:PORT", "salt": "", "tenant": null, "transport": "auto",
                           "deadline_s": 5, "connect_timeout_s": 5, "workers": 4}}'

Every chunk object is one store object (``keys.store_key``), its bytes exactly as LMCache's L1 holds them.

- **store**: one ``batch_put`` per task (PutStartBatch, one stream per node, PutCommitBatch); a chunk the
  store holds already answers EXISTS (nothing moves). LMCache reports store results per task: the task
  fails if any chunk was not stored.
- **lookup and lock**: one Lookup that read-pins what it finds under a lease (the master does not evict them
  while it lasts); the locations are kept, so the load is the data plane alone. LMCache locks a chunk once
  per request and unlocks it once per request: each lock is a hold, and a lease is released once none of
  its holds is left (a lost release only lets the lease run to its deadline).
- **load**: each chunk straight into the buffer LMCache gives, checked against the store's checksum on the
  way (``fetch_into``); a chunk of another size, a damaged one or one gone since the lookup is a failed bit.

LMCache waits on the adapter's event fds with no deadline, so every task ends: any failure, of the store or
of what LMCache handed over, is a miss (a zero bit, a failed store task) and a counter, never an exception
in LMCache's controller threads, and every store call is bounded by ``deadline_s``. A bad field of
``adapter_params`` or a master that does not answer stops the server at start (``LMCacheConfigError``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvpool.integrations.lmcache.keys import store_key
from kvpool.integrations.miss_tally import MissTally
from kvpool.integrations.store_config import FIELDS as STORE_FIELDS
from kvpool.integrations.store_config import StoreConfig, connect, parse_store_config
from kvpool.kvstore.client.async_client import PutItem
from kvpool.kvstore.errors import StoreError
from kvpool.proto import common_pb2
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

log = logging.getLogger(__name__)
_WARN_EVERY_S = 30.0
# the adapter's own field, beside the store's (``store_config.FIELDS``)
FIELDS = {**STORE_FIELDS, "workers": "threads that run the adapter's tasks (1 to 64); default 4"}


class LMCacheConfigError(ValueError):
    """A field of the adapter's ``adapter_params`` is missing, of the wrong type or unusable; names it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"kvpool LMCache L2 adapter: adapter_params field {field!r}: {why}")
        self.field = field


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    store: StoreConfig
    workers: int = 4


def parse_config(params: Any) -> AdapterConfig:
    """``adapter_params`` (the dict LMCache parsed, or JSON text): the store's fields and ``workers``."""
    store = parse_store_config(params, LMCacheConfigError, "adapter_params")
    workers = params.get("workers", 4) if isinstance(params, dict) else 4
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
        raise LMCacheConfigError("workers", f"must be an integer from 1 to 64, got {workers!r}")
    return AdapterConfig(store, workers)


@dataclass(slots=True)
class _Held:
    """One lock LMCache holds on a chunk: where the chunk is, the lease that pins it, and until when (the
    master's lease ends then, unlocked or not)."""

    location: common_pb2.ObjectLocation
    lease_id: str
    until: float


# LMCache's lock of a chunk outlives no lease: past this, a hold is forgotten (the master dropped the lease)
HOLD_S = 10.0
# a result LMCache never collects (an aborted prefetch) is dropped after this
RESULT_S = 120.0


class KvpoolL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over kvpool (see the module docstring). Thread-safe: LMCache's store and
    prefetch controllers call it from two threads; its tasks run on ``workers`` threads of its own."""

    def __init__(self, params: Any, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)  # the store evicts by its own policy, not LMCache's
        self.config = parse_config(params)
        self.store, _ = connect(self.config.store, LMCacheConfigError)
        self._salt = self.config.store.salt
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stored: dict[int, tuple[float, L2StoreResult]] = {}
        self._looked_up: dict[int, tuple[float, Bitmap]] = {}
        self._loaded: dict[int, tuple[float, Bitmap]] = {}
        # LMCache locks a chunk once per request that looked it up, and unlocks it once per request: the
        # holds of a key, oldest first; a lease is released when none of its holds is left
        self._held: dict[bytes, list[_Held]] = {}
        self._lease_holds: dict[str, int] = {}
        self.tally = MissTally(log, _WARN_EVERY_S)
        self._events = [create_event_notifier() for _ in range(3)]  # store, lookup, load
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="kvpool-l2")

    # ------------------------------------------------------------------ event fds

    def get_store_event_fd(self) -> int:
        return self._events[0].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._events[1].fileno()

    def get_load_event_fd(self) -> int:
        return self._events[2].fileno()

    # ------------------------------------------------------------------ store

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = next(self._ids)
        self._run(task, self._store, (keys, objects), "_stored", L2StoreResult(False, 0), 0)
        return task

    def _store(self, keys: list[Any], objects: list[Any]) -> L2StoreResult:
        items = [
            PutItem(store_key(k, self._salt), _bytes_of(o), kind=common_pb2.BLOB)
            for k, o in zip(keys, objects, strict=True)
        ]
        errors = self.store.batch_put(items)
        stored = [(k, item.nbytes) for k, item, err in zip(keys, items, errors, strict=True) if err is None]
        self.tally.put_errors(errors, "store", "kvpool LMCache store")
        if stored:
            self._notify_keys_stored([k for k, _ in stored], [n for _, n in stored])
        nbytes = sum(n for _, n in stored)
        self.tally.count("chunks_stored", len(stored))
        return L2StoreResult(len(stored) == len(items), nbytes)

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stored = self._stored, {}
        return {task: result for task, (_, result) in done.items()}

    # ------------------------------------------------------------------ lookup and lock

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        task = next(self._ids)
        self._run(task, self._lookup, (keys,), "_looked_up", Bitmap(len(keys)), 1)
        return task

    def _lookup(self, keys: list[Any]) -> Bitmap:
        wanted = [store_key(k, self._salt) for k in keys]
        reply = self.store.lookup(wanted, acquire=True)
        found = {loc.meta.key: loc for loc in reply.found}
        hits = Bitmap(len(keys))
        until = time.monotonic() + HOLD_S
        holds = 0
        with self._lock:
            for i, key in enumerate(wanted):
                loc = found.get(key)
                if loc is None:
                    continue
                hits.set(i)
                self._held.setdefault(key, []).append(_Held(loc, reply.lease_id, until))
                holds += 1
            if reply.lease_id and holds:
                self._lease_holds[reply.lease_id] = holds
        if reply.lease_id and not holds:
            self.store.release(reply.lease_id)
        self.tally.count("lookups")
        self.tally.count("chunks_found", holds)
        return hits

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        return self._collect(self._looked_up, task_id)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Drop one hold of each of ``keys`` (LMCache unlocks once per lock); a lease none of whose holds is
        left is released, off LMCache's thread."""
        done: list[str] = []
        now = time.monotonic()
        with self._lock:
            for k in keys:
                try:
                    key = store_key(k, self._salt)
                except Exception:  # a key LMCache never looked up through us: nothing is held
                    continue
                holds = self._held.get(key)
                if not holds:
                    continue
                lease = self._drop_hold(key, holds, 0)
                if lease:
                    done.append(lease)
            done += self._expire_holds(now)
        for lease in done:
            self._release_soon(lease)

    def _drop_hold(self, key: bytes, holds: list[_Held], i: int) -> str:
        """Forget hold ``i`` of ``key`` (under the lock): its lease if no hold of it is left, else ""."""
        held = holds.pop(i)
        if not holds:
            del self._held[key]
        left = self._lease_holds.get(held.lease_id, 0) - 1
        if left > 0:
            self._lease_holds[held.lease_id] = left
            return ""
        self._lease_holds.pop(held.lease_id, None)
        return held.lease_id

    def _expire_holds(self, now: float) -> list[str]:
        """Forget the holds whose lease has ended (LMCache aborted the prefetch that held them, or is late):
        the master released them already. Under the lock; the leases left with no hold, to release."""
        out = []
        for key in [k for k, holds in self._held.items() if holds[0].until < now]:
            holds = self._held[key]
            while key in self._held and holds and holds[0].until < now:
                lease = self._drop_hold(key, holds, 0)
                if lease:
                    out.append(lease)
        return out

    def _release_soon(self, lease: str) -> None:
        with contextlib.suppress(RuntimeError):  # closed: the lease runs to its deadline
            self._pool.submit(self._release, lease)

    def _release(self, lease: str) -> None:
        try:
            self.store.release(lease)
        except Exception as exc:  # the lease runs to its deadline instead
            self.tally.count("release_errors")
            self.tally.warn("release", f"kvpool LMCache release failed ({type(exc).__name__}: {exc})")

    # ------------------------------------------------------------------ load

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = next(self._ids)
        self._run(task, self._load, (keys, objects), "_loaded", Bitmap(len(keys)), 2)
        return task

    def _load(self, keys: list[Any], objects: list[Any]) -> Bitmap:
        wanted = [store_key(k, self._salt) for k in keys]
        with self._lock:
            held = {key: self._held[key][-1].location for key in wanted if key in self._held}
        missing = [key for key in wanted if key not in held]
        lease = ""
        if missing:  # loaded without a lookup through us (or after its unlock): locate and pin them now
            reply = self.store.lookup(missing, acquire=True)
            held.update({loc.meta.key: loc for loc in reply.found})
            lease = reply.lease_id
        try:
            loaded = Bitmap(len(keys))
            idx, locations, outs = [], [], []
            for i, (key, obj) in enumerate(zip(wanted, objects, strict=True)):
                loc = held.get(key)
                if loc is None:
                    continue
                out = _bytes_of(obj)
                if loc.meta.size != len(out):
                    self.tally.count("size_mismatches")
                    continue
                idx.append(i)
                locations.append(loc)
                outs.append(out)
            results = self.store.fetch_into(locations, outs) if locations else []
        finally:
            if lease:
                self._release_soon(lease)
        good = []
        for i, res in zip(idx, results, strict=True):
            if isinstance(res, Exception):
                self.tally.count("load_errors")
                self.tally.warn("load", f"kvpool LMCache chunk not loaded: {res}")
                continue
            loaded.set(i)
            good.append(keys[i])
        if good:
            self._notify_keys_accessed(good)
        self.tally.count("chunks_loaded", len(good))
        return loaded

    def query_load_result(self, task_id: int) -> Bitmap | None:
        return self._collect(self._loaded, task_id)

    def _collect(self, results: dict[int, tuple[float, Any]], task_id: int) -> Any:
        with self._lock:
            done = results.pop(task_id, None)
        return None if done is None else done[1]

    # ------------------------------------------------------------------ tasks, counters, life

    def _run(
        self, task: int, work: Callable[..., Any], args: tuple, results: str, failed: Any, event: int
    ) -> None:
        """Run ``work(*args)`` on a worker; its result (``failed`` if it raised) goes to the results table
        named ``results`` and the event fd is signalled, whatever happened: LMCache waits for it with no
        deadline."""

        def run() -> None:
            try:
                result = work(*args)
            except Exception as exc:
                self.tally.count("store_unavailable" if isinstance(exc, StoreError) else "call_errors")
                what = work.__name__[1:]
                self.tally.warn(work.__name__, f"kvpool LMCache {what} failed ({type(exc).__name__}: {exc})")
                result = failed
            self._finish(task, results, result, event)

        try:
            future = self._pool.submit(run)
        except RuntimeError:  # closed: the task still ends, as a failure
            self._finish(task, results, failed, event)
            return
        # one that ``close`` cancels before it ran ends too, as a failure
        future.add_done_callback(lambda f: f.cancelled() and self._finish(task, results, failed, event))

    def _finish(self, task: int, results: str, result: Any, event: int) -> None:
        """Make the result visible in the table as it is now (``pop_completed_store_tasks`` swaps the store
        table for a new one: a task in flight then must not write into the old one), then signal; results
        nobody collected for RESULT_S (a prefetch LMCache aborted) are dropped."""
        now = time.monotonic()
        with self._lock:
            table = getattr(self, results)
            table[task] = (now, result)
            for t in [t for t, (at, _) in table.items() if now - at > RESULT_S]:
                del table[t]
        self._events[event].notify()

    def counters(self) -> dict[str, float]:
        """What happened so far: chunks stored, found, loaded; misses and store errors by kind."""
        return self.tally.snapshot()

    def report_status(self) -> dict:
        counters = self.counters()
        failures = sum(v for k, v in counters.items() if k.endswith("errors") or k == "store_unavailable")
        return {"is_healthy": True, "backend": "kvpool", "master": self.config.store.master,
                "failures": failures, **counters}  # fmt: skip

    def close(self) -> None:
        """Stop: the tasks running finish (each store call within ``deadline_s``), the ones still queued
        end at once as failures, so a close against a dead store takes one deadline, not one per queued
        task. The leases held are released if a worker gets to it, else they run to their deadline."""
        with self._lock:
            leases, self._lease_holds, self._held = list(self._lease_holds), {}, {}
        for lease in leases:
            self._release_soon(lease)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        for event in self._events:
            event.close()


def _bytes_of(obj: Any) -> memoryview:
    """A chunk's bytes in LMCache's L1, as a plain byte view (its ``byte_array`` is typed ``<B``, which a
    slice assignment refuses)."""
    return memoryview(obj.byte_array).cast("B")
