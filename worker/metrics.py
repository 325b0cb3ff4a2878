"""What every worker process's metrics share: histogram buckets and the process registry with its info gauge.

One registry per process (never prometheus_client's global default), so tests that run several workers in
one interpreter do not mix their series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

# seconds: 1 ms .. 60 s (a fetch is ms, a cold 8k-token prefill on CPU is seconds)
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def worker_registry(roles: tuple[str, ...], info: dict[str, str] | None = None) -> CollectorRegistry:
    """A fresh registry carrying ``kvpool_worker_info{role=...}`` for the roles this process serves."""
    registry = CollectorRegistry(auto_describe=True)
    labels = {"role": "+".join(roles), **(info or {})}
    Gauge("kvpool_worker_info", "worker identity", list(labels), registry=registry).labels(**labels).set(1)
    return registry
