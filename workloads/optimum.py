"""Offline optimum for prefix caching at a capacity of C blocks: the physical limit policies aim at.

Belady's MIN with bypass, per request: after a request's lookup, the cache may keep any C blocks of
(what it held) ∪ (the blocks the request stored); keeping the C blocks whose next use (next request whose
*prompt* contains them) is soonest maximises hits, by the usual exchange argument (unit-size blocks).
Blocks never used again are dropped at once. Ties in next use break deepest-first.

Why this respects the prefix rule without enforcing it: a request that uses block i uses every block
before it, so next_use(parent) <= next_use(child) at all times; with deepest-first ties the kept set is
always prefix-closed, so every block MIN holds at a lookup lies on an intact prefix: MIN's any-position
hits are prefix hits, and no policy (prefix rule or not) can hit more blocks at the same capacity.

Limits: unit sizes (a trace's partial last block counts as a whole block, KDA checkpoints take no space),
so on a hybrid spec it bounds the MLA run and therefore the usable prefix too. Hits are optimal in
*blocks*; the token figures are the tokens of those blocks (``cached_tokens`` without the block holding
the last prompt token, as prefill computes it anyway), not separately optimised numbers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.workloads.chains import ChainBuilder
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.sim_result import Counters
from kvpool.workloads.trace import Request

NEVER = 1 << 62


@dataclass(slots=True)
class OptimumResult:
    capacity_blocks: int | None
    total: Counters
    per_workload: dict[str, Counters]

    def to_dict(self) -> dict[str, object]:
        return {
            "requests": self.total.requests,
            "policy": "optimum",
            "capacity_blocks": self.capacity_blocks,
            **self.total.to_dict(),
            "workloads": {w: c.to_dict() for w, c in sorted(self.per_workload.items())},
        }


def optimum(
    requests: Sequence[Request],
    capacity_blocks: int | None,
    spec_name: str,
    block_size: int,
    store_output: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> OptimumResult:
    """Block hits of offline MIN at ``capacity_blocks`` (None: unbounded) on ``requests`` in arrival order.

    ``block_size`` applies to token records (trace records carry their own); chains are those of
    :class:`ChainBuilder` for ``spec_name``, so they are the simulator's chains.
    """
    if capacity_blocks is not None and (type(capacity_blocks) is not int or capacity_blocks < 0):
        raise ReplayError(f"capacity must be a non-negative number of blocks, got {capacity_blocks!r}")
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
    builder = ChainBuilder(spec_name, block_size)
    chains = [builder.chain(requests[i], with_output=store_output) for i in order]
    # next use of each stored block after request r, computed backwards
    next_use: list[list[int]] = [[]] * len(chains)
    last_seen: dict[bytes, int] = {}
    for r in range(len(chains) - 1, -1, -1):
        ch = chains[r]
        next_use[r] = [last_seen.get(h, NEVER) for h in ch.hashes]
        for h in ch.hashes[: ch.prompt_blocks]:
            last_seen[h] = r
    cap = NEVER if capacity_blocks is None else capacity_blocks

    def block_of(req: Request) -> int:
        return req.block_size if req.tokens is None else block_size

    cache: dict[bytes, int] = {}
    heap: list[tuple[int, int, bytes]] = []
    per_workload: dict[str, Counters] = {}
    for r, ch in enumerate(chains):
        req = requests[order[r]]
        run = 0
        for h in ch.hashes[: ch.prompt_blocks]:
            if h not in cache:
                break
            run += 1
        cnt = per_workload.setdefault(req.workload, Counters())
        usable = min(run, (req.input_length - 1) // block_of(req)) if req.input_length else 0
        # the MLA run hits; of it, what ends before the last prompt token is usable (checkpoints are free)
        cnt.add_lookup(req, ch, run, usable, usable)
        for depth, (h, nu) in enumerate(zip(ch.hashes, next_use[r], strict=True)):
            if nu == NEVER:
                cache.pop(h, None)
                continue
            cache[h] = nu
            heapq.heappush(heap, (-nu, -depth, h))
        while len(cache) > cap:
            neg_nu, _, h = heapq.heappop(heap)
            if cache.get(h) == -neg_nu:
                del cache[h]
        if len(heap) > 4 * max(len(cache), 1024):  # drop stale entries now and then
            heap = [e for e in heap if cache.get(e[2]) == -e[0]]
            heapq.heapify(heap)
        if progress is not None:
            progress(r + 1, len(chains))
    total = Counters()
    for c in per_workload.values():
        total.add(c)
    return OptimumResult(capacity_blocks, total, per_workload)
