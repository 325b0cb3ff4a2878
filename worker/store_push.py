"""Push of cache units to the shared store: MLA blocks, KDA checkpoints and request tails.

Why one batch per request: a prefill's whole push (its new MLA blocks, the checkpoints at its chosen
boundaries, and the tail its decode node reads) goes out as *one* ``batch_put`` — one ``PutStartBatch``,
one pipelined stream per node, one commit batch — instead of one batch per kind (three control exchanges
each way) or one put per object (two per object). ``push_groups`` sends the groups and reports per group,
because the callers decide different things from each (the tail's success is the handoff's; the blocks'
and checkpoints' are the cache's).

Store errors never raise out of here: they are counted in ``PushStats`` (see ``store_io``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

import torch
from kvpool.cache.units import RequestTail, encode_tail, kda_checkpoint_parts, mla_block_parts
from kvpool.kvstore.client.async_client import PutItem
from kvpool.kvstore.errors import ObjectNotAdmittedError, StoreError
from kvpool.kvstore.keys import kda_key, mla_key, tail_key
from kvpool.kvstore.transport.base import Payload
from kvpool.model.cache_schema import CacheSchema
from kvpool.model.state import KDACheckpoint
from kvpool.proto import common_pb2
from kvpool.worker.store_io import (
    DEFAULT_TAIL_TTL_MS,
    DEFAULT_TIMEOUT_S,
    CacheStore,
    PushStats,
    per_item_results,
)


def block_items(
    schema: CacheSchema,
    hashes: Sequence[bytes],
    mla: dict[int, torch.Tensor],
    first: int,
    end: int,
    tenant: str = "",
    ttl_ms: int = 0,
) -> list[PutItem]:
    """MLA blocks ``[first, end)`` (rows of ``mla[layer]`` are absolute positions), keyed by h_i with the
    previous block's key as parent (prefix-aware eviction). ``ttl_ms``: blocks that only carry a no-cache
    request's prompt to its decode node expire like the tail."""
    B = schema.block_size
    items = []
    for i in range(first, end):
        latents = {layer: rows[i * B : (i + 1) * B].contiguous() for layer, rows in mla.items()}
        # parts viewing the latents: the put copies (shm) or sends (tcp) them with no assembly copy first
        data = Payload(mla_block_parts(schema, i, latents, block_hash=hashes[i]))
        parent = mla_key(hashes[i - 1]) if i else b""
        items.append(PutItem(mla_key(hashes[i]), data, common_pb2.MLA_BLOCK, tenant, parent, ttl_ms))
    return items


