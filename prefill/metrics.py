"""Prometheus metrics of a prefill / decode worker (``--metrics-port``), one registry per process.

The servicers record one outcome per request (``PrefillService`` / ``DecodeService``), the step batcher
times each batched model call; everything else comes from the stats the engines already return
(``PrefillOutcome``, ``FetchStats``, ``PushStats``, ``DecodeResult``, ``ResumeInfo``). Served on the worker's
event loop by ``kvpool.kvstore.node_metrics.MetricsHttpServer``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds: 1 ms .. 60 s (a fetch is ms, a cold 8k-token prefill on CPU is seconds)
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


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
            "output pushes to the store: blocks, checkpoint, failed objects",
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
        for kind in ("blocks", "checkpoint", "failed"):
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
        self.pushed_bytes.inc(result.push.bytes_pushed)
        if info.store_error:
            self.cache_errors.labels("store_unreachable").inc()
        if result.push.failed:
            self.cache_errors.labels("push_failed").inc(result.push.failed)
        if info.path == "recompute":
            self.cache_errors.labels("recompute").inc()


class WorkerMetrics:
    """The registry of one worker process; ``prefill`` / ``decode`` present for the roles it serves."""

    def __init__(self, roles: tuple[str, ...], info: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.prefill = PrefillMetrics(self.registry) if "prefill" in roles else None
        self.decode = DecodeMetrics(self.registry) if "decode" in roles else None
        labels = {"role": "+".join(roles), **(info or {})}
        Gauge("kvpool_worker_info", "worker identity", list(labels), registry=self.registry).labels(
            **labels
        ).set(1)
