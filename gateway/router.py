"""Choosing the prefill and decode worker of a request, and admission control.

Policies (``--routing``):

* ``cache`` — ask the master how much of the prompt is reusable (``MatchPrefix(counts_only=true)``: usable
  blocks under the joint MLA+KDA rule, how many of them sit on SSD), then estimate each prefill worker's TTFT
  as ``(queued tokens + uncached tokens) x compute s/token + DRAM hits x dram s/token + SSD hits x ssd
  s/token`` and pick the cheapest. SSD hits are credited less than DRAM hits because they cost a read.
  Decode goes to the worker with the smallest outstanding output budget.
* ``rr`` — round-robin over healthy workers for both roles, no lookup (the baseline the bench compares).

The store is shared, so the *reusable* prefix is the same whichever prefill worker runs the request; what the
lookup buys is (a) an honest estimate of the work (a 90 %-cached 4k prompt costs less queue than a cold 1k
one) so load balancing weighs requests by what they will cost, and (b) admission: when even the cheapest
worker's estimated TTFT is past ``--ttft-slo-s`` the request is refused with 429 instead of queueing.
The compute cost per token is learned online (EWMA of ``ttft / computed tokens`` from prefill replies).

A failed lookup degrades to "nothing cached" (routing by queue alone); it never fails the request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

from kvpool.cache.hashing import hash_blocks, root_hash
from kvpool.gateway.errors import BackendUnavailable, Overloaded
from kvpool.gateway.workers import Worker, WorkerPool
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.protocol.master_link import MasterLink
from kvpool.kvstore.shards import DEFAULT_DEPTH, ShardSet, master_groups
from kvpool.proto import master_pb2

log = logging.getLogger("kvpool.gateway")
POLICIES = ("cache", "rr")


@dataclass
class CostModel:
    """Seconds per token; priors from docs/design/prefill_decode.md §6 (tiny model, 1 thread)."""

    compute_s: float = 2.2e-4
    dram_hit_s: float = 1.5e-5
    ssd_hit_s: float = 6e-5
    alpha: float = 0.2  # EWMA weight of a new observation

    def observe(self, computed_tokens: int, ttft_s: float) -> None:
        if computed_tokens >= 64 and ttft_s > 0:
            self.compute_s += self.alpha * (ttft_s / computed_tokens - self.compute_s)

    def estimate(self, queued: int, prompt: int, cached: int, ssd: int) -> float:
        return (
            (queued + prompt - cached) * self.compute_s
            + (cached - ssd) * self.dram_hit_s
            + ssd * self.ssd_hit_s
        )


@dataclass
class Lookup:
    cached_tokens: int = 0  # usable prefix the router expects prefill to reuse
    ssd_tokens: int = 0
    lost_tokens: int = 0  # MLA run past the last checkpoint (not reusable)
    ok: bool = True


@dataclass
class Plan:
    prefill: Worker
    decode: Worker
    predicted_cached: int | None  # None under round-robin (no lookup)
    estimated_ttft_s: float
    dispatched_tokens: int


class PrefixProbe:
    """``MatchPrefix(counts_only=true)`` against the master under a short deadline.

    Goes through ``MasterLink`` (the master wire, under this probe's short deadline): the gateway pays it
    once per request before routing. With master shards it asks the shard that owns the prompt's chain,
    routed by the same function as the workers (``kvstore/shards.py``); the store figures are shard 0's.
    """

    def __init__(
        self,
        master: str | None,
        fingerprint: bytes,
        block_size: int,
        timeout_s: float = 0.5,
        shard_depth: int = DEFAULT_DEPTH,
    ) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.master = master
        self.groups = master_groups(master) if master else []
        self.shards = ShardSet(max(len(self.groups), 1), shard_depth)
        self.links: list[MasterLink] = []

    @property
    def link(self) -> MasterLink | None:
        return self.links[0] if self.links else None

    def connect(self) -> PrefixProbe:
        """Make the links (inside the serving event loop: their connections are bound to their loop)."""
        self.links = [MasterLink(group, self.timeout_s) for group in self.groups]
        return self

    async def lookup(self, prompt: list[int], tenant: str) -> Lookup:
        B = self.block_size
        n = (len(prompt) - 1) // B  # prefill always computes the last token: at most (L-1)//B blocks reused
        if not self.links or n <= 0:
            return Lookup(ok=bool(self.links))
        chain = hash_blocks(prompt[: len(prompt) // B * B], B, root_hash(self.fingerprint, tenant))
        route = self.shards.route_of_chain(chain)  # the whole prompt's, as prefill routes it
        sharded = self.shards.sharded
        try:
            r = await self.links[self.shards.shard_of_route(route)].call(
                "MatchPrefix",
                master_pb2.MatchPrefixRequest(
                    block_hashes=chain[:n],
                    tenant=tenant,
                    require_checkpoint=True,
                    counts_only=True,
                    route=route if sharded else b"",
                    shard_set=str(self.shards) if sharded else "",
                ),
            )
        except StoreError as exc:
            log.warning("MatchPrefix failed (%s); routing as if nothing were cached", exc)
            return Lookup(ok=False)
        return Lookup(
            cached_tokens=r.usable_blocks * B,
            ssd_tokens=r.usable_blocks_on_ssd * B,
            lost_tokens=max(r.mla_run_blocks - r.usable_blocks, 0) * B,
        )

    async def stats(self) -> master_pb2.StatsReply | None:
        if self.link is None:
            return None
        try:
            return await self.link.stats(master_pb2.StatsRequest())
        except StoreError:
            return None

    async def end_session(self, tenant: str, session: str) -> int:
        """Release every pin a client's session holds, on every master shard (its chains route anywhere);
        ``StoreError`` when a shard cannot be told: the others may have released theirs already, which a retry
        repeats harmlessly, and what stays pinned expires by its TTL."""
        if not self.links:
            raise StoreError("this gateway has no master (--master): there is no cache to release")
        request = master_pb2.PinRequest(session=session, end_session=True, tenant=tenant)
        replies = await asyncio.gather(*(link.pin(request) for link in self.links))
        return sum(r.pinned for r in replies)

    async def close(self) -> None:
        for link in self.links:
            await link.close()


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        probe: PrefixProbe,
        policy: str = "cache",
        ttft_slo_s: float = 0.0,
        cost: CostModel | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.pool = pool
        self.probe = probe
        self.policy = policy
        self.ttft_slo_s = ttft_slo_s
        self.cost = cost or CostModel()
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()

    def _candidates(self, role: str, exclude: set[str]) -> list[Worker]:
        workers = [w for w in self.pool.available(role) if w.address not in exclude]
        if not workers:
            raise BackendUnavailable(f"no healthy {role} worker")
        return workers

    async def plan(
        self,
        prompt: list[int],
        tenant: str,
        max_tokens: int,
        exclude: set[str] | frozenset[str] = frozenset(),
    ) -> tuple[Plan, Lookup | None]:
        """Pick workers (raises 503 when a role has none healthy, 429 when past the TTFT SLO)."""
        prefills = self._candidates("prefill", set(exclude))
        decodes = self._candidates("decode", set(exclude))
        L = len(prompt)
        if self.policy == "rr":
            p = prefills[next(self._rr_prefill) % len(prefills)]
            d = decodes[next(self._rr_decode) % len(decodes)]
            est = self.cost.estimate(p.queued_tokens, L, 0, 0)
            return Plan(p, d, None, est, L), None
        look = await self.probe.lookup(prompt, tenant)
        scored = [
            (self.cost.estimate(w.queued_tokens, L, look.cached_tokens, look.ssd_tokens), w.inflight, i, w)
            for i, w in enumerate(prefills)
        ]
        est, _, _, p = min(scored, key=lambda s: s[:3])
        if self.ttft_slo_s > 0 and est > self.ttft_slo_s and p.inflight > 0:
            raise Overloaded(
                f"estimated time to first token {est:.2f}s exceeds the SLO of {self.ttft_slo_s:.2f}s; "
                "retry later"
            )
        d = min(decodes, key=lambda w: (w.queued_tokens, w.inflight))
        return Plan(p, d, look.cached_tokens, est, max(L - look.cached_tokens, 0)), look

    def pick_decode(self, exclude: set[str]) -> Worker:
        decodes = self._candidates("decode", exclude)
        if self.policy == "rr":
            return decodes[next(self._rr_decode) % len(decodes)]
        return min(decodes, key=lambda w: (w.queued_tokens, w.inflight))
