"""`ModelRunner`: the one thread that runs the model, shared by every engine in a process.

Why one thread: torch kernels run outside the event loop (the gRPC server stays responsive and store I/O
overlaps compute) but never concurrently with each other, so every request sees the same kernels and
thread count as the reference run (overview §7.3 rule 3) and two requests never fight over the cores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from kvpool.model.decode_state import DecodeState
from kvpool.model.hybrid import HybridModel
from kvpool.model.prefill_result import PrefillResult
from kvpool.model.state import PrefixState

T = TypeVar("T")


class ModelRunner:
    def __init__(self, model: HybridModel) -> None:
        self.model = model
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-model")

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def prefill(
        self, tokens: Sequence[int], start: PrefixState | None, boundaries: Sequence[int]
    ) -> PrefillResult:
        return await self._run(lambda: self.model.prefill(tokens, start=start, boundaries=boundaries))

    async def decode_batch(self, tokens: Sequence[int], states: Sequence[DecodeState]) -> list[torch.Tensor]:
        return await self._run(lambda: self.model.decode_step_batch(tokens, states))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
