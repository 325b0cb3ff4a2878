"""What a simulated replay returns: additive ``Counters`` per workload and tenant (blocks and tokens hit,
usable behind a checkpoint, lost for lack of one, bytes written, evicted and read from SSD) and the
``SimResult`` that carries them with the run's eviction tallies and per-request columns, as the JSON
``kvpool replay``, the sweeps and pricing read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.workloads.chains import Chain
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.trace import Request
from kvpool.workloads.ttft import estimate


@dataclass(slots=True)
class Counters:
    """Additive tallies for one workload (or the total)."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    input_blocks: int = 0
    hit_blocks: int = 0  # MLA prefix run (Mooncake rule)
    usable_blocks: int = 0
    mla_hit_tokens: int = 0
    cached_tokens: int = 0  # usable prefix tokens (joint rule)
    lost_tokens: int = 0  # MLA-run tokens unusable for lack of a checkpoint
    mla_bytes_written: int = 0
    kda_bytes_written: int = 0
    checkpoints_written: int = 0
    bytes_evicted: int = 0  # of objects this workload / tenant wrote, whoever caused the eviction
    ssd_cached_tokens: int = 0  # usable-prefix tokens whose MLA block was read from the SSD tier
    ssd_bytes_read: int = 0  # MLA blocks and checkpoints of usable prefixes read from SSD (then promoted)

    def add_lookup(self, req: Request, chain: Chain, prefix_run: int, run: int, usable: int) -> int:
        """Count one request's lookup: ``prefix_run`` prompt blocks hit in a row (the Mooncake rule), ``run``
        of them within the lookup's cap, ``usable`` behind a checkpoint (what prefill skips). Returns the
        usable tokens. In place, field by field: the simulator counts every request."""
        sizes = chain.block_tokens
        usable_tokens = sum(sizes[:usable])
        self.requests += 1
        self.input_tokens += req.input_length
        self.output_tokens += req.output_length
        self.input_blocks += chain.prompt_blocks
        self.hit_blocks += prefix_run
        self.usable_blocks += usable
        self.mla_hit_tokens += sum(sizes[:prefix_run])
        self.cached_tokens += usable_tokens
        self.lost_tokens += sum(sizes[:run]) - usable_tokens
        return usable_tokens

    def add(self, other: Counters) -> None:
        for name in self.__slots__:  # type: ignore[attr-defined]
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        d["block_hit_rate"] = self.hit_blocks / self.input_blocks if self.input_blocks else 0.0
        d["usable_block_hit_rate"] = self.usable_blocks / self.input_blocks if self.input_blocks else 0.0
        d["token_hit_rate"] = self.cached_tokens / self.input_tokens if self.input_tokens else 0.0
        d["mla_token_hit_rate"] = self.mla_hit_tokens / self.input_tokens if self.input_tokens else 0.0
        d["lost_token_fraction"] = self.lost_tokens / self.input_tokens if self.input_tokens else 0.0
        d["dram_token_hit_rate"] = (
            (self.cached_tokens - self.ssd_cached_tokens) / self.input_tokens if self.input_tokens else 0.0
        )
        d["ssd_token_hit_rate"] = self.ssd_cached_tokens / self.input_tokens if self.input_tokens else 0.0
        return d


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    total: Counters
    per_workload: dict[str, Counters]
    per_tenant: dict[str, Counters]
    bytes_evicted: int
    objects_evicted: int
    objects_refused: int  # larger than the whole capacity, or the pool is full of pinned objects
    objects_demoted: int  # DRAM -> SSD moves (an SSD tier only)
    objects_not_admitted: int  # turned away by admission control (policy hybrid): the request ran uncached
    block_size: int  # tokens per block actually used
    bytes_held: int
    capacity_bytes: int | None
    duration_s: float  # trace time spanned (first to last arrival)
    per_request: dict[str, list[Any]]  # workload, arrival_ms, input, cached, output, dram/ssd bytes read
    shard_lookups: list[int]  # per master shard: prompts routed to it
    shard_bytes_written: list[int]  # per master shard: bytes its chains wrote
    hints: dict[str, int] = field(default_factory=dict)  # sim.HintTally: pins, pins_refused, sessions...
    pinned_bytes: int = 0  # index bytes still pinned at the end (in capacity units)
    pin_budget_earned: float = 1.0  # the least share of the pin budget a shard's pins had earned at the end

    def shards(self) -> dict[str, Any]:
        """Per-shard load and its spread (coefficient of variation = population stdev / mean; 0 = even)."""
        return {
            "count": self.config.shards.count,
            "depth": self.config.shards.depth,
            "lookups": self.shard_lookups,
            "bytes_written": self.shard_bytes_written,
            "lookup_cv": _cv(self.shard_lookups),
            "bytes_cv": _cv(self.shard_bytes_written),
        }

    def to_dict(self, per_request: bool = False) -> dict[str, Any]:
        c = self.config
        ttft = estimate(self.per_request, c.spec, c.ttft)
        out: dict[str, Any] = {
            "requests": self.total.requests,
            **self.total.to_dict(),
            "bytes_evicted": self.bytes_evicted,
            "objects_evicted": self.objects_evicted,
            "objects_refused": self.objects_refused,
            "objects_demoted": self.objects_demoted,
            "objects_not_admitted": self.objects_not_admitted,
            "bytes_held": self.bytes_held,
            "capacity_bytes": self.capacity_bytes,
            "duration_s": self.duration_s,
            "pins": self.hints.get("pins", 0),
            "pins_refused": self.hints.get("pins_refused", 0),
            "hints": {
                **self.hints,
                "pinned_bytes_at_end": self.pinned_bytes,
                "pin_budget_earned_at_end": round(self.pin_budget_earned, 3),
            },
            "config": {
                "spec": c.spec.name,
                "policy": c.policy,
                "capacity": c.capacity,
                "capacity_unit": c.capacity_unit,
                "block_size": self.block_size,
                "checkpoints": c.checkpoints.label,
                "hybrid": c.spec.hybrid,
                "high_watermark": c.high_watermark,
                "ssd_capacity": c.ssd_capacity,
                "low_watermark": c.low_watermark,
                "hints": c.hints,
            },
            "workloads": {
                w: {**s.to_dict(), **ttft["workloads"].get(w, {})}
                for w, s in sorted(self.per_workload.items())
            },
            "tenants": {t: s.to_dict() for t, s in sorted(self.per_tenant.items())},
            "shards": self.shards(),
            "ttft_model": ttft["model"],
            **ttft["summary"],
        }
        if per_request:
            out["per_request"] = {
                **self.per_request,
                "ttft_est_ms": [round(x, 3) for x in ttft["ttft_est_ms"]],
                "ttft_nocache_ms": [round(x, 3) for x in ttft["ttft_nocache_ms"]],
            }
        return out


def _cv(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    if not mean:
        return 0.0
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 / mean
