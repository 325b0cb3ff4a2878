"""`DecodeEngine`: handoff in, token stream out; the output's blocks go back to the store for the next turn.

Per request (overview §2 step 3): verify the handoff (its hashes must be the prompt's own), `resume` the
state (store, or recompute), then step with the `StepBatcher` (concurrent requests share model calls),
sampling step k with the request's seed. When a step lands on a block boundary the KDA state there is
snapshotted; at the end the full blocks of prompt + consumed output and the last snapshot (end-of-output
checkpoint; a pure-MLA model has no KDA state, so none) are pushed, so the next chat turn, whose prompt
extends this conversation, hits them. With the client's whole-prompt retention that chain is then pinned
(``DecodeResult.retained``, reported in ``DecodeUsage``). The tail is removed once read, in the background
(``DeferredCalls``: no token waits for it; its TTL covers crashes). The first token was chosen, and its
text shown, by prefill: the gRPC stream sends tokens from the second on.

Note the pushed output latents were computed by 1-token decode steps, which differ from a prefill of the
same tokens by ~1e-7 (overview §7.3): a turn-2 prefill resumed from them matches a no-cache run within
tolerance and with the same greedy tokens, not bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvpool.cache.hashing import hash_blocks, root_hash
from kvpool.decode.batcher import StepBatcher
from kvpool.decode.resume import ResumeInfo, resume
from kvpool.kvstore.keys import tail_key
from kvpool.model.decode_state import DecodeState
from kvpool.model.state import KDACheckpoint
from kvpool.worker.errors import ON_CACHE_ERROR, BadRequestError
from kvpool.worker.handoff import Handoff
from kvpool.worker.model_runner import ModelRunner
from kvpool.worker.sampling import OutputText, sample
from kvpool.worker.store_io import DEFAULT_TIMEOUT_S, CacheStore, DeferredCalls, PushStats
from kvpool.worker.store_push import Retained, block_items, checkpoint_items, push_groups, retain_prefixes


@dataclass
class TokenEvent:
    index: int  # 0 = the first token (chosen by prefill)
    token: int
    text: str  # decoded text added by this token ("" without a tokenizer)


@dataclass
class DecodeResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (eos or stop string) | "length"
    prompt_tokens: int
    cached_tokens: int  # from the prefill side (usage.prompt_tokens_details.cached_tokens)
    resume: ResumeInfo
    blocks_pushed: int = 0
    checkpoint_pushed: int = 0  # token position of the end-of-output checkpoint (0 = none)
    push: PushStats = field(default_factory=PushStats)
    decode_s: float = 0.0
    retained: Retained = field(default_factory=Retained)  # what its pin of the answer's chain kept

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


class DecodeEngine:
    def __init__(
        self,
        runner: ModelRunner,
        store: CacheStore | None,
        *,
        block_size: int = 64,
        tokenizer: object | None = None,
        end_of_output_checkpoint: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_cache_error: str = "recompute",
        batcher: StepBatcher | None = None,
    ) -> None:
        if on_cache_error not in ON_CACHE_ERROR:
            raise ValueError(f"on_cache_error must be one of {ON_CACHE_ERROR}, got {on_cache_error!r}")
        self.runner = runner
        self.model = runner.model
        self.store = store
        self.schema = self.model.cache_schema(block_size)
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.end_of_output_checkpoint = end_of_output_checkpoint
        self.timeout_s = timeout_s
        self.on_cache_error = on_cache_error
        self.batcher = batcher or StepBatcher(runner)
        self.eos = set(self.model.config.eos_token_id)
        self.deferred = DeferredCalls(timeout_s)  # lease releases and read tails' removal

    def _root(self, tenant: str) -> bytes:
        return root_hash(self.model.fingerprint(), tenant)

    def check(self, handoff: Handoff) -> None:
        """Reject an inconsistent handoff (`BadRequestError`) before touching the store."""
        vocab = self.model.config.vocab_size
        if not handoff.request_id or not handoff.prompt_ids:
            raise BadRequestError("handoff needs a request_id and a non-empty prompt")
        for pos, t in enumerate([*handoff.prompt_ids, handoff.first_token]):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise BadRequestError(f"token {t!r} at position {pos} is not an id in [0, {vocab})")
        handoff.sampling.validate()
        if handoff.tail_key != tail_key(handoff.request_id):
            raise BadRequestError("handoff tail_key is not the request's tail key")
        # decode's one hash of the prompt: the chain received in the handoff is used only once it equals the
        # one derived here from the prompt and tenant (a handoff must not point decode at other blocks)
        want = hash_blocks(handoff.prompt_ids, self.block_size, self._root(handoff.tenant))
        if [bytes(h) for h in handoff.block_hashes] != want:
            raise BadRequestError("handoff block_hashes do not match its prompt / tenant / model")

    async def generate(
        self, handoff: Handoff, state: DecodeState | None = None
    ) -> AsyncIterator[TokenEvent | DecodeResult]:
        """Stream every output token (the first one included), then one `DecodeResult`.

        ``state``: the state at the prompt end when the caller already has it (colocated, no store)."""
        self.check(handoff)
        t0 = time.perf_counter()
        if state is None:
            state, info = await resume(
                handoff,
                self.runner,
                self.store,
                self.schema,
                self.deferred,
                on_cache_error=self.on_cache_error,
                timeout_s=self.timeout_s,
            )
        else:
            info = ResumeInfo("state")
        store = self.store
        if store is not None and handoff.tail_stored:  # read (or bypassed): the TTL need not run out
            key = tail_key(handoff.request_id)
            self.deferred.start("remove_tail", lambda: store.remove([key]))
        params = handoff.sampling
        B, L = self.block_size, handoff.prompt_tokens
        out = OutputText(self.tokenizer, params, self.eos)
        tokens = [handoff.first_token]
        snapshot: KDACheckpoint | None = None
        # a pure-MLA model has no KDA state: its blocks alone are a usable prefix (no checkpoint to write)
        snapshots = self.end_of_output_checkpoint and bool(self.schema.kda_layers)
        while True:
            delta, finish = out.add(tokens[-1])
            yield TokenEvent(len(tokens) - 1, tokens[-1], delta)  # deltas add up to the text
            if finish:
                break
            logits = await self.batcher.step(tokens[-1], state)
            if state.n_tokens % B == 0 and snapshots:
                snapshot = state.checkpoint()
            tokens.append(sample(logits, params, len(tokens)))
        result = DecodeResult(
            tokens=tokens,
            text=out.text,
            finish_reason=finish,
            prompt_tokens=L,
            cached_tokens=handoff.cached_tokens,
            resume=info,
        )
        if self.store is not None and handoff.use_cache and info.store_error is None:
            await self._push_output(handoff, tokens, state, snapshot, result)
        result.decode_s = time.perf_counter() - t0
        yield result

    async def _push_output(
        self,
        handoff: Handoff,
        tokens: list[int],
        state: DecodeState,
        snapshot: KDACheckpoint | None,
        result: DecodeResult,
    ) -> None:
        """Full blocks past the prompt's (their latents are in ``state``) + the end-of-output checkpoint."""
        assert self.store is not None
        B = self.block_size
        consumed = [*handoff.prompt_ids, *tokens[:-1]]  # the last token was sampled, never fed
        first, end = len(handoff.prompt_ids) // B, state.n_tokens // B
        if end <= first and snapshot is None:
            return
        # the prompt's blocks were hashed (and checked) once in ``check``: extend that chain, never rehash it
        prompt_chain = [bytes(h) for h in handoff.block_hashes]
        parent = prompt_chain[-1] if prompt_chain else self._root(handoff.tenant)
        hashes = [*prompt_chain, *hash_blocks(consumed[first * B :], B, parent)]
        mla = {i: state.latents(i) for i in state.mla_layers}
        blocks = block_items(self.schema, hashes, mla, first, end, handoff.tenant)
        ckpts = checkpoint_items(self.schema, hashes, [snapshot], handoff.tenant) if snapshot else []
        # the prompt's route (a prompt without a full block: the reply's chain), as prefill pushed under
        route = self.store.route_of(prompt_chain or hashes)
        push, ck = await push_groups(  # one batch
            self.store, [blocks, ckpts], self.timeout_s, route, retain=bool(handoff.retain_ms)
        )
        result.blocks_pushed = end - first - push.not_admitted if push.failed == 0 else 0
        if snapshot is not None and ck.failed == 0 and ck.not_admitted == 0:
            result.checkpoint_pushed = snapshot.n_tokens
        push.add(ck)
        push.seconds = ck.seconds  # one batch: its wall time once
        result.push = push
        # the client asked to keep this conversation: its next turn resumes after this answer. A hybrid
        # chain is usable up to its end-of-output checkpoint; a pure-MLA one is its blocks, all of them
        hybrid = bool(self.schema.kda_layers)
        stored = result.blocks_pushed == end - first  # every new block (the master pins a chain whole or not)
        k = result.checkpoint_pushed // B if hybrid else end if stored else 0
        if handoff.retain_ms and k:
            span = [(k, handoff.retain_ms)]
            result.retained = await retain_prefixes(
                self.store, hashes, span, [k], handoff.session, B, self.timeout_s, route, hybrid
            )