def checkpoint_items(
    schema: CacheSchema, hashes: Sequence[bytes], checkpoints: Sequence[KDACheckpoint], tenant: str = ""
) -> list[PutItem]:
    """KDA checkpoints, each at a block end (``n_tokens = (i+1)·B``), keyed by h_i."""
    B = schema.block_size
    items = []
    for ck in checkpoints:
        if ck.n_tokens <= 0 or ck.n_tokens % B:
            raise ValueError(f"checkpoint at {ck.n_tokens} is not at a block end (B={B})")
        h = hashes[ck.n_tokens // B - 1]
        data = Payload(kda_checkpoint_parts(schema, ck, block_hash=h))
        items.append(PutItem(kda_key(h), data, common_pb2.KDA_CHECKPOINT, tenant, mla_key(h)))
    return items


def tail_item(
    schema: CacheSchema,
    request_id: str,
    tail: RequestTail,
    hashes: Sequence[bytes],
    tenant: str = "",
    ttl_ms: int = DEFAULT_TAIL_TTL_MS,
) -> PutItem:
    """The request-scoped tail, with a TTL (it only has to live until the decode node reads it)."""
    data = encode_tail(schema, tail)
    n_full = tail.start // schema.block_size
    parent = mla_key(hashes[n_full - 1]) if n_full else b""
    return PutItem(tail_key(request_id), data, common_pb2.REQUEST_TAIL, tenant, parent, ttl_ms)


async def push_groups(
    store: CacheStore,
    groups: Sequence[Sequence[PutItem]],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    route: bytes = b"",
    retain: bool = False,
) -> list[PushStats]:
    """Every group's items in one ``batch_put``; one ``PushStats`` per group, each with the batch's wall
    time (the groups went out together). ``route``: the request's chain route, given to every block and
    checkpoint (a tail is request-scoped: it routes by its own key, as its reader looks it up). ``retain``:
    the client's retention hint covers the blocks and checkpoints (admission does not turn them away)."""
    stats = [PushStats() for _ in groups]
    items = [item for group in groups for item in group]
    if not items:
        return stats
    items = [
        i if i.kind == common_pb2.REQUEST_TAIL else dataclasses.replace(i, route=route, retain=retain)
        for i in items
    ]
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            results = per_item_results(await store.batch_put(items), len(items))
    except Exception as exc:
        results = [exc] * len(items)
    seconds = time.perf_counter() - t0
    at = 0
    for group, st in zip(groups, stats, strict=True):
        for item, res in zip(group, results[at : at + len(group)], strict=True):
            if res is None:
                st.objects += 1
                st.bytes_pushed += item.nbytes
            elif isinstance(res, ObjectNotAdmittedError):
                st.not_admitted += 1
            else:
                st.failed += 1
                st.errors.append(f"{type(res).__name__}: {res}")
        st.seconds = seconds
        at += len(group)
    return stats


@dataclasses.dataclass
class Retained:
    """What a request's retention hints pinned: tokens of its chain kept (prefill: of the prompt; decode:
    of the prompt and its answer), and whether the store's pin budget refused one (the request is served
    either way)."""

    tokens: int = 0
    refused: bool = False


async def retain_prefixes(
    store: CacheStore,
    hashes: Sequence[bytes],
    spans: Sequence[tuple[int, int]],
    checkpoint_blocks: Sequence[int],
    session: str,
    block_size: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    route: bytes = b"",
    hybrid: bool = True,
) -> Retained:
    """Pin, for each ``(upto_blocks, ttl_ms)`` span, the chain up to the deepest checkpoint at or before
    ``upto_blocks`` (its MLA blocks and that checkpoint: a prefix without its checkpoint is no hit for a
    hybrid model, and a checkpoint without its blocks is useless), under the client's ``session``.
    ``checkpoint_blocks``: block counts that should have a checkpoint in the store now; the master pins a
    session's chain whole or not at all, so when one is missing (its put failed) the next shallower one is
    tried. Spans that end at the same checkpoint are one pin (the longest TTL); distinct ones go out
    together. ``hybrid=False`` (a pure-MLA model: no KDA layers, a prefix is usable at any block): a span
    pins the MLA blocks ``[0, min(upto_blocks, len(hashes)))`` alone, ``checkpoint_blocks`` is not read
    and there is nothing shallower to try (``workloads/sim.py`` ``_honour_hints`` does the same). A store
    problem or a refusal only means less is retained: nothing here raises."""
    have = sorted(set(checkpoint_blocks), reverse=True) if hybrid else []
    ttl_of: dict[int, int] = {}  # deepest usable checkpoint (pure MLA: block count) -> the longest TTL
    for upto, ttl_ms in spans:
        k = next((c for c in have if c <= upto), 0) if hybrid else min(upto, len(hashes))
        if k and ttl_ms:
            ttl_of[k] = max(ttl_of.get(k, 0), ttl_ms)

    async def pin(k: int, ttl_ms: int) -> tuple[int, bool]:
        # hybrid: the checkpoint asked for, then one shallower; pure MLA: the blocks, once
        for c in [c for c in have if c <= k][:2] if hybrid else [k]:
            keys = [mla_key(h) for h in hashes[:c]] + ([kda_key(hashes[c - 1])] if hybrid else [])
            try:
                async with asyncio.timeout(timeout_s):
                    result = await store.pin(keys, ttl_ms, route, session)
            except (StoreError, TimeoutError):
                return 0, False  # the store is late or away: the hint is lost, the request is not
            if result.refused or result.pinned:
                return (0, True) if result.refused else (c * block_size, False)
        return 0, False

    out = Retained()
    for tokens, refused in await asyncio.gather(*(pin(k, ttl) for k, ttl in ttl_of.items())):
        out.tokens = max(out.tokens, tokens)
        out.refused = out.refused or refused
    return out
