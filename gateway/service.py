"""One generation through the cluster: route, prefill (retrying elsewhere if a worker is gone), decode stream.

``start`` returns as soon as prefill has answered: its reply carries output token 0 and that token's text,
so the client gets the first token without waiting for decode to resume the request. Until then every
failure can still become a proper HTTP status (400/429/503/504) even for a streaming request. Decode is
asked at once (its resume overlaps the first token's delivery); a decode worker that is gone before its
first chunk is replaced like a prefill worker, and any later decode failure ends a stream with an error
event (a JSON answer, not yet sent, still gets its status). Every RPC carries the time left of the
request's deadline, so a dead or stuck worker turns into an error within ``request_timeout_s``, never a hang.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from kvpool.gateway.cache_hints import CacheHints
from kvpool.gateway.errors import BackendTimeout, BackendUnavailable, GatewayError, InvalidRequest, Overloaded
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.router import Lookup, Plan, Router
from kvpool.gateway.workers import Worker
from kvpool.proto import decode_pb2, prefill_pb2
from kvpool.worker.client import first_chunk, run_prefill, start_decode
from kvpool.worker.handoff import PrefillRequest
from kvpool.worker.sampling import SamplingParams

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


@dataclass
class GenRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    salt: str = ""
    workload: str = "default"
    tenant: str = "none"
    endpoint: str = "completions"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    hints: CacheHints = field(default_factory=CacheHints)  # the client's retention hints, checked


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = "length"
    extra: dict = field(default_factory=dict)  # kvpool-specific: workers, predicted hit, lost tokens

    def openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def rpc_error(exc: grpc.aio.AioRpcError, w: Worker) -> GatewayError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details.removeprefix("BadRequestError: "))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BackendTimeout(f"{w.role} worker {w.address} did not answer in time")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"{w.role} worker {w.address} is out of resources: {details}")
    return BackendUnavailable(f"{w.role} worker {w.address} failed: {code.name}: {details}")


class Generation:
    """A started generation: prefill has answered (``first`` is output token 0) and decode is asked; iterate
    ``chunks`` for every token, then read ``usage``."""

    def __init__(
        self,
        svc: Dispatcher,
        req: GenRequest,
        plan: Plan,
        look: Lookup | None,
        reply: prefill_pb2.PrefillReply,
        t0: float,
        deadline: float,
    ) -> None:
        self.svc, self.req, self.plan, self.look, self.reply = svc, req, plan, look, reply
        self.t0, self.deadline = t0, deadline
        self.first = first_chunk(reply)
        self.t_first = time.monotonic()
        self.token_ids: list[int] = []
        self.usage = Usage(prompt_tokens=len(req.prompt_ids), cached_tokens=reply.usage.cached_tokens)
        # the retention hints' pins: prefill's (the prompt's spans), then decode's (its answer's chain) joins
        self.retained_tokens = reply.usage.retained_tokens
        self.retention_refused = reply.usage.retention_refused
        self._closed = False
        self._excluded: set[str] = set()
        self._open(plan.decode, svc.left(deadline, "decode"))

    def _open(self, decode: Worker, timeout_s: float) -> None:
        """Ask ``decode`` for tokens 1 on (the call goes out now; its answer is read in ``chunks``)."""
        self.decode = decode
        decode.inflight += 1
        decode.queued_tokens += self.req.sampling.max_tokens
        self.call = start_decode(decode.stub, self.reply, timeout_s)  # type: ignore[arg-type]

    def _drop(self) -> None:
        self.call.cancel()  # no-op once finished; frees decode on disconnect
        self.decode.inflight -= 1
        self.decode.queued_tokens -= self.req.sampling.max_tokens

    async def _read(self, started: bool) -> decode_pb2.GenerateChunk:
        """The next decode chunk; before decode's first one an UNAVAILABLE worker is replaced."""
        while True:
            try:
                chunk = await self.call.read()  # type: ignore[attr-defined]
            except grpc.aio.AioRpcError as exc:
                if started or exc.code() not in RETRYABLE:
                    if started:
                        self.decode.mark_failed()
                    raise rpc_error(exc, self.decode) from None
                self.decode.mark_failed()
                self.svc.metrics.worker_failures.labels(role="decode", worker=self.decode.address).inc()
                self._excluded.add(self.decode.address)
                # a raise here leaves the current call to close()
                replacement = self.svc.router.pick_decode(self._excluded)
                timeout_s = self.svc.left(self.deadline, "decode")
                self._drop()
                self._open(replacement, timeout_s)
                continue
            if chunk is grpc.aio.EOF:
                what = "ended the stream early" if started else "sent nothing"
                raise BackendUnavailable(f"decode worker {self.decode.address} {what}")
            if not started:
                self.decode.served += 1
            return chunk

    async def chunks(self) -> AsyncIterator[decode_pb2.GenerateChunk]:
        """Token chunks (text deltas), token 0 first; the final chunk is consumed here and fills ``usage``."""
        chunk, started = self.first, False
        try:
            while not chunk.final:
                self.token_ids.append(chunk.token_id)
                yield chunk
                chunk = await self._read(started)
                started = True
            self._finish(chunk)
        finally:
            self.close()

    def _finish(self, final: decode_pb2.GenerateChunk) -> None:
        u, p, d = self.usage, self.reply.usage, final.usage
        u.completion_tokens = final.usage.completion_tokens or len(self.token_ids)
        u.finish_reason = final.finish_reason or "length"
        u.extra = {
            "prefill_worker": self.plan.prefill.address,
            "decode_worker": self.decode.address,
            "predicted_cached_tokens": self.plan.predicted_cached,
            "lost_to_checkpoint_tokens": p.lost_to_checkpoint_tokens,
            "recomputed_tokens": p.recomputed_tokens,
            "prefill_ttft_s": round(p.ttft_s, 6),
            "ttft_s": round(self.t_first - self.t0, 6),
            "cache_error": p.cache_error or None,
        }
        # what either side kept pinned, the most of the two (decode's chain extends prefill's whole prompt);
        # refused if either was
        self.retained_tokens = max(self.retained_tokens, d.retained_tokens)
        self.retention_refused = self.retention_refused or d.retention_refused
        if self.req.hints.retain:
            u.extra["retention"] = {
                "tier": self.req.hints.tier,
                "retained_tokens": self.retained_tokens,
                "refused": self.retention_refused,
            }
        self.svc.record(self, time.monotonic())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._drop()


