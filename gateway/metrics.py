"""Prometheus metrics of the gateway, labelled by workload and tenant.

Why token counters and not request ratios: the hit rate that matters is cached tokens / prompt tokens
(overview §6); Prometheus computes it per workload or tenant with ``rate(kvpool_cached_tokens_total[5m]) /
rate(kvpool_prompt_tokens_total[5m])``. Why a hashed tenant label: ``cache_salt`` is a secret that isolates
a tenant's cache; exporting it verbatim would hand it to anyone who can read /metrics. The label is the
first 8 hex digits of SHA-256(salt) (``"none"`` without a salt), or ``metadata.tenant`` when the client names
itself. Label sets are capped (``MAX_LABEL_VALUES`` per label, then ``"other"``) so a client cannot blow up
the series count. Store figures are refreshed from the master's ``Stats`` RPC: its levels as gauges, its
cumulative counts (evictions, evicted bytes, demotions) as counters named ``_total``, exposed from the last
snapshot by a collector (a Prometheus counter cannot be "set"). No ``_created`` series are exported: they
double the series count and no query here uses them.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator

from kvpool.proto import master_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

disable_created_metrics()

MAX_LABEL_VALUES = 64
_LABEL_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,48}$")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)


class LabelCap:
    """Maps free-form label values to at most ``limit`` distinct sanitized values."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str | None, default: str) -> str:
        if not value:
            return default
        if not _LABEL_RE.match(value):
            return "other"
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) >= self.limit:
                return "other"
            self._seen.add(value)
            return value


def tenant_label(salt: str | None) -> str:
    return hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()[:8] if salt else "none"


_STORE_COUNTERS = (
    ("kvpool_store_evictions", "evictions", "objects evicted since the master started"),
    ("kvpool_store_evicted_bytes", "evicted_bytes", "bytes evicted since the master started"),
    ("kvpool_store_demotions", "demotions", "objects moved DRAM -> SSD since the master started"),
)


class StoreCounters(Collector):
    """The master's cumulative counts from its last ``Stats`` snapshot, as counters (``..._total``)."""

    def __init__(self) -> None:
        self.stats: master_pb2.StatsReply | None = None

    def collect(self) -> Iterator[Metric]:
        for name, field, help_ in _STORE_COUNTERS:
            family = CounterMetricFamily(name, help_)
            if self.stats is not None:
                family.add_metric([], getattr(self.stats, field))
            yield family


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        wt = ("workload", "tenant")
        self.workload = LabelCap()
        self.tenant = LabelCap()
        self.requests = Counter(
            "kvpool_requests", "requests by outcome", ("workload", "tenant", "endpoint", "status"), registry=r
        )
        self.prompt_tokens = Counter("kvpool_prompt_tokens", "prompt tokens served", wt, registry=r)
        self.cached_tokens = Counter(
            "kvpool_cached_tokens", "prompt tokens reused from the store", wt, registry=r
        )
        self.lost_tokens = Counter(
            "kvpool_lost_to_checkpoint_tokens",
            "stored MLA tokens past the last KDA checkpoint (not reusable)",
            wt,
            registry=r,
        )
        self.recomputed_tokens = Counter(
            "kvpool_recomputed_tokens",
            "tokens promised by the master but missing/corrupt/late",
            wt,
            registry=r,
        )
        self.completion_tokens = Counter("kvpool_completion_tokens", "generated tokens", wt, registry=r)
        self.predicted_hit = Counter(
            "kvpool_router_predicted_hit_tokens",
            "cached tokens the router predicted",
            (*wt, "policy"),
            registry=r,
        )
        self.delivered_hit = Counter(
            "kvpool_router_delivered_hit_tokens",
            "cached tokens prefill delivered on routed requests",
            (*wt, "policy"),
            registry=r,
        )
        self.ttft = Histogram(
            "kvpool_ttft_seconds",
            "gateway-side time to first token",
            ("workload",),
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tps = Histogram(
            "kvpool_output_tokens_per_second",
            "per-request decode speed after the first token",
            ("workload",),
            buckets=TPS_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvpool_transfer_bytes", "store bytes moved by prefill", ("direction",), registry=r
        )
        self.retention = Counter(
            "kvpool_retention_requests",
            "requests with a retention hint, by tier and outcome (retained; refused: over the store's pin "
            "budget; none: nothing to pin, e.g. the store was away)",
            ("tier", "outcome"),
            registry=r,
        )
        self.retained_tokens = Counter(
            "kvpool_retained_tokens",
            "tokens pinned for the clients' retention hints (a request's: the most its prefill or decode "
            "kept, the prompt's and, retaining the whole prompt, the answer's full blocks)",
            ("tier",),
            registry=r,
        )
        self.transfer_failures = Counter(
            "kvpool_transfer_failures",
            "requests whose cache fetch fell back or whose store was unreachable",
            ("kind",),
            registry=r,
        )
        self.rejected = Counter(
            "kvpool_admission_rejected", "requests refused with 429", ("reason",), registry=r
        )
        self.worker_failures = Counter(
            "kvpool_worker_failures", "calls a worker failed", ("role", "worker"), registry=r
        )
        self.inflight = Gauge("kvpool_inflight_requests", "requests in the gateway", registry=r)
        self.worker_queued = Gauge(
            "kvpool_worker_queued_tokens", "tokens dispatched, not answered", ("role", "worker"), registry=r
        )
        self.store_bytes = Gauge(
            "kvpool_store_bytes", "bytes held by the store per tier", ("tier",), registry=r
        )
        self.store_objects = Gauge("kvpool_store_objects", "objects indexed by the master", registry=r)
        self.store_capacity = Gauge("kvpool_store_capacity_bytes", "capacity of all nodes", registry=r)
        self.store_counters = StoreCounters()
        r.register(self.store_counters)
        self.store_up = Gauge("kvpool_store_up", "1 when the master answered the last Stats call", registry=r)

    def labels(self, workload: str | None, tenant: str | None) -> tuple[str, str]:
        return self.workload(workload, "default"), self.tenant(tenant, "none")

    def update_store(self, stats: master_pb2.StatsReply | None) -> None:
        self.store_up.set(0 if stats is None else 1)
        if stats is None:
            return
        for tier, n in stats.bytes_per_tier.items():
            self.store_bytes.labels(tier=tier).set(n)
        self.store_objects.set(stats.objects)
        self.store_capacity.set(stats.capacity_bytes)
        self.store_counters.stats = stats
