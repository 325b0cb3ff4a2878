"""`StepBatcher`: concurrent requests' next decode steps run as one batched model call.

Each request awaits ``step(token, state)``; whatever is queued when the model thread becomes free runs
together through ``decode_step_batch`` (per-row exact, so batching never changes a request's tokens). One
queue per process: requests arriving while a batch computes join the next one (continuous batching).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch
from kvpool.model.decode_state import DecodeState
from kvpool.worker.model_runner import ModelRunner


class StepBatcher:
    def __init__(self, runner: ModelRunner, max_batch: int = 64) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self._queue: list[tuple[int, DecodeState, asyncio.Future[torch.Tensor]]] = []
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.batches = 0
        self.max_batch_seen = 0
        self.on_step: Callable[[int, float], None] | None = None  # (batch size, seconds) per model call

    async def step(self, token: int, state: DecodeState) -> torch.Tensor:
        """Feed ``token`` at ``state.n_tokens`` (state advanced in place); returns the next logits."""
        fut: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self._queue.append((token, state, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(0)  # let requests resumed in this loop turn join the batch
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            live = [item for item in batch if not item[2].cancelled()]
            if not live:
                continue
            t0 = time.perf_counter()
            try:
                logits = await self.runner.decode_batch([t for t, _, _ in live], [s for _, s, _ in live])
            except Exception as exc:  # a bad state fails its batch; each request sees the error
                for _, _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            if self.on_step is not None:
                self.on_step(len(live), time.perf_counter() - t0)
            self.steps += len(live)
            self.batches += 1
            self.max_batch_seen = max(self.max_batch_seen, len(live))
            for (_, _, fut), row in zip(live, logits, strict=True):
                if not fut.done():
                    fut.set_result(row)
