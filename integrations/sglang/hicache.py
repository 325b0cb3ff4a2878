"""``KvpoolHiCacheStorage``: kvpool's store as SGLang HiCache's storage tier (its "L3").

Loaded by SGLang's dynamic backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
      "module_path": "kvpool.integrations.sglang.hicache", "class_name": "KvpoolHiCacheStorage",
      "interface_v1": 1, "master": "HOST:PORT", "salt": "tenant-a"}'

Every path of SGLang's ``HiCacheStorage`` contract (``sglang/srt/mem_cache/hicache_storage.py``, 0.5.23):

- generic: ``get`` / ``set`` / ``batch_get`` / ``batch_set`` / ``exists`` / ``batch_exists`` over flat page
  tensors SGLang copied out of (or will copy into) its host pool;
- zero-copy v1 (``interface_v1``): ``batch_get_v1`` / ``batch_set_v1`` move each page straight between the
  registered host pool (the pointers of its ``get_page_buffer_meta``) and the store: a put copies the page
  into the storage node's pool, a read copies it out of the node's pool (same host) into the host pool, with
  no buffer in between;
- v2 with side pools (hybrid models: Kimi's KDA state in SGLang's Mamba pool, DSA indexer, SWA):
  ``batch_exists_v2`` with the hit policies ``all_pages`` and ``trailing_pages``, ``batch_get_v2`` /
  ``batch_set_v2`` per pool.

Keys (``keys.py``): MLA KV is written once (rank 0 of its DCP group) and read by every rank; MHA KV and the
Mamba/KDA state are keyed per TP rank; the salt is in every key's root. Pages carry a checked header
(``codec.py``) and are verified against the store's checksum as they are copied.

Failure: every store problem (master or node down, deadline passed, object evicted or damaged) is a miss
(``False`` / ``None`` / a shorter hit), logged at most every 10 s per kind and counted (``counters()``),
never an exception into the engine. Only a bad configuration raises, at construction or when SGLang
registers a host pool, so the engine refuses to start. Mechanism: ``docs/design/sglang_hicache.md``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from kvpool.integrations.miss_tally import MissTally
from kvpool.integrations.sglang.codec import BadPageError, header, payload_offset
from kvpool.integrations.sglang.config import HiCacheConfigError, parse_config
from kvpool.integrations.sglang.keys import KV_POOL, Identity, KeySpace
from kvpool.integrations.store_config import connect
from kvpool.kvstore.client.async_client import PutItem
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.transport.base import COPY_HASH_CHUNK, Payload, as_bytes_view
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

log = logging.getLogger("kvpool.sglang")
RAW_FORMAT = "raw"  # a generic page written before any host pool was registered
_WARN_EVERY_S = 10.0


@dataclass(slots=True)
class _Page:
    """One page object to move: its store key and kind, and SGLang's memory it comes from or goes to."""

    key: bytes
    kind: int
    parent: bytes
    fmt: str
    views: list[memoryview]  # the page's bytes in order: the put's sources, the read's destinations
    done: Callable[[], None] | None = None  # after a good read (the generic fallback's copy into the pool)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.views)


@functools.lru_cache(maxsize=64)
def _byte_array(n: int) -> type:
    return ctypes.c_ubyte * n


def _raw_view(ptr: int, n: int) -> memoryview:
    """``n`` bytes of host memory at ``ptr`` (a host pool's page, from its ``get_page_buffer_meta``)."""
    return memoryview(_byte_array(n).from_address(ptr)).cast("B")


def _name(pool: Any) -> str:
    return str(getattr(pool, "value", pool))


def page_format(pool: str, host_pool: Any) -> str:
    """The byte format of ``host_pool``'s pages: a page moves only between pools of one format."""
    layout = getattr(host_pool, "layout", "?")
    dtype = str(getattr(host_pool, "dtype", "?")).removeprefix("torch.")
    return f"{pool}/{type(host_pool).__name__}/{layout}/{dtype}"


class KvpoolHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage over kvpool's store (built by SGLang's ``StorageBackendFactory``)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.config = parse_config(storage_config.extra_config)
        if getattr(storage_config, "should_split_heads", False):
            raise HiCacheConfigError(
                "tp_lcm_size", "heads split across heterogeneous TP sizes is not supported by kvpool"
            )
        self.storage_config = storage_config
        self.identity = Identity.of(storage_config)
        self.keys = KeySpace(self.identity, self.config.salt)
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.tally = MissTally(log, _WARN_EVERY_S)
        self._metrics: list[tuple[str, int, float]] = []  # (get|set, pages, seconds) for get_stats
        self.store, self.node_capacity = connect(self.config, HiCacheConfigError)

    # ------------------------------------------------------------------ registration (engine start)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self._check_pages(KV_POOL, mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self._check_pages(_name(host_pool_name), host_pool)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _check_pages(self, pool: str, host_pool: Any) -> None:
        """A pool whose pages the store cannot hold is refused here, at engine start."""
        if getattr(host_pool, "kv_buffer", True) is None:
            return  # a logical anchor (DeepSeek V4): its bytes live in side pools
        nbytes = page_bytes(host_pool)
        if nbytes <= 0:
            raise HiCacheConfigError("page_size", f"pool {pool!r} has pages of {nbytes} B: nothing to store")
        if self.node_capacity and nbytes + 64 > self.node_capacity:
            raise HiCacheConfigError(
                "page_size",
                f"pool {pool!r} pages are {nbytes} B, more than a kvpool storage node holds "
                f"({self.node_capacity} B per node): use smaller pages or larger nodes",
            )

    # ------------------------------------------------------------------ generic path

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        try:
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            pages, outs = [], []
            for key, target in zip(keys, targets, strict=True):
                if target is None:
                    target = self._dummy_page()
                page, out = self._generic_target(key, target)
                pages.append(page)
                outs.append(out)
        except Exception as exc:
            return self._failed("batch_get", exc, [None] * len(keys))
        ok = self._read(pages, "get")
        return [out if good else None for out, good in zip(outs, ok, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if not self.identity.kv_writer:
            self.tally.count("skipped_not_writer", len(keys))
            return True  # replicated KV: rank 0 of the DCP group writes it (SGLang's is_storage_writer)
        try:
            fmt = self._kv_format()
            pages, previous = [], None
            for key, value in zip(keys, values, strict=True):
                obj, kind = self.keys.object_key(key)
                data = value.detach().contiguous() if isinstance(value, torch.Tensor) else value
                pages.append(
                    _Page(obj, kind, self.keys.parent(key, KV_POOL, previous), fmt, [as_bytes_view(data)])
                )
                previous = key
        except Exception as exc:
            return self._failed("batch_set", exc, False)
        return all(self._write(pages, "set"))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored (the leading run)."""
        try:  # a key SGLang never sends (not a str) is a miss too, never an exception in the engine
            wanted = [self.keys.object_key(k)[0] for k in keys]
        except Exception as exc:
            return self._failed("batch_exists", exc, 0)
        found = self._exists(wanted)
        return found.index(False) if False in found else len(found)

    # ------------------------------------------------------------------ zero-copy v1

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            pages = self._pool_pages(KV_POOL, self._kv_pool(), keys, host_indices, reading=True)
        except Exception as exc:
            return self._failed("batch_get_v1", exc, [False] * len(keys))
        return self._read(pages, "get")

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not self.identity.kv_writer:
            self.tally.count("skipped_not_writer", len(keys))
            return [True] * len(keys)
        try:
            pages = self._pool_pages(
                KV_POOL, self._kv_pool(), keys, host_indices, reading=False, previous=_last(extra_info)
            )
        except Exception as exc:
            return self._failed("batch_set_v1", exc, [False] * len(keys))
        return self._write(pages, "set")

    # ------------------------------------------------------------------ v2: side pools

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix under every pool's hit policy, with every restorable length (SGLang intersects
        those across ranks: a trailing-pages pool leaves holes)."""
        transfers = list(pool_transfers or [])
        try:  # unusable keys or pool names are a miss, never an exception in the engine
            wanted = [self.keys.object_key(k)[0] for k in keys]
            for t in transfers:
                wanted += [self.keys.object_key(k, _name(t.name))[0] for k in keys]
        except Exception as exc:
            return self._failed("batch_exists_v2", exc, PoolTransferResult(0, {}, []))
        found = self._exists(wanted)
        n = len(keys)
        kv_pages = found.index(False) if False in found[:n] else n
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for j, t in enumerate(transfers):
            if not restorable:
                break
            has = found[n * (j + 1) : n * (j + 2)]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                run = has[:kv_pages].index(False) if False in has[:kv_pages] else kv_pages
                ok = set(range(1, run + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys or ()))
                ok = {p for p in range(1, kv_pages + 1) if all(has[max(0, p - window) : p])}
            else:
                self.tally.warn(
                    "policy", f"hit policy {t.hit_policy} of pool {_name(t.name)} is not supported"
                )
                ok = set()
            if ok:
                hits[t.name] = max(ok)
            restorable = [p for p in restorable if p in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, extra_info, reading=True)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, extra_info, reading=False)

    def _batch_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None, reading: bool
    ) -> dict[str, list[bool]]:
        results: dict[Any, list[bool]] = {}
        pages: list[_Page] = []
        spans: list[tuple[Any, int, int]] = []
        for t in transfers:
            keys = list(t.keys or [])
            pool = _name(t.name)
            if not reading and not self.identity.kv_writer and not self.identity.per_rank(pool):
                self.tally.count("skipped_not_writer", len(keys))
                results[t.name] = [True] * len(keys)
                continue
            host_pool = self.registered_pools.get(t.name) or (self._kv_pool() if pool == KV_POOL else None)
            try:
                if host_pool is None:
                    raise ValueError(f"pool {pool!r} was never registered")
                got = self._pool_pages(pool, host_pool, keys, t.host_indices, reading, _last(extra_info))
            except Exception as exc:
                results[t.name] = self._failed(
                    f"batch_{'get' if reading else 'set'}_v2", exc, [False] * len(keys)
                )
                continue
            spans.append((t.name, len(pages), len(pages) + len(got)))
            pages += got
        ok = self._read(pages, "get") if reading else self._write(pages, "set")
        for name, start, end in spans:
            results[name] = ok[start:end]
        return results

    # ------------------------------------------------------------------ pages of SGLang's memory

    def _kv_pool(self) -> Any:
        if self.mem_pool_host is None:
            raise ValueError("no host pool registered")
        return self.mem_pool_host

    def _kv_format(self) -> str:
        return RAW_FORMAT if self.mem_pool_host is None else page_format(KV_POOL, self.mem_pool_host)

    def _dummy_page(self) -> torch.Tensor:
        return self._kv_pool().get_dummy_flat_data_page()

    def _generic_target(self, key: str, target: torch.Tensor) -> tuple[_Page, torch.Tensor]:
        obj, kind = self.keys.object_key(key)
        if target.is_contiguous():
            return _Page(obj, kind, b"", self._kv_format(), [as_bytes_view(target)]), target
        staging = target.contiguous()
        return _Page(
            obj, kind, b"", self._kv_format(), [as_bytes_view(staging)], lambda: target.copy_(staging)
        ), target

    def _pool_pages(
        self,
        pool: str,
        host_pool: Any,
        keys: Sequence[str],
        host_indices: torch.Tensor | None,
        reading: bool,
        previous: str | None = None,
    ) -> list[_Page]:
        """``keys``' pages of ``host_pool`` at ``host_indices`` (one index per token, a page per key)."""
        if not keys:
            return []
        step = int(getattr(host_pool, "page_size", 1) or 1)
        if host_indices is None or host_indices.numel() != len(keys) * step:
            got = 0 if host_indices is None else host_indices.numel()
            raise ValueError(
                f"pool {pool!r}: {len(keys)} pages need {len(keys) * step} host indices, got {got}"
            )
        fmt = page_format(pool, host_pool)
        views = _zero_copy_views(host_pool, host_indices, len(keys))
        pages = []
        for i, key in enumerate(keys):
            obj, kind = self.keys.object_key(key, pool)
            parent = b"" if reading else self.keys.parent(key, pool, previous)
            previous = key
            if views is not None:
                pages.append(_Page(obj, kind, parent, fmt, views[i]))
                continue
            # the pool has no zero-copy pointers for this layout: its flat page, as SGLang's generic path
            index = int(host_indices[i * step])
            if reading:
                buf = host_pool.get_dummy_flat_data_page()
                done = functools.partial(host_pool.set_from_flat_data_page, index, buf)
                pages.append(_Page(obj, kind, parent, fmt, [as_bytes_view(buf)], done))
            else:
                data = host_pool.get_data_page(index, flat=True).contiguous()
                pages.append(_Page(obj, kind, parent, fmt, [as_bytes_view(data)]))
        return pages

    # ------------------------------------------------------------------ the store

    def _write(self, pages: list[_Page], op: str) -> list[bool]:
        if not pages:
            return []
        t0 = time.perf_counter()
        items = [
            PutItem(
                p.key,
                Payload([header(p.fmt, p.nbytes), *p.views]),
                kind=p.kind,
                parent=p.parent,
            )
            for p in pages
        ]
        try:
            errors: list[StoreError | None] = self.store.batch_put(items)
        except Exception as exc:
            return self._failed("put", exc, [False] * len(pages))
        ok = [err is None for err in errors]
        self.tally.put_errors(errors, "write", "kvpool HiCache write")
        self.tally.count("pages_written", sum(ok))
        self._record(op, sum(ok), time.perf_counter() - t0)
        return ok

    def _read(self, pages: list[_Page], op: str) -> list[bool]:
        """Locate the pages (one master call), then copy each straight out of where the store holds it into
        SGLang's memory, hashing as it copies; per page whether it arrived whole."""
        if not pages:
            return []
        t0 = time.perf_counter()
        ok = [False] * len(pages)
        try:
            reply = self.store.lookup([p.key for p in pages])
            located = {loc.meta.key: loc for loc in reply.found}
            wanted = [i for i, p in enumerate(pages) if p.key in located]
            locations = [located[pages[i].key] for i in wanted]
            self.tally.count("read_misses", len(pages) - len(wanted))
            if not locations:
                return ok

            def visit(j: int, view: memoryview) -> None:
                _copy_page(view, pages[wanted[j]], locations[j].meta.checksum)

            errors = self.store.read_in_place_soon(locations, visit).result()
        except Exception as exc:
            return self._failed("read", exc, ok)
        for i, err in zip(wanted, errors, strict=True):
            if err is None:
                done = pages[i].done
                if done is not None:
                    done()
                ok[i] = True
            else:
                self.tally.count("bad_pages" if isinstance(err, BadPageError) else "read_errors")
                self.tally.warn("read", f"kvpool HiCache page not read: {err}")
        self.tally.count("pages_read", sum(ok))
        self._record(op, sum(ok), time.perf_counter() - t0)
        return ok

    def _exists(self, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        try:
            return self.store.batch_exists(keys)
        except Exception as exc:
            return self._failed("exists", exc, [False] * len(keys))

    # ------------------------------------------------------------------ counters, metrics, life

    def counters(self) -> dict[str, float]:
        """What happened so far: pages read and written, misses, store errors, skipped writes."""
        return self.tally.snapshot()

    def _failed(self, op: str, exc: BaseException, result: Any) -> Any:
        """A whole call failed: the store is down or late, or SGLang handed something unusable."""
        self.tally.count("store_errors" if isinstance(exc, StoreError) else "call_errors")
        self.tally.warn(op, f"kvpool HiCache {op} failed ({type(exc).__name__}: {exc})")
        return result

    def _record(self, op: str, pages: int, seconds: float) -> None:
        if self.storage_config.enable_storage_metrics and pages:
            with self._lock:
                self._metrics.append((op, pages, seconds))

    def get_stats(self) -> Any:
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            records, self._metrics = self._metrics, []
        metrics = StorageMetrics()
        for op, pages, seconds in records:
            pgs, bw = (
                (metrics.prefetch_pgs, metrics.prefetch_bandwidth)
                if op == "get"
                else (metrics.backup_pgs, metrics.backup_bandwidth)
            )
            pgs.append(pages)
            bw.append(pages / max(seconds, 1e-9))
        return metrics

    def clear(self) -> bool:
        """A shared store is not cleared by one engine: its objects age out by the store's eviction."""
        self.tally.warn("clear", "kvpool HiCache clear() ignored: the store is shared")
        return False

    def close(self) -> None:
        self.store.close()


def page_bytes(host_pool: Any) -> int:
    """Bytes of one page of ``host_pool``."""
    step = int(getattr(host_pool, "page_size", 1) or 1)
    views = _zero_copy_views(host_pool, torch.zeros(step, dtype=torch.int64), 1)
    if views is not None:
        return sum(len(v) for v in views[0])
    page = host_pool.get_dummy_flat_data_page()
    return page.numel() * page.element_size()


def _zero_copy_views(host_pool: Any, host_indices: torch.Tensor, pages: int) -> list[list[memoryview]] | None:
    """Each page's memory in the host pool, as its ``get_page_buffer_meta`` lays it out (one part per
    buffer the page spans, in the pool's order); None when the pool has no pointers for its layout."""
    meta = getattr(host_pool, "get_page_buffer_meta", None)
    if meta is None:
        return None
    try:
        ptrs, sizes = meta(host_indices)
    except (NotImplementedError, ValueError, AssertionError, AttributeError):
        return None
    if not ptrs or len(ptrs) % pages or len(sizes) != len(ptrs):
        return None
    per = len(ptrs) // pages
    return [
        [
            _raw_view(int(p), int(n))
            for p, n in zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True)
        ]
        for i in range(pages)
    ]


def _copy_page(view: memoryview, page: _Page, checksum: int) -> None:
    """Copy a stored page into SGLang's memory, hashing each chunk as it lands; the digest of the whole
    object must be the store's checksum (else the page is damaged: ``BadPageError``, a miss)."""
    start = payload_offset(view, page.fmt, page.nbytes)
    hasher = xxhash.xxh3_64(view[:start])
    at = start
    for dst in page.views:
        for off in range(0, len(dst), COPY_HASH_CHUNK):
            end = min(off + COPY_HASH_CHUNK, len(dst))
            dst[off:end] = view[at + off : at + end]
            hasher.update(dst[off:end])
        at += len(dst)
    if checksum and hasher.intdigest() != checksum:
        raise BadPageError("page checksum mismatch")


def _last(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    """The page before the call's first page, when SGLang passes the prefix (``prefix_keys``)."""
    prefix = getattr(extra_info, "prefix_keys", None)
    return prefix[-1] if prefix else None