class Dispatcher:
    """Starts each generation on the workers: plans it (router), calls prefill (retrying elsewhere when a
    worker is gone) and opens decode, every call bounded by the time left of the request's deadline."""

    def __init__(self, router: Router, metrics: GatewayMetrics, request_timeout_s: float = 60.0) -> None:
        self.router = router
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s

    def left(self, deadline: float, what: str) -> float:
        """Seconds left of the request's deadline for the call ``what``; ``BackendTimeout`` when none."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise BackendTimeout(f"request deadline ({self.request_timeout_s:.0f}s) passed before {what}")
        return left

    async def start(self, req: GenRequest) -> Generation:
        t0 = time.monotonic()
        deadline = t0 + self.request_timeout_s
        reply, plan, look = await self._prefill(req, deadline)
        return Generation(self, req, plan, look, reply, t0, deadline)

    async def _prefill(
        self, req: GenRequest, deadline: float
    ) -> tuple[prefill_pb2.PrefillReply, Plan, Lookup | None]:
        excluded: set[str] = set()
        attempt = 0
        while True:
            plan, look = await self.router.plan(req.prompt_ids, req.salt, req.sampling.max_tokens, excluded)
            w = plan.prefill
            rid = req.request_id if attempt == 0 else f"{req.request_id}-r{attempt}"
            request = PrefillRequest(
                rid,
                req.prompt_ids,
                req.salt,
                req.sampling,
                session=req.hints.session,
                retain=req.hints.retain,
            )
            w.inflight += 1
            w.queued_tokens += plan.dispatched_tokens
            try:
                reply = await run_prefill(w.stub, request, self.left(deadline, "prefill"))  # type: ignore[arg-type]
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise rpc_error(exc, w) from None
                w.mark_failed()
                self.metrics.worker_failures.labels(role="prefill", worker=w.address).inc()
                excluded.add(w.address)
                attempt += 1
                continue
            finally:
                w.inflight -= 1
                w.queued_tokens -= plan.dispatched_tokens
            w.served += 1
            self.router.cost.observe(reply.usage.computed_tokens, reply.usage.ttft_s)
            return reply, plan, look

    def record(self, g: Generation, t_end: float) -> None:
        m, u, p = self.metrics, g.usage, g.reply.usage
        wl, tn = g.req.workload, g.req.tenant
        m.prompt_tokens.labels(wl, tn).inc(u.prompt_tokens)
        m.cached_tokens.labels(wl, tn).inc(u.cached_tokens)
        m.lost_tokens.labels(wl, tn).inc(p.lost_to_checkpoint_tokens)
        m.recomputed_tokens.labels(wl, tn).inc(p.recomputed_tokens)
        m.completion_tokens.labels(wl, tn).inc(u.completion_tokens)
        policy = self.router.policy
        if g.plan.predicted_cached is not None:
            m.predicted_hit.labels(wl, tn, policy).inc(g.plan.predicted_cached)
        m.delivered_hit.labels(wl, tn, policy).inc(u.cached_tokens)
        m.ttft.labels(wl).observe(g.t_first - g.t0)
        if u.completion_tokens > 1 and t_end > g.t_first:
            m.tps.labels(wl).observe((u.completion_tokens - 1) / (t_end - g.t_first))
        m.transfer_bytes.labels("fetched").inc(p.bytes_fetched)
        m.transfer_bytes.labels("pushed").inc(p.bytes_pushed)
        if p.recomputed_tokens:
            m.transfer_failures.labels("fetch_fallback").inc()
        if p.cache_error:
            m.transfer_failures.labels("store_unreachable").inc()
        if g.req.hints.retain:
            outcome = "refused" if g.retention_refused else "retained" if g.retained_tokens else "none"
            m.retention.labels(g.req.hints.tier, outcome).inc()
            m.retained_tokens.labels(g.req.hints.tier).inc(g.retained_tokens)
