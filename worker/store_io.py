"""Fetch of cache units through the shared store, shared by the prefill and decode workers (the push is
``store_push``; its ``PushStats`` live here beside ``FetchStats``).

Why one module: both workers must read and write exactly the same objects under exactly the same keys and
checks (overview §2-§3), and both must treat every store problem the same way — a missing, corrupt, late or
unreachable object is a *miss*, never an exception that reaches the request. ``fetch_prefix`` therefore
always returns a usable ``PrefixState`` (possibly at an earlier checkpoint than the master promised, or
None = start from token 0) plus counters saying what was lost and why; pushes report failures in their
stats and never raise for store errors (``store_push``).

The store is reached through the ``CacheStore`` protocol, which names exactly the client calls used here,
so the real ``kvpool.kvstore.client.async_client.AsyncStoreClient`` and the tests' in-process
``MemoryStore`` are interchangeable. Every call runs under ``asyncio.timeout``: a dead node costs at most the
deadline. Calls whose answer the request does not need (a read lease's release, the removal of a tail decode
has read) go through ``DeferredCalls`` and never delay a token.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from kvpool.cache.errors import CacheUnitError
from kvpool.cache.units import (
    RequestTail,
    decode_kda_checkpoint,
    decode_mla_block,
    decode_tail,
)
from kvpool.kvstore.client.async_client import LocatedPrefix, PinResult, PutItem
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.keys import kda_key, mla_key, tail_key
from kvpool.model.cache_schema import CacheSchema
from kvpool.model.state import KDACheckpoint, PrefixState
from kvpool.proto import common_pb2

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_LEASE_MS = 10_000
DEFAULT_TAIL_TTL_MS = 120_000

Buffer = bytes | bytearray | memoryview


class CacheStore(Protocol):
    """The store client calls the workers make: exactly these methods of ``AsyncStoreClient``."""

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
        """Joint-rule prefix match (overview §3); ``acquire`` read-pins the usable objects under a lease.
        ``route``: the request's chain route (``route_of``), with master shards. ``resume``: decode's read
        of what prefill just stored, not a writer's lookup (the store learns nothing from it)."""
        ...

    def route_of(self, block_hashes: Sequence[bytes]) -> bytes:
        """The route of a request's chain (its prompt's full blocks): every object of the request and every
        lookup for it goes to the master shard this names (docs/design/sharding.md)."""
        ...

    async def release(self, lease_id: str) -> None:
        """Drop a read lease taken by ``match_prefix(acquire=True)``."""
        ...

    async def fetch_into(
        self, locations: Sequence[common_pb2.ObjectLocation], outs: Sequence[Buffer]
    ) -> list[int | StoreError]:
        """Move located (already pinned) objects into ``outs``: per-item size or typed error."""
        ...

    async def batch_get(self, keys: Sequence[bytes], route: bytes | None = None) -> list[bytes | StoreError]:
        """Per-key result: the object's bytes, or the typed error for that key (missing, corrupt, ...)."""
        ...

    async def batch_put(self, items: Sequence[PutItem]) -> list[StoreError | None]:
        """Two-phase put of each object; a duplicate of a committed key is a success (None)."""
        ...

    async def remove(self, keys: Sequence[bytes], route: bytes | None = None) -> int:
        """Remove objects (used to drop a unit found corrupt so a good copy can be written)."""
        ...

    async def pin(
        self, keys: Sequence[bytes], ttl_ms: int, route: bytes | None = None, session: str = ""
    ) -> PinResult:
        """Soft-pin objects for a client's retention hint; over the store's pin budget nothing is pinned."""
        ...


# ------------------------------------------------------------------------------------------------ stats


