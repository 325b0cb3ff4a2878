"""FastAPI app: the OpenAI-compatible front door (completions, chat, models, health, metrics).

Wire format follows OpenAI: JSON bodies, Server-Sent Events for ``stream=true`` ending with ``data: [DONE]``,
``stream_options.include_usage`` adding a last chunk with empty ``choices`` and the usage, and
``usage.prompt_tokens_details.cached_tokens`` always present (taken from the prefill worker's reply). Every
error leaves as ``{"error": {...}}`` (see ``errors.py``); validation failures are 400 like OpenAI (not
FastAPI's 422). Responses carry one extra top-level field, ``kvpool``, with the routing facts of the request
(workers used, predicted vs delivered hit, tokens lost to a missing checkpoint); OpenAI clients ignore it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvpool.gateway.chat_template import AnswerMemo, render_chat
from kvpool.gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    Overloaded,
    PromptTooLong,
)
from kvpool.gateway.guard import Guard
from kvpool.gateway.metrics import GatewayMetrics, tenant_label
from kvpool.gateway.model_info import ModelInfo, load_model_info
from kvpool.gateway.openapi_doc import PROMETHEUS_TEXT, document
from kvpool.gateway.router import PrefixProbe, Router
from kvpool.gateway.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from kvpool.gateway.service import Generation, GenRequest, Service
from kvpool.gateway.settings import GatewaySettings
from kvpool.gateway.tenants import bound_salt, key_tenant
from kvpool.gateway.workers import WorkerPool
from kvpool.worker.sampling import SamplingParams
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvpool.gateway")
access = logging.getLogger("kvpool.access")  # one line per finished request (gateway/cli.py routes it)


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
        self.probe = PrefixProbe(settings.master, info.fingerprint, settings.block_size)
        self.router = Router(self.pool, self.probe, settings.routing, settings.ttft_slo_s)
        self.service = Service(self.router, self.metrics, settings.request_timeout_s)
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
        self, body: _Sampling, prompt: list[int], request: Request, endpoint: str, max_tokens: int | None
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
        return GenRequest(prompt, sampling, bound_salt(bound, body.cache_salt), wl, tn, endpoint)

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
            gen = await self.service.start(req)
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
                yield _data(head)
            async with contextlib.aclosing(gen.chunks()) as chunks:
                async for c in chunks:
                    text.append(c.text)
                    if c.text:
                        yield _data(fmt.delta(c.text, include_usage))
            self._remember(req, gen, "".join(text))
            yield _data(fmt.last(gen.usage.finish_reason, include_usage))
            if include_usage:
                yield _data(fmt.usage_chunk(gen))
            status = "200"
            yield "data: [DONE]\n\n"
        except GatewayError as exc:
            status = str(exc.status)
            yield _data(exc.body())
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
    """A StreamingResponse that always runs ``cleanup``: Starlette may cancel the response before the body
    generator ever starts (client gone), and a never-started generator's ``finally`` never runs."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Formatter:
    """OpenAI response bodies for one request (completions or chat)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list, usage: object = None, with_usage: bool = False) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            out["usage"] = usage
        return out

    def full(self, text: str, gen: Generation) -> dict:
        u = gen.usage
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": u.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": u.finish_reason, "logprobs": None}
        out = self._envelope(self.object, [choice], u.openai(), True)
        out["kvpool"] = u.extra
        return out

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    def head(self, include_usage: bool) -> list[dict]:
        if not self.chat:
            return []
        return [self._envelope(self.chunk_object, [self._choice("", None, role=True)], None, include_usage)]

    def delta(self, text: str, include_usage: bool) -> dict:
        return self._envelope(self.chunk_object, [self._choice(text, None)], None, include_usage)

    def last(self, finish: str, include_usage: bool) -> dict:
        return self._envelope(
            self.chunk_object, [self._choice(None if self.chat else "", finish)], None, include_usage
        )

    def usage_chunk(self, gen: Generation) -> dict:
        out = self._envelope(self.chunk_object, [], gen.usage.openai(), True)
        out["kvpool"] = gen.usage.extra
        return out


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"Invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if not loc and e.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {e.get('msg', 'invalid')}{more}", param


def create_app(settings: GatewaySettings, info: ModelInfo | None = None) -> FastAPI:
    """The ASGI app; ``info`` (tokenizer, fingerprint) is loaded from ``settings.model`` when not given."""
    info = info or load_model_info(settings.model, settings.fingerprint_hex)
    gw = Gateway(settings, info)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(
        title="kvpool gateway",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible API over disaggregated prefill/decode with a shared KV store",
    )
    app.state.gateway = gw
    app.add_middleware(Guard, api_keys=settings.api_keys, max_body_bytes=settings.max_body_bytes)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return InvalidRequest(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = NotFound(str(exc.detail), code="method_not_allowed" if exc.status_code == 405 else None)
        err.status = exc.status_code
        response = err.response()
        if exc.headers:  # a 405 names the allowed methods (Allow, RFC 9110)
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected gateway error")
        err = GatewayError(f"internal error: {type(exc).__name__}")
        return err.response()

    def openapi() -> dict:
        """The generated schema, rewritten to declare what the server answers (``openapi_doc``); ``model``
        is documented as the one served id, the handler still answers 404 for any other, like OpenAI."""
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            app.openapi_schema = document(
                schema, settings.model_id, settings.max_output_tokens, gw.info.config.vocab_size
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(gw)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        if model_id != settings.model_id:
            raise ModelNotFound(f"The model `{model_id}` does not exist", param="model")
        return _model_card(gw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gw.check_model(body)
        req = gw.gen_request(body, gw.completion_prompt(body), request, "completions", body.max_tokens)
        return await gw.run(req, body, Formatter(False, settings.model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gw.check_model(body)
        salt = bound_salt(key_tenant(request), body.cache_salt)
        prompt = render_chat(gw.info.codec, body.messages, salt, gw.memo)
        req = gw.gen_request(body, prompt, request, "chat", body.output_limit())
        return await gw.run(req, body, Formatter(True, settings.model_id))

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = {
            "prefill": [w.snapshot() for w in gw.pool.prefill],
            "decode": [w.snapshot() for w in gw.pool.decode],
        }
        ok = bool(gw.pool.available("prefill")) and bool(gw.pool.available("decode"))
        body = {
            "status": "ok" if ok else "degraded",
            "routing": settings.routing,
            "workers": workers,
            "inflight": gw.inflight,
            "model": settings.model_id,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=PROMETHEUS_TEXT)

    return app


def _model_card(gw: Gateway) -> dict:
    return {
        "id": gw.settings.model_id,
        "object": "model",
        "created": gw.created,
        "owned_by": "kvpool",
        "max_model_len": gw.settings.max_prompt_tokens,
    }
