"""`PrefillEngine`: one prompt in, first token + handoff out, reusing and extending the shared cache.

Flow (overview §2 step 2): hash the prompt's full blocks under the tenant's root -> ``fetch_prefix`` (joint
rule, verified, counted fallbacks) -> compute tokens ``[p, L)`` on the canonical 64-token schedule with
checkpoints where the policy says -> sample the first token (and its text, which the reply carries so the
gateway can stream it before decode starts) -> push new full MLA blocks, the chosen checkpoints and the
request tail. The read lease is released in the background (``DeferredCalls``): nothing waits for it.
Because resume at any 64-aligned p is bit-identical to the uncut run, the first-token logits are exactly
those of a no-cache run whatever p was reused.

The lookup never offers the block holding the prompt's last token: at least one token must be computed to
produce logits, so at most ``(L-1)//B`` blocks are reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from kvpool.cache.hashing import hash_blocks, root_hash
from kvpool.cache.units import RequestTail
from kvpool.kvstore.client.async_client import PutItem
from kvpool.kvstore.keys import tail_key
from kvpool.model.decode_state import DecodeState
from kvpool.model.prefill_result import PrefillResult
from kvpool.model.state import PrefixState
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.worker.errors import ON_CACHE_ERROR, BadRequestError, CacheFetchError
from kvpool.worker.handoff import Handoff, PrefillRequest
from kvpool.worker.model_runner import ModelRunner
from kvpool.worker.sampling import OutputText, sample
from kvpool.worker.store_io import (
    DEFAULT_TAIL_TTL_MS,
    DEFAULT_TIMEOUT_S,
    CacheStore,
    DeferredCalls,
    FetchStats,
    PushStats,
    drop_bad,
    fetch_prefix,
)
from kvpool.worker.store_push import (
    Retained,
    block_items,
    checkpoint_items,
    push_groups,
    retain_prefixes,
    tail_item,
)


@dataclass
class PrefillOutcome:
    first_token: int
    first_text: str  # token 0's text delta (decode's deltas continue after it; "" without a tokenizer)
    logits: torch.Tensor  # [V] logits of the last prompt token
    cached_tokens: int  # prompt tokens reused from the store (exactly what was resumed from)
    lost_to_checkpoint: int  # tokens of stored MLA blocks unusable for lack of a checkpoint
    recomputed_tokens: int  # tokens the master promised but a missing/corrupt/late object made us redo
    computed_tokens: int
    handoff: Handoff
    checkpoints_pushed: list[int] = field(default_factory=list)  # token positions
    fetch: FetchStats = field(default_factory=FetchStats)
    push: PushStats = field(default_factory=PushStats)
    ttft_s: float = 0.0  # request start -> first token known (before pushes)
    compute_s: float = 0.0
    total_s: float = 0.0
    state: DecodeState | None = None  # only with keep_state=True (colocated: hand over in process)
    retained: Retained = field(default_factory=Retained)  # what the client's retention hints pinned


class PrefillEngine:
    def __init__(
        self,
        runner: ModelRunner,
        store: CacheStore | None,
        *,
        block_size: int = 64,
        policy: CheckpointPolicy | None = None,
        tokenizer: object | None = None,
        tail_ttl_ms: int = DEFAULT_TAIL_TTL_MS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_cache_error: str = "recompute",
    ) -> None:
        if on_cache_error not in ON_CACHE_ERROR:
            raise ValueError(f"on_cache_error must be one of {ON_CACHE_ERROR}, got {on_cache_error!r}")
        self.runner = runner
        self.model = runner.model
        self.store = store
        self.schema = self.model.cache_schema(block_size)
        self.block_size = block_size
        self.policy = policy or CheckpointPolicy()
        self.tokenizer = tokenizer
        self.eos = set(self.model.config.eos_token_id)
        self.deferred = DeferredCalls(timeout_s)  # lease releases
        self.tail_ttl_ms = tail_ttl_ms
        self.timeout_s = timeout_s
        self.on_cache_error = on_cache_error

    def check(self, request: PrefillRequest) -> None:
        """Reject a bad request before any store traffic (`BadRequestError` with the reason)."""
        if not request.request_id:
            raise BadRequestError("request_id must be non-empty")
        if not request.prompt_ids:
            raise BadRequestError("prompt is empty")
        vocab = self.model.config.vocab_size
        for pos, t in enumerate(request.prompt_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise BadRequestError(f"token {t!r} at position {pos} is not an id in [0, {vocab})")
        request.sampling.validate()

    def hashes(self, prompt_ids: list[int], tenant: str) -> list[bytes]:
        """The prompt's chain, derived here from the tokens and tenant (prefill's one hash per request).

        Not taken from the gateway: each link names the whole prefix before it, so checking a received chain
        costs the same as deriving it, and an unchecked one (another block size, fingerprint or tenant) would
        make the store hand back other prompts' blocks: wrong tokens. The gateway's chain is routing advice.
        """
        return hash_blocks(prompt_ids, self.block_size, root_hash(self.model.fingerprint(), tenant))

    async def run(self, request: PrefillRequest, *, keep_state: bool = False) -> PrefillOutcome:
        self.check(request)
        t0 = time.perf_counter()
        B, prompt, L = self.block_size, request.prompt_ids, len(request.prompt_ids)
        hashes = self.hashes(prompt, request.tenant)
        use_store = self.store is not None and request.use_cache
        route = self.store.route_of(hashes) if self.store is not None else b""
        prefix, fetch = await self._fetch(hashes[: (L - 1) // B], request.tenant, use_store, route)
        start = prefix.n_tokens if prefix is not None else 0
        clean = not (fetch.missing or fetch.corrupt or fetch.late)
        stored_run = fetch.mla_run_blocks if clean else start // B  # blocks we may skip pushing
        boundaries = (
            self.policy.boundaries(
                prompt_len=L,
                block_size=B,
                start_blocks=start // B,
                mla_run_blocks=fetch.mla_run_blocks,
                existing=fetch.checkpoint_blocks if clean else (),
            )
            if use_store and self.schema.kda_layers  # a pure-MLA model resumes anywhere: no checkpoints
            else []
        )
        if use_store and self.schema.kda_layers and request.retain:
            # a cache_control breakpoint is where the client says it will come back: it gets a checkpoint
            have = set(boundaries) | {c * B for c in (fetch.checkpoint_blocks if clean else ())}
            marks = {s.upto_tokens // B * B for s in request.retain if s.upto_tokens}
            boundaries = sorted(set(boundaries) | {m for m in marks if start < m <= L and m not in have})
        t_compute = time.perf_counter()
        result = await self.runner.prefill(prompt[start:], prefix, boundaries)
        compute_s = time.perf_counter() - t_compute
        first = sample(result.logits, request.sampling, 0)
        first_text, _ = OutputText(self.tokenizer, request.sampling, self.eos).add(first)
        ttft = time.perf_counter() - t0
        handoff = Handoff(
            request_id=request.request_id,
            prompt_ids=list(prompt),
            tenant=request.tenant,
            first_token=first,
            sampling=request.sampling,
            block_hashes=hashes,
            tail_key=tail_key(request.request_id),
            tail_stored=False,
            cached_tokens=start,
            use_cache=request.use_cache,
            # a hint without a prompt_cache_key is still a client's pin: its own session, released by TTL
            session=request.session or (f"request:{request.request_id}" if request.retain else ""),
            retain_ms=request.retain_whole_ms if use_store else 0,
        )
        push = PushStats()
        retained = Retained()
        # A master that just failed the lookup would make every push wait out its deadline: skip them, and
        # decode recomputes (tail_stored stays False).
        if self.store is not None and fetch.error is None:
            push = await self._push(
                request, hashes, result, boundaries, stored_run, use_store, not keep_state, handoff, route
            )
            if use_store and request.retain:  # what the push stored (a failed tail does not matter here)
                ckpts = [b // B for b in boundaries] + list(fetch.checkpoint_blocks if clean else ())
                spans = [(s.upto_tokens // B if s.upto_tokens else L // B, s.ttl_ms) for s in request.retain]
                hybrid = bool(self.schema.kda_layers)  # pure MLA: a span pins its blocks, no checkpoint
                retained = await retain_prefixes(
                    self.store, hashes, spans, ckpts, handoff.session, B, self.timeout_s, route, hybrid
                )
        return PrefillOutcome(
            first_token=first,
            first_text=first_text,
            logits=result.logits,
            cached_tokens=start,
            lost_to_checkpoint=fetch.lost_to_checkpoint(B),
            recomputed_tokens=fetch.recomputed_tokens(B),
            computed_tokens=L - start,
            handoff=handoff,
            checkpoints_pushed=boundaries,
            fetch=fetch,
            push=push,
            ttft_s=ttft,
            compute_s=compute_s,
            total_s=time.perf_counter() - t0,
            state=DecodeState.from_prefill(result) if keep_state else None,
            retained=retained,
        )

    async def _fetch(
        self, hashes: list[bytes], tenant: str, use_store: bool, route: bytes
    ) -> tuple[PrefixState | None, FetchStats]:
        if not use_store or not hashes:
            return None, FetchStats(asked_blocks=len(hashes))
        assert self.store is not None
        prefix, stats = await fetch_prefix(
            self.store, self.schema, hashes, tenant, self.deferred, timeout_s=self.timeout_s, route=route
        )
        if self.on_cache_error == "fail" and (stats.used_blocks < stats.matched_blocks or stats.error):
            raise CacheFetchError(
                f"cache fetch lost {stats.recomputed_tokens(self.block_size)} tokens "
                f"(missing {stats.missing}, corrupt {stats.corrupt}, late {stats.late}, error {stats.error})"
            )
        if stats.bad_keys:
            await drop_bad(self.store, stats.bad_keys, self.timeout_s, route)
        return prefix, stats

    async def _push(
        self,
        request: PrefillRequest,
        hashes: list[bytes],
        result: PrefillResult,
        boundaries: list[int],
        stored_run: int,
        use_store: bool,
        with_tail: bool,
        handoff: Handoff,
        route: bytes,
    ) -> PushStats:
        """Blocks and checkpoints (``use_store``) and the tail (unless the state is handed over in memory),
        as one batch (``store_push``: one control exchange for the request's whole push); the tail's own
        success decides ``handoff.tail_stored``."""
        assert self.store is not None
        B, L = self.block_size, len(request.prompt_ids)
        n_full = L // B
        groups: list[list[PutItem]] = [[], [], []]  # tail, blocks, checkpoints
        if with_tail:
            tail = RequestTail(
                start=n_full * B,
                tokens=list(request.prompt_ids[n_full * B :]),
                mla={i: rows[n_full * B : L] for i, rows in result.mla.items()},
                kda=result.final,
            )
            item = tail_item(
                self.schema, request.request_id, tail, hashes, request.tenant, ttl_ms=self.tail_ttl_ms
            )
            groups[0].append(item)
        if use_store or with_tail:
            # a no-cache request still has to get its prompt to decode: its blocks go out short-lived, with
            # no checkpoint (no other hybrid request can resume from them), and it read nothing
            first_new = min(stored_run, n_full) if use_store else 0
            ttl = 0 if use_store else self.tail_ttl_ms
            groups[1] = block_items(self.schema, hashes, result.mla, first_new, n_full, request.tenant, ttl)
        if use_store:
            ckpts = [result.checkpoints[b] for b in boundaries]
            groups[2] = checkpoint_items(self.schema, hashes, ckpts, request.tenant)
        t0 = time.perf_counter()
        results = await push_groups(self.store, groups, self.timeout_s, route, retain=bool(request.retain))
        handoff.tail_stored = with_tail and results[0].failed == 0
        total = PushStats()
        for r in results:
            total.add(r)
        total.seconds = time.perf_counter() - t0  # one batch: wall time, not the sum
        return total
