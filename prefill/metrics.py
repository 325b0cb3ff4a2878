"""Prometheus metrics of a prefill / decode worker (``--metrics-port``), one registry per process.

The servicers record one outcome per request (``PrefillService`` / ``DecodeService``), the step batcher
times each batched model call; everything else comes from the stats the engines already return
(``PrefillOutcome``, ``FetchStats``, ``PushStats``, ``DecodeResult``, ``ResumeInfo``). Served on the worker's
event loop by ``kvpool.runtime.metrics_http.MetricsHttpServer``.
"""

from __future__ import annotations

from kvpool.worker.metrics import SECONDS
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "kvpool_prefill_"
        self.requests = Counter(p + "requests", "prefill requests by outcome", ["status"], registry=registry)
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "prompt tokens of served requests", registry=registry
        )
        self.cached_tokens = Counter(
            p + "cached_tokens", "prompt tokens resumed from the store (not computed)", registry=registry
        )
        self.computed_tokens = Counter(p + "computed_tokens", "prompt tokens computed", registry=registry)
        self.lost_to_checkpoint = Counter(
            p + "lost_to_checkpoint_tokens",
            "tokens of stored MLA blocks unusable for lack of a KDA checkpoint",
            registry=registry,
        )
        self.recomputed_tokens = Counter(
            p + "recomputed_tokens",
            "tokens the master promised but missing/corrupt/late objects forced to recompute",
            registry=registry,
        )
        self.fetch_seconds = Histogram(
            p + "fetch_seconds", "store fetch of the reused prefix", buckets=SECONDS, registry=registry
        )
        self.compute_seconds = Histogram(
            p + "compute_seconds", "model compute of the uncached tokens", buckets=SECONDS, registry=registry
        )
        self.push_seconds = Histogram(
            p + "push_seconds",
            "pushes of blocks, checkpoints and tail (wall)",
            buckets=SECONDS,
            registry=registry,
        )
        self.ttft_seconds = Histogram(
            p + "ttft_seconds",
            "request start -> first token known (before pushes)",
            buckets=SECONDS,
            registry=registry,
        )
        self.transfer_bytes = Counter(
            p + "transfer_bytes", "store bytes moved", ["direction"], registry=registry
        )
        self.pushed_objects = Counter(p + "pushed_objects", "objects pushed to the store", registry=registry)
        self.not_admitted = Counter(
            p + "objects_not_admitted",
            "objects the store's admission control turned away (served; not cached)",
            registry=registry,
        )
        self.checkpoints = Counter(
            p + "checkpoints_pushed", "KDA checkpoints written (policy boundaries)", registry=registry
        )
        self.cache_errors = Counter(
            p + "cache_errors",
            "cache problems: missing / corrupt / late units, fallbacks, store_unreachable, push_failed",
            ["kind"],
            registry=registry,
        )
        self.queue_depth = Gauge(
            p + "queue_depth",
            "prefill requests in the worker (waiting for or using the model)",
            registry=registry,
        )
        for status in ("ok", "bad_request", "cache_fetch_failed", "timeout", "error"):
            self.requests.labels(status)
        for kind in ("missing", "corrupt", "late", "fallback", "store_unreachable", "push_failed"):
            self.cache_errors.labels(kind)
        for d in ("fetched", "pushed"):
            self.transfer_bytes.labels(d)

    def observe(self, outcome) -> None:  # type: ignore[no-untyped-def]  # PrefillOutcome
        f, push = outcome.fetch, outcome.push
        self.requests.labels("ok").inc()
        self.prompt_tokens.inc(len(outcome.handoff.prompt_ids))
        self.cached_tokens.inc(outcome.cached_tokens)
        self.computed_tokens.inc(outcome.computed_tokens)
        self.lost_to_checkpoint.inc(outcome.lost_to_checkpoint)
        self.recomputed_tokens.inc(outcome.recomputed_tokens)
        self.fetch_seconds.observe(f.seconds)
        self.compute_seconds.observe(outcome.compute_s)
        self.push_seconds.observe(push.seconds)
        self.ttft_seconds.observe(outcome.ttft_s)
        self.transfer_bytes.labels("fetched").inc(f.bytes_fetched)
        self.transfer_bytes.labels("pushed").inc(push.bytes_pushed)
        self.pushed_objects.inc(push.objects)
        self.not_admitted.inc(push.not_admitted)
        self.checkpoints.inc(len(outcome.checkpoints_pushed))
        for kind, n in (
            ("missing", f.missing),
            ("corrupt", f.corrupt),
            ("late", f.late),
            ("fallback", f.fallbacks),
            ("store_unreachable", 1 if f.error else 0),
            ("push_failed", push.failed),
        ):
            if n:
                self.cache_errors.labels(kind).inc(n)
