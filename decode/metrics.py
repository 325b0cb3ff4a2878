"""Prometheus metrics of a decode worker: one outcome per request, the batched model steps, resume paths.

Registered on the worker process's registry (``kvpool.worker.metrics.worker_registry``).
"""

from __future__ import annotations

from kvpool.worker.metrics import BATCH_SIZES, SECONDS, STEP_SECONDS
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "kvpool_decode_"
        self.requests = Counter(p + "requests", "decode requests by outcome", ["status"], registry=registry)
        self.output_tokens = Counter(
            p + "output_tokens", "tokens streamed (the first one included)", registry=registry
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of the handoffs", registry=registry)
        self.step_seconds = Histogram(
            p + "step_seconds",
            "one batched decode step (model call)",
            buckets=STEP_SECONDS,
            registry=registry,
        )
        self.batch_size = Histogram(
            p + "batch_size", "requests per batched decode step", buckets=BATCH_SIZES, registry=registry
        )
        self.request_seconds = Histogram(
            p + "request_seconds",
            "resume + decode + pushes of one request",
            buckets=SECONDS,
            registry=registry,
        )
        self.active = Gauge(p + "active_requests", "requests being decoded now", registry=registry)
        self.resumes = Counter(
            p + "resumes",
            "how the state was rebuilt: tail (store), recompute, state",
            ["path"],
            registry=registry,
        )
        self.recomputed_tokens = Counter(
            p + "recomputed_tokens",
            "prompt tokens decode computed itself (tail/blocks unusable)",
            registry=registry,
        )
        self.pushes = Counter(
            p + "pushes",
            "output pushes to the store: blocks, checkpoint, failed and not-admitted objects",
            ["kind"],
            registry=registry,
        )
        self.pushed_bytes = Counter(
            p + "pushed_bytes", "bytes of output blocks + checkpoints", registry=registry
        )
        self.cache_errors = Counter(
            p + "cache_errors",
            "store problems: store_unreachable, push_failed, recompute",
            ["kind"],
            registry=registry,
        )
        for status in ("ok", "bad_request", "cache_fetch_failed", "timeout", "cancelled", "error"):
            self.requests.labels(status)
        for kind in ("blocks", "checkpoint", "failed", "not_admitted"):
            self.pushes.labels(kind)
        for kind in ("store_unreachable", "push_failed", "recompute"):
            self.cache_errors.labels(kind)

    def on_step(self, batch: int, seconds: float) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch)

    def observe(self, result) -> None:  # type: ignore[no-untyped-def]  # DecodeResult
        self.requests.labels("ok").inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.request_seconds.observe(result.decode_s)
        info = result.resume
        self.resumes.labels(info.path or "unknown").inc()
        self.recomputed_tokens.inc(info.recomputed_tokens)
        self.pushes.labels("blocks").inc(result.blocks_pushed)
        if result.checkpoint_pushed:
            self.pushes.labels("checkpoint").inc()
        self.pushes.labels("failed").inc(result.push.failed)
        self.pushes.labels("not_admitted").inc(result.push.not_admitted)
        self.pushed_bytes.inc(result.push.bytes_pushed)
        if info.store_error:
            self.cache_errors.labels("store_unreachable").inc()
        if result.push.failed:
            self.cache_errors.labels("push_failed").inc(result.push.failed)
        if info.path == "recompute":
            self.cache_errors.labels("recompute").inc()