@dataclass
class FetchStats:
    """What one prefix fetch got, lost and why (tokens are ``blocks * block_size``)."""

    asked_blocks: int = 0  # hashes offered to the master
    matched_blocks: int = 0  # usable p the master reported (joint rule)
    mla_run_blocks: int = 0  # MLA blocks present ignoring checkpoints
    checkpoint_blocks: list[int] = field(default_factory=list)  # block counts with a stored checkpoint
    used_blocks: int = 0  # p actually resumed from after every check
    fallbacks: int = 0  # times a bad object forced an earlier boundary
    missing: int = 0  # objects the index listed but the node did not return
    corrupt: int = 0  # objects that failed a cache-unit check
    late: int = 0  # objects (or calls) past their deadline
    bytes_fetched: int = 0
    seconds: float = 0.0
    error: str | None = None  # store unreachable / master error: served without cache
    bad_keys: list[bytes] = field(default_factory=list)  # corrupt units (removed so they can be rewritten)

    def lost_to_checkpoint(self, block_size: int) -> int:
        """Tokens of MLA blocks that existed past the usable checkpoint (overview §3)."""
        return max(self.mla_run_blocks - self.matched_blocks, 0) * block_size

    def recomputed_tokens(self, block_size: int) -> int:
        """Tokens the master said were usable but had to be recomputed (missing/corrupt/late objects)."""
        return max(self.matched_blocks - self.used_blocks, 0) * block_size


@dataclass
class PushStats:
    objects: int = 0
    bytes_pushed: int = 0
    failed: int = 0
    not_admitted: int = 0  # turned away by the store's admission control: not cached, not a failure
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def add(self, other: PushStats) -> None:
        self.objects += other.objects
        self.bytes_pushed += other.bytes_pushed
        self.failed += other.failed
        self.not_admitted += other.not_admitted
        self.seconds += other.seconds
        self.errors.extend(other.errors)


class DeferredCalls:
    """Store calls a request does not wait for: a read lease's ``release`` (the bytes are already here) and
    the removal of a request tail decode has read (its TTL would remove it anyway).

    Each runs as a task under the store deadline. A failure is counted in ``failed`` (by call name), never
    raised: at worst a lease or a tail lives until its own deadline. ``drain`` waits for the calls in flight:
    a worker's shutdown (before its store client closes) and whoever checks the store after a request.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.failed: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: the loop keeps only weak ones

    def start(self, name: str, call: Callable[[], Awaitable[object]]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(name, call), name=f"deferred-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, name: str, call: Callable[[], Awaitable[object]]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await call()
        except Exception:
            self.failed[name] += 1

    async def drain(self) -> None:
        """Return once every call started so far has ended (each is bounded by ``timeout_s``)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))


# ------------------------------------------------------------------------------------------------ helpers


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError)


def per_item_results(results: object, n: int) -> list:
    """A client answer with one result per item, or the same error for all (a misbehaving client must not
    turn into an exception inside a request)."""
    if isinstance(results, list) and len(results) == n:
        return results
    return [RuntimeError(f"store returned {type(results).__name__} for {n} items")] * n


async def _get(
    store: CacheStore, keys: list[bytes], timeout_s: float, stats: FetchStats, route: bytes | None = None
) -> dict[bytes, bytes | Exception]:
    """Batch get under a deadline; a whole-call failure becomes the same error for every key. ``route``: the
    keys' chain (master shards; None = each key by itself, as a request's tail)."""
    if not keys:
        return {}
    try:
        async with asyncio.timeout(timeout_s):
            results = per_item_results(await store.batch_get(keys, route=route), len(keys))
    except Exception as exc:  # unreachable / timed out: every key is a miss
        results = [exc] * len(keys)
    out: dict[bytes, bytes | Exception] = {}
    for key, res in zip(keys, results, strict=True):
        if isinstance(res, Exception):
            if _is_timeout(res):
                stats.late += 1
            else:
                stats.missing += 1
        else:
            stats.bytes_fetched += len(res)
        out[key] = res
    return out


async def _fetch_located(
    store: CacheStore, locations: list[common_pb2.ObjectLocation], timeout_s: float, stats: FetchStats
) -> dict[bytes, bytes | Exception]:
    """Move objects the match already located and pinned (no second master round trip)."""
    if not locations:
        return {}
    outs = [bytearray(loc.meta.size) for loc in locations]
    try:
        async with asyncio.timeout(timeout_s):
            results = per_item_results(await store.fetch_into(locations, outs), len(locations))
    except Exception as exc:
        results = [exc] * len(locations)
    got: dict[bytes, bytes | Exception] = {}
    for loc, out, res in zip(locations, outs, results, strict=True):
        if isinstance(res, Exception):
            stats.late += int(_is_timeout(res))
            stats.missing += int(not _is_timeout(res))
            got[bytes(loc.meta.key)] = res
        else:
            stats.bytes_fetched += res
            got[bytes(loc.meta.key)] = bytes(out[:res]) if res != len(out) else out
    return got


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


