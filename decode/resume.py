"""Rebuild a request's decode state from the store, or recompute it: decode's only path to a `DecodeState`.

Preferred: the prompt's full MLA blocks by hash (plain run; the KDA state is in the tail) + the request
tail (partial-block latents + KDA state at L, verified against the prompt's own tokens), both fetched at
once: neither lookup needs the other's answer. Anything missing,
corrupt or late -> resume from the best stored checkpoint and prefill the rest locally on the canonical
schedule, which yields the very bits the prefill node had (overview §2 step 4): never wrong tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from kvpool.model.cache_schema import CacheSchema
from kvpool.model.decode_state import DecodeState
from kvpool.worker.errors import CacheFetchError
from kvpool.worker.handoff import Handoff
from kvpool.worker.model_runner import ModelRunner
from kvpool.worker.store_io import DEFAULT_TIMEOUT_S, CacheStore, DeferredCalls, fetch_prefix, fetch_tail


@dataclass
class ResumeInfo:
    path: str  # "tail" (all from the store), "recompute" (some/all prompt tokens recomputed), "state"
    fetched_tokens: int = 0  # prompt tokens whose state came from the store
    recomputed_tokens: int = 0  # prompt tokens decode had to compute itself
    reason: str = ""  # why the tail path was not taken
    store_error: str | None = None  # the store did not answer: decode skips its pushes too


async def resume(
    handoff: Handoff,
    runner: ModelRunner,
    store: CacheStore | None,
    schema: CacheSchema,
    deferred: DeferredCalls,
    *,
    on_cache_error: str = "recompute",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[DecodeState, ResumeInfo]:
    B, prompt, L = schema.block_size, handoff.prompt_ids, len(handoff.prompt_ids)
    reason = "no store" if store is None else "tail not stored by prefill"
    if store is not None and handoff.tail_stored:
        state, reason = await _from_tail(handoff, store, schema, deferred, timeout_s)
        if state is not None:
            return state, ResumeInfo("tail", fetched_tokens=L)
    if on_cache_error == "fail":
        raise CacheFetchError(f"request {handoff.request_id}: cannot resume from the store: {reason}")
    prefix, error = None, None
    if store is not None:
        cap = (L - 1) // B
        prefix, stats = await fetch_prefix(
            store,
            schema,
            handoff.block_hashes[:cap],
            handoff.tenant,
            deferred,
            timeout_s=timeout_s,
            route=store.route_of(handoff.block_hashes),
            resume=True,  # prefill made this request's writer's lookup: decode's teaches the store nothing
        )
        error = stats.error
    start = prefix.n_tokens if prefix is not None else 0
    result = await runner.prefill(prompt[start:], prefix, [])
    return DecodeState.from_prefill(result), ResumeInfo(
        "recompute", fetched_tokens=start, recomputed_tokens=L - start, reason=reason, store_error=error
    )


async def _from_tail(
    handoff: Handoff, store: CacheStore, schema: CacheSchema, deferred: DeferredCalls, timeout_s: float
) -> tuple[DecodeState | None, str]:
    B, prompt, L = schema.block_size, handoff.prompt_ids, len(handoff.prompt_ids)
    n_full = L // B
    tail_fetch = fetch_tail(
        store,
        schema,
        handoff.request_id,
        expected_start=n_full * B,
        expected_tokens=list(prompt[n_full * B :]),
        timeout_s=timeout_s,
    )
    if not n_full:
        tail, why = await tail_fetch
        return (DecodeState(L, tail.kda.layers, dict(tail.mla)), "") if tail else (None, f"tail: {why}")
    blocks_fetch = fetch_prefix(
        store,
        schema,
        handoff.block_hashes[:n_full],
        handoff.tenant,
        deferred,
        require_checkpoint=False,
        timeout_s=timeout_s,
        route=store.route_of(handoff.block_hashes),
        resume=True,  # prefill made this request's writer's lookup: decode's teaches the store nothing
    )
    (tail, why), (prefix, stats) = await asyncio.gather(tail_fetch, blocks_fetch)
    if tail is None:
        return None, f"tail: {why}"
    if prefix is None or prefix.n_tokens != n_full * B:
        got = prefix.n_tokens if prefix is not None else 0
        return None, (
            f"MLA blocks: {got // B} of {n_full} usable (missing {stats.missing}, corrupt "
            f"{stats.corrupt}, late {stats.late}, error {stats.error})"
        )
    mla = {i: torch.cat([prefix.mla[i], tail.mla[i]], 0) for i in schema.mla_layers}
    return DecodeState(L, tail.kda.layers, mla), ""
