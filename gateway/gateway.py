"""``Gateway``: what every endpoint of the front door shares, and one request's whole run through it.

It owns the worker pool, the store probe, the router and the service, and turns a validated OpenAI body
into a ``GenRequest`` (model check, sampling limits, the one context rule, workload and tenant labels).
``run`` admits the request under ``--max-concurrent``, starts it, and answers either one JSON body or an
SSE stream. Every path out (success, typed error, a client gone before or during the stream) releases
its slot once, counts the outcome and writes one access-log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvpool.gateway.cache_hints import CacheHints, HintRules
from kvpool.gateway.chat_template import AnswerMemo
from kvpool.gateway.errors import GatewayError, InvalidRequest, ModelNotFound, Overloaded, PromptTooLong
from kvpool.gateway.metrics import GatewayMetrics, tenant_label
from kvpool.gateway.model_info import ModelInfo
from kvpool.gateway.openai_format import Formatter, sse_data
from kvpool.gateway.router import PrefixProbe, Router
from kvpool.gateway.schemas import CompletionRequest, _Sampling
from kvpool.gateway.service import Dispatcher, Generation, GenRequest
from kvpool.gateway.settings import GatewaySettings
from kvpool.gateway.tenants import bound_salt, key_tenant
from kvpool.gateway.workers import WorkerPool
from kvpool.worker.sampling import SamplingParams

access = logging.getLogger("kvpool.access")  # one line per finished request (gateway/cli.py routes it)
log = logging.getLogger(__name__)
# How long past its request's deadline a stream may still take to send its end (the error event decode's
# own deadline turns into): a client that is still not reading by then is given up
STREAM_GRACE_S = 10.0


class Gateway:
    """Everything the endpoints share; built in the app's lifespan (gRPC aio needs the running loop)."""

    def __init__(self, settings: GatewaySettings, info: ModelInfo) -> None:
        self.settings = settings
        self.info = info
        self.metrics = GatewayMetrics()
        self.memo = AnswerMemo(settings.answer_memo)
        self.inflight = 0
        self.created = int(time.time())
        self.pool = WorkerPool(list(settings.prefill), list(settings.decode))
        self.probe = PrefixProbe(
            settings.master, info.fingerprint, settings.block_size, shard_depth=settings.shard_depth
        )
        self.router = Router(self.pool, self.probe, settings.routing, settings.ttft_slo_s)
        self.dispatcher = Dispatcher(self.router, self.metrics, settings.request_timeout_s)
        self.hints = HintRules(settings.cache_hints, settings.retention_tiers)
        self._stats_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.pool.start()
        self.probe.connect()
        self._stats_task = asyncio.get_running_loop().create_task(self._poll_stats(), name="gateway-stats")

    async def _poll_stats(self) -> None:
        while True:
            self.metrics.update_store(await self.probe.stats())
            for w in self.pool.workers():
                self.metrics.worker_queued.labels(w.role, w.address).set(w.queued_tokens)
            await asyncio.sleep(self.settings.stats_interval_s)

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stats_task
        await self.pool.close()
        await self.probe.close()

    # -- request building -------------------------------------------------------------------------------
    def check_model(self, body: _Sampling) -> None:
        if body.model != self.settings.model_id:
            raise ModelNotFound(
                f"The model `{body.model}` does not exist; this server serves `{self.settings.model_id}`",
                param="model",
            )

    def sampling(self, body: _Sampling, max_tokens: int | None) -> SamplingParams:
        n = max_tokens if max_tokens is not None else self.settings.default_max_tokens
        for asked in (n, body.max_tokens):  # chat may give both fields: each is checked, the first one used
            if asked is not None and asked > self.settings.max_output_tokens:
                raise InvalidRequest(
                    f"max_tokens is {asked}, this server allows at most {self.settings.max_output_tokens}",
                    param="max_tokens",
                )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > 4:
            raise InvalidRequest("stop: at most 4 sequences", param="stop")
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            top_k=body.top_k or 0,
            seed=body.seed or 0,
            max_tokens=n,
            stop=stop,
            ignore_eos=body.ignore_eos,
        )

    def gen_request(
        self,
        body: _Sampling,
        prompt: list[int],
        request: Request,
        endpoint: str,
        max_tokens: int | None,
        hints: CacheHints,
    ) -> GenRequest:
        if not prompt:
            raise InvalidRequest("prompt is empty", param="prompt")
        if len(prompt) > self.settings.max_prompt_tokens:
            raise PromptTooLong(
                f"This model's maximum context length is {self.settings.max_prompt_tokens} tokens; "
                f"the prompt has {len(prompt)} tokens",
                param="messages" if endpoint == "chat" else "prompt",
            )
        sampling = self.sampling(body, max_tokens)
        limit, total = self.settings.max_prompt_tokens, len(prompt) + sampling.max_tokens
        if total > limit:  # one context rule: prompt + max_tokens <= max_model_len (OpenAI's wording)
            where = "messages" if endpoint == "chat" else "prompt"
            raise PromptTooLong(
                f"This model's maximum context length is {limit} tokens. However, you requested {total} "
                f"tokens ({len(prompt)} in the {where}, {sampling.max_tokens} in the completion). "
                f"Please reduce the length of the {where} or completion.",
                param="messages" if endpoint == "chat" else "prompt",
            )
        meta = body.metadata or {}
        workload = request.headers.get("x-workload") or meta.get("workload")
        bound = key_tenant(request)
        tenant = bound or meta.get("tenant") or tenant_label(body.cache_salt)
        wl, tn = self.metrics.labels(workload, tenant)
        return GenRequest(prompt, sampling, bound_salt(bound, body.cache_salt), wl, tn, endpoint, hints=hints)

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        p = body.prompt
        if isinstance(p, str):
            return self.info.codec.encode(p)
        if p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise InvalidRequest("batched prompts are not supported: send one prompt", param="prompt")
            return self.info.codec.encode(p[0])  # type: ignore[arg-type]
        return self.info.codec.check_ids(p)  # type: ignore[arg-type]

    # -- running ----------------------------------------------------------------------------------------
    def acquire(self) -> Slot:
        """A place among ``--max-concurrent`` requests (429 when none is free)."""
        if self.inflight >= self.settings.max_concurrent:
            self.metrics.rejected.labels("concurrency").inc()
            raise Overloaded(f"more than {self.settings.max_concurrent} requests in flight; retry later")
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        return Slot(self)

    async def run(self, req: GenRequest, body: _Sampling, fmt: Formatter) -> Response:
        slot = self.acquire()
        try:
            gen = await self.dispatcher.start(req)
        except GatewayError as exc:
            if exc.status == 429:
                self.metrics.rejected.labels("ttft_slo" if "SLO" in exc.message else "backend").inc()
            self.finished(req, str(exc.status), None)
            slot.release()
            raise
        except BaseException:
            slot.release()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def cleanup() -> None:  # also when the client left before the body started
                gen.close()
                slot.release()

            return GuardedStream(
                self._sse(gen, fmt, include_usage, slot),
                cleanup,
                gen.deadline + STREAM_GRACE_S,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            text = []
            async with contextlib.aclosing(gen.chunks()) as chunks:
                async for c in chunks:
                    text.append(c.text)
            self._remember(req, gen, "".join(text))
            self.finished(req, "200", gen)
            return JSONResponse(fmt.full("".join(text), gen))
        except GatewayError as exc:
            self.finished(req, str(exc.status), gen)
            raise
        finally:
            gen.close()
            slot.release()

    def finished(self, req: GenRequest, status: str, gen: Generation | None) -> None:
        """Count the outcome and write the access-log line: request id, endpoint, status, labels, tokens."""
        self.metrics.requests.labels(req.workload, req.tenant, req.endpoint, status).inc()
        u = gen.usage if gen is not None else None
        access.info(
            "request_id=%s endpoint=%s status=%s workload=%s tenant=%s prompt_tokens=%d cached_tokens=%d "
            "completion_tokens=%d",
            req.request_id, req.endpoint, status, req.workload, req.tenant,
            len(req.prompt_ids), u.cached_tokens if u else 0, u.completion_tokens if u else 0,
        )  # fmt: skip

    def _remember(self, req: GenRequest, gen: Generation, text: str) -> None:
        if req.endpoint == "chat":
            self.memo.put(req.salt, text, gen.token_ids)

    async def _sse(
        self, gen: Generation, fmt: Formatter, include_usage: bool, slot: Slot
    ) -> AsyncIterator[str]:
        req = gen.req
        status = "499"  # stays so if the client goes away mid-stream
        try:
            text = []
            for head in fmt.head(include_usage):
                yield sse_data(head)
            async with contextlib.aclosing(gen.chunks()) as chunks:
                async for c in chunks:
                    text.append(c.text)
                    if c.text:
                        yield sse_data(fmt.delta(c.text, include_usage))
            self._remember(req, gen, "".join(text))
            yield sse_data(fmt.last(gen.usage.finish_reason, include_usage))
            if include_usage:
                yield sse_data(fmt.usage_chunk(gen))
            status = "200"
            yield "data: [DONE]\n\n"
        except GatewayError as exc:
            status = str(exc.status)
            yield sse_data(exc.body())
        finally:
            gen.close()
            self.finished(req, status, gen)
            slot.release()


class Slot:
    """One admitted request; ``release`` is idempotent (several cleanup paths may reach it)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.gw.inflight -= 1
            self.gw.metrics.inflight.set(self.gw.inflight)


class GuardedStream(StreamingResponse):
    """A StreamingResponse that always runs ``cleanup`` and never outlives ``deadline`` (``time.monotonic``).

    Why ``cleanup``: Starlette may cancel the response before the body generator ever starts (client gone),
    and a never-started generator's ``finally`` never runs. Why the deadline: a client that stops reading
    without leaving (a frozen process, a zero receive window) blocks the server's ``send`` for as long as
    its connection lives, and with it the request's concurrency slot and its decode worker's load count;
    Starlette ends a stream only on a disconnect. Past the deadline the response is abandoned and the slot
    freed: uvicorn logs "ASGI callable returned without completing response" and closes its side (the
    socket itself lasts until the kernel gives up on the bytes the client never read)."""

    def __init__(
        self, content: AsyncIterator[str], cleanup: Callable[[], None], deadline: float, **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup
        self._deadline = deadline

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        deadline = asyncio.timeout(max(0.0, self._deadline - time.monotonic()))
        try:
            async with deadline:
                await super().__call__(scope, receive, send)
        except TimeoutError:
            if not deadline.expired():  # another timeout, from inside the stream: not this one's to hide
                raise
            log.warning("a streaming client did not take its response by the request's deadline: given up")
        finally:
            self._cleanup()