# ------------------------------------------------------------------------------------------------ fetch


async def fetch_prefix(
    store: CacheStore,
    schema: CacheSchema,
    hashes: Sequence[bytes],
    tenant: str,
    deferred: DeferredCalls,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    lease_ms: int = DEFAULT_LEASE_MS,
    require_checkpoint: bool | None = None,
    route: bytes | None = None,
    resume: bool = False,
) -> tuple[PrefixState | None, FetchStats]:
    """Resume point for a prompt whose full-block hashes are ``hashes`` (pass only blocks you may skip).

    MatchPrefix(acquire) -> batch get of the checkpoint at p and MLA blocks [0, p) -> full decode checks
    (block index, hash, n_tokens). If anything is missing, corrupt or late, fall back to the largest earlier
    checkpoint the master listed whose MLA run is intact (fetching that checkpoint), down to 0 = None.
    Never raises for store or cache-unit problems; always releases the lease, through ``deferred``: the
    bytes are verified and in hand by then, so the request does not wait for the master's answer.
    ``require_checkpoint=False`` fetches the plain MLA run (a decode node that holds the KDA state at the
    prompt end in the request tail); the default follows the model (joint rule iff it has KDA layers).
    ``route``: the request's chain route (``CacheStore.route_of`` of the whole prompt), since ``hashes`` may
    be only its head. ``resume``: decode's fetch of what prefill stored for this request (the store then
    counts it as no writer's lookup: docs/design/eviction.md §1.3).
    """
    t0 = time.perf_counter()
    stats = FetchStats(asked_blocks=len(hashes))
    if not hashes:
        return None, stats
    deadline = time.monotonic() + timeout_s  # the whole fetch, fallbacks included, fits in one timeout
    B = schema.block_size
    require = bool(schema.kda_layers) if require_checkpoint is None else require_checkpoint
    try:
        async with asyncio.timeout(timeout_s):
            match = await store.match_prefix(
                list(hashes),
                tenant=tenant,
                require_checkpoint=require,
                acquire=True,
                lease_ms=lease_ms,
                route=route,
                resume=resume,
            )
    except Exception as exc:
        stats.error = f"match_prefix: {type(exc).__name__}: {exc}"
        stats.late += int(_is_timeout(exc))
        stats.seconds = time.perf_counter() - t0
        return None, stats
    lease_id = match.lease_id
    try:
        p = min(int(match.usable_blocks), len(hashes))
        stats.matched_blocks = p
        stats.mla_run_blocks = min(int(match.mla_run_blocks), len(hashes))
        checkpoints = [c for c in match.checkpoint_blocks if 0 < c <= len(hashes)]
        stats.checkpoint_blocks = checkpoints
        located = [*match.mla[:p], *([match.checkpoint] if require and p and match.checkpoint else [])]
        prefix = await _fetch_verified(
            store, schema, hashes, p, checkpoints, located, require, deadline, stats, route
        )
    finally:
        if lease_id:
            deferred.start("release", lambda: store.release(lease_id))
    stats.used_blocks = prefix.n_tokens // B if prefix is not None else 0
    stats.seconds = time.perf_counter() - t0
    return prefix, stats


