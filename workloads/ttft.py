"""A TTFT estimate per simulated request: load the usable prefix from its tier, recompute the rest.

The simulator knows, per request, how many prompt tokens were usable from the cache and how many bytes of
that prefix (MLA blocks + the checkpoint closing it) sat in DRAM and on SSD. Time to first token is then

    ttft = dram_bytes / min(dram, network) + ssd_bytes / min(ssd, network)
           + (input - cached) x prefill FLOPs/token / (GPU FLOP/s x MFU)

(loads and compute in series: no layer-wise overlap, so an upper estimate for a hit). The uncached
baseline is ``input x FLOPs/token / (GPU FLOP/s x MFU)``. FLOPs/token is the spec's linear part (2 x
active parameters; attention grows with context and is left out), so long prompts' recompute is
under-stated and the estimate favours *not* caching: the saving it reports is a floor.

The defaults below are the stated assumptions (a node of an H200-class prefill fleet); every one is a
``kvpool replay`` flag:

- ``dram_gbps`` 200: DDR5 memory bandwidth of a storage node (rarely the bound);
- ``network_gbps`` 50: one 400 Gb/s RDMA NIC per prefill GPU (the bound for a remote DRAM hit);
- ``ssd_gbps`` 7: one PCIe Gen4 NVMe drive's sequential read;
- ``gpu_flops`` 989e12 (H100/H200 dense bf16) at ``mfu`` 0.40, as the provider view of the pricing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.workloads.errors import ReplayError
from kvpool.workloads.pricing import ProviderDefaults
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.stats import percentile

GB = 1e9
_PROVIDER = ProviderDefaults()


@dataclass(frozen=True, slots=True)
class TtftModel:
    """Tier bandwidths (GB/s) and prefill compute rate; see the module docstring for the defaults."""

    dram_gbps: float = 200.0
    ssd_gbps: float = 7.0
    network_gbps: float = 50.0
    gpu_flops: float = _PROVIDER.gpu_flops  # one source with the provider view of the pricing
    mfu: float = _PROVIDER.mfu

    def check(self) -> None:
        for name in self.__slots__:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ReplayError(f"TTFT model: {name} must be a finite number > 0, got {v!r}")
        if self.mfu > 1:
            raise ReplayError(f"TTFT model: mfu must be in (0, 1], got {self.mfu!r}")

    def recompute_s(self, tokens: int, spec: ModelSpec) -> float:
        return tokens * spec.prefill_flops_per_token / (self.gpu_flops * self.mfu)

    def load_s(self, dram_bytes: int, ssd_bytes: int) -> float:
        net = self.network_gbps * GB
        return dram_bytes / min(self.dram_gbps * GB, net) + ssd_bytes / min(self.ssd_gbps * GB, net)

    def ttft_ms(
        self, spec: ModelSpec, input_tokens: int, cached: int, dram_bytes: int, ssd_bytes: int
    ) -> float:
        """One request's estimate with the cache (ms)."""
        return 1000.0 * (self.load_s(dram_bytes, ssd_bytes) + self.recompute_s(input_tokens - cached, spec))


def summarize(with_cache: Sequence[float], without: Sequence[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 of the estimates with and without the cache (ms)."""
    a, b = with_cache, without
    n = len(a)
    out = {
        "ttft_est_ms_mean": sum(a) / n if n else 0.0,
        "ttft_nocache_ms_mean": sum(b) / n if n else 0.0,
    }
    for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        out[f"ttft_est_ms_{name}"] = percentile(a, q)
        out[f"ttft_nocache_ms_{name}"] = percentile(b, q)
    return out


def estimate(per_request: dict[str, list[Any]], spec: ModelSpec, model: TtftModel) -> dict[str, Any]:
    """Per-request estimates (``ttft_est_ms``, ``ttft_nocache_ms``) and their summaries, overall and per
    workload, from a simulation's ``per_request`` columns (input, cached, dram_bytes, ssd_bytes)."""
    model.check()
    cols = ("input", "cached", "dram_bytes", "ssd_bytes")
    missing = [c for c in cols if c not in per_request]
    if missing:
        raise ReplayError(f"per-request detail lacks {missing} (a simulation result is needed)")
    est = [
        model.ttft_ms(spec, i, c, d, s) for i, c, d, s in zip(*(per_request[c] for c in cols), strict=True)
    ]
    base = [1000.0 * model.recompute_s(i, spec) for i in per_request["input"]]
    by_wl: dict[str, tuple[list[float], list[float]]] = {}
    for w, e, b in zip(per_request.get("workload", ["trace"] * len(est)), est, base, strict=True):
        pair = by_wl.setdefault(w, ([], []))
        pair[0].append(e)
        pair[1].append(b)
    return {
        "ttft_est_ms": est,
        "ttft_nocache_ms": base,
        "summary": summarize(est, base),
        "workloads": {w: summarize(*pair) for w, pair in sorted(by_wl.items())},
        "model": {name: getattr(model, name) for name in model.__slots__},
    }
