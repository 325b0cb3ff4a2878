"""The provider's question: which DRAM + SSD mix serves this workload at a target hit rate or TTFT for the
least money?

Every point of a grid (DRAM capacity x SSD capacity, SSD given as a multiple of DRAM) is one simulation
with the SSD tier (demote on eviction, promote on hit). Its cost over the trace's span is

    prefill compute of the uncached tokens (spec FLOPs at the GPU's FLOP/s x MFU, priced per GPU-hour)
    + DRAM GB-hours + SSD GB-hours (prices from the pricing profile file's [provider] table),

and its service level is the token hit rate and a TTFT quantile of ``workloads/ttft.py`` (the same GPU
FLOP/s and MFU, so the two views cannot disagree). The answer is the cheapest point that meets the
target, with the cheapest DRAM-only point beside it: how much an SSD tier saves is the difference.

Worked example (``docs/design/workloads.md``, provisioning): at K3 spec a conversation trace that needs
~100 GiB of DRAM for 10% token hit reaches it with far less DRAM over a 16x SSD, whose GB-hour costs
1/40 of DRAM's, as long as the TTFT target leaves room for 7 GB/s SSD reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.workloads.errors import ReplayError
from kvpool.workloads.parallel import run_points
from kvpool.workloads.pricing import PriceProfile, price_result
from kvpool.workloads.progress import PointProgress
from kvpool.workloads.provider_cost import ProviderInputs
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.trace import Request
from kvpool.workloads.ttft import TtftModel

QUANTILES = ("p50", "p90", "p99", "mean")


@dataclass(frozen=True, slots=True)
class Target:
    """What a mix must reach: a token hit rate, a TTFT quantile, or both (None: no constraint)."""

    token_hit: float | None = None
    ttft_ms: float | None = None
    quantile: str = "p90"

    def check(self) -> None:
        if self.token_hit is None and self.ttft_ms is None:
            raise ReplayError("give a target: --target-hit (0..1) and/or --target-ttft-ms")
        if self.token_hit is not None and not 0.0 <= self.token_hit <= 1.0:
            raise ReplayError(f"--target-hit is a fraction in [0, 1], got {self.token_hit!r}")
        if self.ttft_ms is not None and not self.ttft_ms > 0:
            raise ReplayError(f"--target-ttft-ms must be > 0, got {self.ttft_ms!r}")
        if self.quantile not in QUANTILES:
            raise ReplayError(
                f"unknown TTFT quantile {self.quantile!r}; choose one of {', '.join(QUANTILES)}"
            )

    def met(self, row: dict[str, Any]) -> bool:
        hit_ok = self.token_hit is None or row["token_hit_rate"] >= self.token_hit
        ttft_ok = self.ttft_ms is None or row["ttft_ms"] <= self.ttft_ms
        return hit_ok and ttft_ok


def mix_cost(
    spec: ModelSpec, provider: ProviderInputs, d: dict[str, Any], dram_bytes: int, ssd_bytes: int
) -> dict[str, float]:
    """Compute spent on the uncached tokens plus memory held, in USD over the simulated span."""
    hours = float(d["duration_s"]) / 3600
    compute = (
        provider.gpu_seconds(d["input_tokens"] - d["cached_tokens"], spec) / 3600 * provider.gpu_hour_usd
    )
    memory = (dram_bytes * provider.dram_gb_hour_usd + ssd_bytes * provider.ssd_gb_hour_usd) / 1e9 * hours
    return {"compute_usd": compute, "memory_usd": memory, "total_usd": compute + memory}


def provision(
    requests: Sequence[Request],
    spec: ModelSpec,
    dram_caps: Sequence[int],
    ssd_ratios: Sequence[float],
    provider: ProviderInputs,
    target: Target,
    ttft: TtftModel | None = None,
    policy: str = "hybrid",
    block_size: int | None = None,
    profile: PriceProfile | None = None,
    points: PointProgress | None = None,
    progress: Callable[[str], Callable[[int, int], None] | None] | None = None,
    jobs: int | None = 1,
) -> dict[str, Any]:
    """Simulate every (DRAM, SSD = ratio x DRAM) point (``jobs`` at once, in a process pool; None: the
    machine's cores); return the rows, the cheapest mix meeting ``target`` and the cheapest DRAM-only one
    (None where no point meets it)."""
    target.check()
    provider.check()
    if not dram_caps or not ssd_ratios:
        raise ReplayError("a provisioning grid needs at least one DRAM capacity and one SSD ratio")
    if any(r < 0 for r in ssd_ratios):
        raise ReplayError(f"SSD ratios must be >= 0, got {list(ssd_ratios)}")
    base = ttft or TtftModel()
    model = TtftModel(base.dram_gbps, base.ssd_gbps, base.network_gbps, provider.gpu_flops, provider.mfu)
    grid = [(dram, ratio) for dram in dram_caps for ratio in ssd_ratios]
    shared = (requests, spec, policy, block_size, model, provider, target, profile)
    if jobs == 1:  # here, with the per-request progress bars
        rows = []
        for dram, ratio in grid:
            if points is not None:
                points.begin()
            ssd = int(dram * ratio)
            bar = progress(f"{policy} {dram / 2**30:.0f}+{ssd / 2**30:.0f} GiB") if progress else None
            rows.append(_grid_point(shared, (dram, ratio), bar))
            if points is not None:
                points.finished(f"{policy} + SSD {ssd / 2**30:,.0f} GiB", dram)
    else:

        def done(_: int, row: dict[str, Any], seconds: float) -> None:
            if points is not None:
                label = f"{policy} + SSD {row['ssd_bytes'] / 2**30:,.0f} GiB"
                points.finished(label, row["dram_bytes"], seconds)

        rows = run_points(_grid_point, shared, grid, jobs, done)
    feasible = [r for r in rows if r["meets_target"]]
    dram_only = [r for r in feasible if r["ssd_bytes"] == 0]
    return {
        "target": {"token_hit": target.token_hit, "ttft_ms": target.ttft_ms, "quantile": target.quantile},
        "policy": policy,
        "ttft_model": {name: getattr(model, name) for name in model.__slots__},
        "rows": rows,
        "best": min(feasible, key=lambda r: r["total_usd"]) if feasible else None,
        "best_dram_only": min(dram_only, key=lambda r: r["total_usd"]) if dram_only else None,
    }


def _grid_point(
    shared: tuple[Any, ...], point: tuple[int, float], bar: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """One (DRAM, SSD ratio) point of the grid as its row: a whole simulation (one task of the pool)."""
    requests, spec, policy, block_size, model, provider, target, profile = shared
    dram, ratio = point
    ssd = int(dram * ratio)
    cfg = SimConfig(
        spec=spec, policy=policy, capacity=dram, block_size=block_size, ssd_capacity=ssd, ttft=model
    )
    d = simulate(requests, cfg, bar).to_dict(per_request=profile is not None)
    row = {
        "dram_bytes": dram,
        "ssd_bytes": ssd,
        "ssd_ratio": ratio,
        "token_hit_rate": d["token_hit_rate"],
        "dram_token_hit_rate": d["dram_token_hit_rate"],
        "ssd_token_hit_rate": d["ssd_token_hit_rate"],
        "ttft_ms": d[f"ttft_est_ms_{target.quantile}"],
        "ttft_nocache_ms": d[f"ttft_nocache_ms_{target.quantile}"],
        "duration_s": d["duration_s"],
        **mix_cost(spec, provider, d, dram, ssd),
    }
    if profile is not None:
        bill = price_result(profile, d)
        row["user_cost_usd"], row["user_savings_usd"] = bill["cost_usd"], bill["savings_usd"]
    row["meets_target"] = target.met(row)
    return row
