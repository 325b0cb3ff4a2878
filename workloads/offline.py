"""Offline references for a hybrid cache that count checkpoint bytes: a feasible schedule and an upper bound.

Both see the whole trace in advance and use the simulator's chains (``ChainBuilder``), so their figures
compare with ``simulate`` point for point (docs/design/eviction.md has the arguments and worked examples).

``reference`` is a *feasible* schedule: real byte sizes for MLA blocks and KDA checkpoints, the joint rule for
every hit (MLA blocks [0, p) and a checkpoint at p, counted from its own cache state), and only objects the
request could write (its prompt's and reply's MLA blocks; checkpoints at block boundaries it computes,
``(p, end]``). What it knows of the future it uses three ways:

1. *placement*: a request writes a checkpoint only at a boundary where the next request to use that block
   stops sharing the chain (its run ends there), or at the end of what it computed when anyone will need it;
2. *admission*: an object nobody will look up again is never written;
3. *eviction*: Belady by next use with bypass: room is made by dropping the object used farthest in the
   future, and a new object is dropped instead when everything cached is needed sooner.

``bound`` is a provable upper bound on the cached tokens of *any* schedule at capacity C bytes: every hit of
a hybrid model needs a checkpoint (K bytes) in the cache, so at every lookup that hits, the counted MLA
blocks held fit in C - K; MIN over unit blocks at floor((C - K) / block bytes) maximises block hits among all
schedules that never hold more than that, and any schedule's hits are those of one such schedule (its cache
restricted to what it still holds at its next hit). A pure-MLA spec has K = 0: the bound is MLA MIN at C.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.workloads.chains import Chain, ChainBuilder
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.sim import effective_block_size
from kvpool.workloads.sim_result import Counters
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.trace import Request

NEVER = 1 << 62
OFFLINE_POLICIES = ("reference", "bound")


@dataclass(slots=True)
class OfflineResult:
    policy: str
    capacity_bytes: int | None
    total: Counters
    per_workload: dict[str, Counters] = field(default_factory=dict)
    per_tenant: dict[str, Counters] = field(default_factory=dict)
    spec: str = ""
    block_size: int = 0
    hybrid: bool = True

    def to_dict(self) -> dict[str, object]:
        return {
            "requests": self.total.requests,
            "policy": self.policy,
            "capacity_bytes": self.capacity_bytes,
            "config": {
                "spec": self.spec,
                "policy": self.policy,
                "capacity": self.capacity_bytes,
                "capacity_unit": "bytes",
                "block_size": self.block_size,
                "checkpoints": "offline placement" if self.policy == "reference" else "n/a (bound)",
                "hybrid": self.hybrid,
            },
            **self.total.to_dict(),
            "workloads": {w: c.to_dict() for w, c in sorted(self.per_workload.items())},
            "tenants": {t: c.to_dict() for t, c in sorted(self.per_tenant.items())},
        }


@dataclass(slots=True)
class _Plan:
    """The trace in arrival order with, per request, its chain, lookup cap and next uses of its blocks."""

    requests: list[Request]
    chains: list[Chain]
    caps: list[int]  # blocks a lookup may use: those ending before the last prompt token
    next_use: list[list[int]]  # per block of the chain: the next request whose lookup includes it
    stops: list[list[bool]]  # per block j: a later lookup includes block j and then leaves this chain
    block_size: int
    spec: str = ""
    store_output: bool = True

    def check(
        self, requests: Sequence[Request], spec: ModelSpec, block_size: int | None, store_output: bool
    ) -> None:
        """A plan handed in must be the one these arguments would build (trace, spec, blocks, outputs)."""
        bs = effective_block_size(requests, spec, block_size)
        if (self.spec, self.block_size, self.store_output, len(self.requests)) != (
            spec.name,
            bs,
            store_output,
            len(requests),
        ):
            raise ReplayError(
                f"offline plan built for spec {self.spec!r}, {self.block_size}-token blocks, "
                f"store_output={self.store_output}, {len(self.requests)} requests; asked for {spec.name!r}, "
                f"{bs}, {store_output}, {len(requests)}"
            )


def offline_plan(
    requests: Sequence[Request], spec: ModelSpec, block_size: int | None = None, store_output: bool = True
) -> _Plan:
    """The backward pass every capacity shares: chains, lookup caps, next uses and stops. It does not
    depend on the capacity, so a sweep builds it once and hands it to :func:`reference` / :func:`bound`
    at every point (``plan=``); the pool's forked workers inherit it."""
    return _plan(requests, spec, block_size, store_output)


