"""The provider's view of a cache: prefill FLOPs a hit saves (spec FLOPs/token x cached tokens) at a GPU's
FLOP/s x MFU, priced at $/GPU-hour, against DRAM/SSD GB-hours of the cache capacity; over a capacity
sweep, the capacity minimising compute + memory cost (``best_capacity``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.workloads.errors import PricingError
from kvpool.workloads.pricing import token_count
from kvpool.workloads.specs import ModelSpec


@dataclass(frozen=True, slots=True)
class ProviderInputs:
    gpu_hour_usd: float
    gpu_flops: float
    mfu: float
    dram_gb_hour_usd: float
    ssd_gb_hour_usd: float

    def check(self) -> None:
        for name in self.__slots__:  # type: ignore[attr-defined]
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise PricingError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.gpu_flops <= 0 or self.mfu <= 0 or self.mfu > 1:
            raise PricingError("gpu_flops must be > 0 and mfu in (0, 1]")

    def gpu_seconds(self, tokens: float, spec: ModelSpec) -> float:
        return tokens * spec.prefill_flops_per_token / (self.gpu_flops * self.mfu)


def provider_view(
    spec: ModelSpec,
    inputs: ProviderInputs,
    input_tokens: int,
    cached_tokens: int,
    capacity_bytes: int,
    hours: float,
    tier: str = "dram",
) -> dict[str, Any]:
    """Compute saved by hits vs memory held for the cache, both in USD over ``hours``."""
    inputs.check()
    token_count("input tokens", input_tokens)
    token_count("cached tokens", cached_tokens)
    if cached_tokens > input_tokens:
        raise PricingError("cached tokens cannot exceed input tokens")
    if tier not in ("dram", "ssd"):
        raise PricingError("tier must be dram or ssd")
    if not math.isfinite(hours) or hours < 0 or capacity_bytes < 0:
        raise PricingError("hours and capacity must be >= 0")
    gb_hour = inputs.dram_gb_hour_usd if tier == "dram" else inputs.ssd_gb_hour_usd
    saved_s = inputs.gpu_seconds(cached_tokens, spec)
    spent_s = inputs.gpu_seconds(input_tokens - cached_tokens, spec)
    saved_usd = saved_s / 3600 * inputs.gpu_hour_usd
    storage_usd = capacity_bytes / 1e9 * hours * gb_hour
    return {
        "spec": spec.name,
        "tier": tier,
        "capacity_gb": capacity_bytes / 1e9,
        "hours": hours,
        "prefill_gpu_hours_saved": saved_s / 3600,
        "prefill_gpu_hours_spent": spent_s / 3600,
        "compute_saved_usd": saved_usd,
        "compute_spent_usd": spent_s / 3600 * inputs.gpu_hour_usd,
        "storage_usd": storage_usd,
        "net_saving_usd": saved_usd - storage_usd,
        "total_cost_usd": spent_s / 3600 * inputs.gpu_hour_usd + storage_usd,
    }


def best_capacity(
    spec: ModelSpec, inputs: ProviderInputs, rows: Sequence[dict[str, Any]], tier: str = "dram"
) -> dict[str, Any]:
    """The sweep row minimising prefill compute + memory cost. Rows need ``capacity_bytes``,
    ``input_tokens``, ``cached_tokens`` and ``duration_s`` (one policy's capacity sweep)."""
    if not rows:
        raise PricingError("no sweep rows to choose a capacity from")
    views = []
    for row in rows:
        try:
            v = provider_view(spec, inputs, int(row["input_tokens"]), int(row["cached_tokens"]),
                              int(row["capacity_bytes"]), float(row["duration_s"]) / 3600, tier)  # fmt: skip
        except KeyError as e:
            raise PricingError(f"sweep row lacks {e.args[0]!r}") from None
        views.append(v)
    best = min(views, key=lambda v: v["total_cost_usd"])
    return {"best": best, "candidates": views}
