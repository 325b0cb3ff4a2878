"""`Colocated`: prefill and decode engines in one process over one model thread and (optionally) one store.

Two uses: a single-process server, and *the reference* the disaggregated path is compared against. With
``use_cache=False`` in the request nothing touches the store: the prompt is computed from token 0 and the
prefill state is handed to decode in memory — the plain model run. With the cache on, the handoff goes
through the store exactly as between two processes (tail + blocks by hash), only without gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.decode.engine import DecodeEngine, DecodeResult
from kvpool.model.hybrid import HybridModel
from kvpool.prefill.engine import PrefillEngine, PrefillOutcome
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.worker.handoff import PrefillRequest
from kvpool.worker.model_runner import ModelRunner
from kvpool.worker.store_io import CacheStore


@dataclass
class Completion:
    prefill: PrefillOutcome
    decode: DecodeResult

    @property
    def tokens(self) -> list[int]:
        return self.decode.tokens

    @property
    def first_logits(self) -> torch.Tensor:
        return self.prefill.logits


class Colocated:
    def __init__(
        self,
        model: HybridModel,
        store: CacheStore | None = None,
        *,
        block_size: int = 64,
        policy: CheckpointPolicy | None = None,
        tokenizer: object | None = None,
        on_cache_error: str = "recompute",
    ) -> None:
        self.runner = ModelRunner(model)
        self.prefill = PrefillEngine(
            self.runner,
            store,
            block_size=block_size,
            policy=policy,
            tokenizer=tokenizer,
            on_cache_error=on_cache_error,
        )
        self.decode = DecodeEngine(
            self.runner, store, block_size=block_size, tokenizer=tokenizer, on_cache_error=on_cache_error
        )

    async def complete(self, request: PrefillRequest) -> Completion:
        """Prefill + decode to the end; the reference path when ``request.use_cache`` is False."""
        in_memory = not request.use_cache
        outcome = await self.prefill.run(request, keep_state=in_memory)
        final: DecodeResult | None = None
        async for event in self.decode.generate(outcome.handoff, outcome.state if in_memory else None):
            if isinstance(event, DecodeResult):
                final = event
        assert final is not None
        await self.prefill.deferred.drain()  # the whole completion is the answer here: return with the
        await self.decode.deferred.drain()  # store settled (leases released, the tail removed)
        return Completion(outcome, final)

    def close(self) -> None:
        self.runner.close()