def _plan(requests: Sequence[Request], spec: ModelSpec, block_size: int | None, store_output: bool) -> _Plan:
    bs = effective_block_size(requests, spec, block_size)
    ordered = sorted(requests, key=lambda r: r.arrival_ms)
    builder = ChainBuilder(spec.name, bs)
    chains = [builder.chain(r, with_output=store_output) for r in ordered]
    caps = [
        min((r.input_length - 1) // (r.block_size if r.tokens is None else bs), c.prompt_blocks)
        if r.input_length
        else 0
        for r, c in zip(ordered, chains, strict=True)
    ]
    next_use: list[list[int]] = [[] for _ in chains]
    stops: list[list[bool]] = [[] for _ in chains]
    seen: dict[bytes, int] = {}
    after: dict[bytes, set[bytes | None]] = {}  # block -> what later lookups read right after it
    for i in range(len(chains) - 1, -1, -1):
        hashes = chains[i].hashes
        next_use[i] = [seen.get(h, NEVER) for h in hashes]
        stops[i] = [
            any(c != (hashes[j + 1] if j + 1 < len(hashes) else None) for c in after.get(h, ()))
            for j, h in enumerate(hashes)
        ]
        cap = caps[i]
        for j, h in enumerate(hashes[:cap]):
            seen[h] = i
            after.setdefault(h, set()).add(hashes[j + 1] if j + 1 < cap else None)
    return _Plan(ordered, chains, caps, next_use, stops, bs, spec.name, store_output)


def _counters(
    plan: _Plan, i: int, run: int, usable: int, groups: tuple[dict[str, Counters], dict[str, Counters]]
) -> None:
    req, chain = plan.requests[i], plan.chains[i]
    for group, name in zip(groups, (req.workload, req.tenant), strict=True):
        group.setdefault(name, Counters()).add_lookup(req, chain, run, run, usable)


def _owners(
    plan: _Plan, i: int, groups: tuple[dict[str, Counters], dict[str, Counters]]
) -> tuple[Counters, Counters]:
    req = plan.requests[i]
    return groups[0][req.workload], groups[1][req.tenant]


def _total(per_workload: dict[str, Counters]) -> Counters:
    total = Counters()
    for c in per_workload.values():
        total.add(c)
    return total


def _check_capacity(capacity_bytes: int | None) -> None:
    if capacity_bytes is not None and (type(capacity_bytes) is not int or capacity_bytes <= 0):
        raise ReplayError(f"capacity must be a positive number of bytes, got {capacity_bytes!r}")


def _given_or_built(
    plan: _Plan | None,
    requests: Sequence[Request],
    spec: ModelSpec,
    block_size: int | None,
    store_output: bool,
) -> _Plan:
    if plan is None:
        return _plan(requests, spec, block_size, store_output)
    plan.check(requests, spec, block_size, store_output)
    return plan


class _BeladyCache:
    """Objects with sizes and next uses; evicts farthest-next-use first, with bypass."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.next_use: dict[bytes, int] = {}
        self.size: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []  # (-next use, key), lazily invalidated

    def __contains__(self, key: bytes) -> bool:
        return key in self.size

    def renew(self, key: bytes, nu: int) -> None:
        if key in self.size:
            if nu == NEVER:
                self.drop(key)
                return
            self.next_use[key] = nu
            heapq.heappush(self._heap, (-nu, key))

    def drop(self, key: bytes) -> None:
        self.used -= self.size.pop(key)
        del self.next_use[key]

    def offer(self, key: bytes, size: int, nu: int) -> bool:
        """Admit a new ``key`` if it is needed again and room can be made by dropping objects needed later."""
        assert key not in self.size, "renew a cached key instead"
        if nu == NEVER or size > self.capacity:
            return False
        victims: list[bytes] = []
        freed = self.capacity - self.used
        heap = self._heap
        while freed < size:
            while heap and self.next_use.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)  # stale entry
            if not heap or -heap[0][0] <= nu:
                for k in victims:  # not worth it: restore the candidates, bypass the newcomer
                    heapq.heappush(heap, (-self.next_use[k], k))
                return False
            _, k = heapq.heappop(heap)
            victims.append(k)
            freed += self.size[k]
        for k in victims:
            self.drop(k)
        self.size[key] = size
        self.next_use[key] = nu
        self.used += size
        heapq.heappush(heap, (-nu, key))
        return True


def reference(
    requests: Sequence[Request],
    capacity_bytes: int | None,
    spec: ModelSpec,
    block_size: int | None = None,
    store_output: bool = True,
    progress: Callable[[int, int], None] | None = None,
    plan: _Plan | None = None,
) -> OfflineResult:
    """The feasible offline schedule described in the module docstring, at ``capacity_bytes``; ``plan``:
    :func:`offline_plan` of the same arguments, built once for many capacities (else built here)."""
    _check_capacity(capacity_bytes)
    plan = _given_or_built(plan, requests, spec, block_size, store_output)
    cache = _BeladyCache(NEVER if capacity_bytes is None else capacity_bytes)
    kda = spec.kda_bytes_per_checkpoint
    groups: tuple[dict[str, Counters], dict[str, Counters]] = ({}, {})
    for i, chain in enumerate(plan.chains):
        h, cap, nu = chain.hashes, plan.caps[i], plan.next_use[i]
        run = 0
        while run < cap and b"M" + h[run] in cache:
            run += 1
        usable = run
        if spec.hybrid:
            while usable and b"K" + h[usable - 1] not in cache:
                usable -= 1
        _counters(plan, i, run, usable, groups)
        # checkpoints this lookup could have used are next needed at their next use (or never: dropped);
        # the chain's MLA blocks are renewed by their offers below
        for q in range(1, cap + 1):
            cache.renew(b"K" + h[q - 1], nu[q - 1])
        mine = _owners(plan, i, groups)
        if spec.hybrid:
            end = len(h) if len(h) > chain.prompt_blocks else chain.full_prompt_blocks
            for q in _checkpoint_targets(nu, plan.stops[i], usable, end):
                key = b"K" + h[q - 1]
                if key in cache:
                    continue  # its next use is kept current by every lookup that includes it
                if cache.offer(key, kda, nu[q - 1]):
                    for c in mine:
                        c.kda_bytes_written += kda
                        c.checkpoints_written += 1
        for j, hj in enumerate(h):
            key, size = b"M" + hj, chain.block_tokens[j] * spec.mla_bytes_per_token
            if key in cache:
                cache.renew(key, nu[j])  # its next use after this request (dropped if never)
            elif cache.offer(key, size, nu[j]):
                for c in mine:
                    c.mla_bytes_written += size
        if progress is not None:
            progress(i + 1, len(plan.chains))
    return _result("reference", capacity_bytes, groups, spec, plan)


def _checkpoint_targets(nu: list[int], stops: list[bool], usable: int, end: int) -> list[int]:
    """Boundaries q in (usable, end] where some later lookup reads block q-1 and then leaves this chain (its
    run ends at q, so a checkpoint at q is exactly what it needs), and the end of what was computed when it
    is read again. Deepest first: a deep checkpoint is offered before shallower ones compete for room."""
    return [q for q in range(end, usable, -1) if nu[q - 1] != NEVER and (q == end or stops[q - 1])]


def bound(
    requests: Sequence[Request],
    capacity_bytes: int | None,
    spec: ModelSpec,
    block_size: int | None = None,
    store_output: bool = True,
    progress: Callable[[int, int], None] | None = None,
    plan: _Plan | None = None,
) -> OfflineResult:
    """The upper bound described in the module docstring: MIN over the blocks lookups count, at
    ``floor((C - K) / full block bytes)`` blocks (no hits at all when C < K); ``plan`` as for
    :func:`reference`."""
    _check_capacity(capacity_bytes)
    plan = _given_or_built(plan, requests, spec, block_size, store_output)
    block_bytes = plan.block_size * spec.mla_bytes_per_token
    if capacity_bytes is None:
        slots = NEVER
    else:
        slots = max(capacity_bytes - spec.kda_bytes_per_checkpoint, -1) // block_bytes
    groups: tuple[dict[str, Counters], dict[str, Counters]] = ({}, {})
    cache: dict[bytes, int] = {}
    heap: list[tuple[int, int, bytes]] = []  # (-next use, -depth, key): ties deepest first (prefix-closed)
    for i, chain in enumerate(plan.chains):
        h, cap, nu = chain.hashes, plan.caps[i], plan.next_use[i]
        hits = 0
        while hits < cap and h[hits] in cache:
            hits += 1
        _counters(plan, i, hits, hits, groups)
        if slots > 0:
            for j in range(len(h)):
                if nu[j] == NEVER:
                    cache.pop(h[j], None)
                else:
                    cache[h[j]] = nu[j]
                    heapq.heappush(heap, (-nu[j], -j, h[j]))
            while len(cache) > slots:
                neg, _, k = heapq.heappop(heap)
                if cache.get(k) == -neg:
                    del cache[k]
            if len(heap) > 4 * max(len(cache), 1024):
                heap = [e for e in heap if cache.get(e[2]) == -e[0]]
                heapq.heapify(heap)
        if progress is not None:
            progress(i + 1, len(plan.chains))
    return _result("bound", capacity_bytes, groups, spec, plan)


def _result(
    policy: str,
    capacity_bytes: int | None,
    groups: tuple[dict[str, Counters], dict[str, Counters]],
    spec: ModelSpec,
    plan: _Plan,
) -> OfflineResult:
    return OfflineResult(
        policy,
        capacity_bytes,
        _total(groups[0]),
        groups[0],
        groups[1],
        spec.name,
        plan.block_size,
        spec.hybrid,
    )


def run_offline(
    policy: str,
    requests: Sequence[Request],
    capacity_bytes: int | None,
    spec: ModelSpec,
    block_size: int | None = None,
    store_output: bool = True,
    progress: Callable[[int, int], None] | None = None,
    plan: _Plan | None = None,
) -> OfflineResult:
    """``policy`` is one of :data:`OFFLINE_POLICIES`; ``plan``: :func:`offline_plan`, shared across
    capacities."""
    if policy not in OFFLINE_POLICIES:
        raise ReplayError(f"unknown offline policy {policy!r}; choose one of {list(OFFLINE_POLICIES)}")
    fn = reference if policy == "reference" else bound
    return fn(requests, capacity_bytes, spec, block_size, store_output, progress, plan)