async def _fetch_verified(
    store: CacheStore,
    schema: CacheSchema,
    hashes: Sequence[bytes],
    p: int,
    checkpoints: list[int],
    located: list[common_pb2.ObjectLocation],
    require: bool,
    deadline: float,
    stats: FetchStats,
    route: bytes | None,
) -> PrefixState | None:
    if p == 0:
        return None
    keys = [mla_key(h) for h in hashes[:p]]
    got = await _fetch_located(store, located, _left(deadline), stats)
    blocks: list[dict[int, torch.Tensor]] = []
    broken = False
    for i, key in enumerate(keys):  # the intact MLA run bounds every boundary we may use
        block = _decode_mla(got.get(key), schema, i, hashes[i], key, stats)  # checks all: finds every bad one
        broken = broken or block is None
        if not broken:
            blocks.append(block)  # type: ignore[arg-type]
    good = len(blocks)
    if not require:
        return _assemble(schema, good, KDACheckpoint(good * schema.block_size), blocks) if good else None
    # Boundaries we may still resume from, best first: p itself if its MLA run is intact, then every
    # earlier checkpoint the master listed inside the intact run.
    targets = sorted({c for c in checkpoints if c <= good} | ({p} if good == p else set()), reverse=True)
    if good < p:  # p itself is abandoned; still check its checkpoint so a bad one gets replaced
        stats.fallbacks += 1
        ck = kda_key(hashes[p - 1])
        _decode_kda(got.get(ck), schema, p, hashes[p - 1], stats)
    for target in targets:
        key = kda_key(hashes[target - 1])
        if key not in got and _left(deadline) <= 0.001:
            stats.late += 1  # out of time for more fallbacks: compute from scratch
            break
        raw = got[key] if key in got else (await _get(store, [key], _left(deadline), stats, route))[key]
        ckpt = _decode_kda(raw, schema, target, hashes[target - 1], stats)
        if ckpt is not None:
            return _assemble(schema, target, ckpt, blocks)
        stats.fallbacks += 1
    return None


def _decode_mla(
    raw: bytes | Exception | None,
    schema: CacheSchema,
    index: int,
    block_hash: bytes,
    key: bytes,
    stats: FetchStats,
) -> dict[int, torch.Tensor] | None:
    if raw is None or isinstance(raw, Exception):
        return None
    try:
        # views over the fetched buffer (alive until _assemble's cat, the one copy these rows need)
        return decode_mla_block(
            raw, schema, expected_block=index, expected_hash=block_hash, copy=False
        ).latents
    except CacheUnitError:
        stats.corrupt += 1
        stats.bad_keys.append(key)
        return None


def _decode_kda(
    raw: bytes | Exception | None, schema: CacheSchema, blocks: int, block_hash: bytes, stats: FetchStats
) -> KDACheckpoint | None:
    if raw is None or isinstance(raw, Exception):
        return None
    try:
        return decode_kda_checkpoint(
            raw, schema, expected_n_tokens=blocks * schema.block_size, expected_hash=block_hash
        )
    except CacheUnitError:
        stats.corrupt += 1
        stats.bad_keys.append(kda_key(block_hash))
        return None


def _assemble(
    schema: CacheSchema, n_blocks: int, ckpt: KDACheckpoint, blocks: list[dict[int, torch.Tensor]]
) -> PrefixState:
    mla = {layer: torch.cat([b[layer] for b in blocks[:n_blocks]], 0) for layer in schema.mla_layers}
    return PrefixState(n_blocks * schema.block_size, ckpt, mla)


async def drop_bad(
    store: CacheStore, keys: Sequence[bytes], timeout_s: float = DEFAULT_TIMEOUT_S, route: bytes | None = None
) -> int:
    """Remove units found corrupt so the recomputed copy can be stored (objects are immutable otherwise)."""
    if not keys:
        return 0
    try:
        async with asyncio.timeout(timeout_s):
            return int(await store.remove(list(keys), route=route))
    except Exception:
        return 0


async def fetch_tail(
    store: CacheStore,
    schema: CacheSchema,
    request_id: str,
    *,
    expected_start: int,
    expected_tokens: list[int],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[RequestTail | None, str | None]:
    """The request-scoped tail, fully verified against the prompt's own tokens; (None, why) on any miss."""
    key = tail_key(request_id)
    stats = FetchStats()
    raw = (await _get(store, [key], timeout_s, stats))[key]
    if isinstance(raw, Exception):
        return None, f"{type(raw).__name__}: {raw}"
    try:
        tail = decode_tail(raw, schema, expected_start=expected_start, expected_tokens=expected_tokens)
    except CacheUnitError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return tail, None
