"""FastAPI app: the OpenAI-compatible front door (completions, chat, models, health, metrics).

Wire format follows OpenAI: JSON bodies, Server-Sent Events for ``stream=true`` ending with ``data: [DONE]``,
``stream_options.include_usage`` adding a last chunk with empty ``choices`` and the usage, and
``usage.prompt_tokens_details.cached_tokens`` always present (taken from the prefill worker's reply). Every
error leaves as ``{"error": {...}}`` (see ``errors.py``); validation failures are 400 like OpenAI (not
FastAPI's 422). Responses carry one extra top-level field, ``kvpool``, with the routing facts of the request
(workers used, predicted vs delivered hit, tokens lost to a missing checkpoint); OpenAI clients ignore it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from kvpool.gateway.cache_hints import IN_MEMORY
from kvpool.gateway.chat_template import render_chat
from kvpool.gateway.errors import (
    BackendUnavailable,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
)
from kvpool.gateway.gateway import Gateway
from kvpool.gateway.guard import Guard
from kvpool.gateway.model_info import ModelInfo, load_model_info
from kvpool.gateway.openai_format import Formatter
from kvpool.gateway.openapi_doc import PROMETHEUS_TEXT, document
from kvpool.gateway.schemas import ChatCompletionRequest, CompletionRequest
from kvpool.gateway.settings import GatewaySettings
from kvpool.gateway.tenants import bound_salt, key_tenant
from kvpool.kvstore.errors import StoreError
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvpool.gateway")


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
    app.add_middleware(
        Guard,
        api_keys=settings.api_keys,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.request_timeout_s,
    )

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
            retention = [IN_MEMORY, *settings.retention_tiers] if settings.cache_hints else None
            app.openapi_schema = document(
                schema, settings.model_id, settings.max_output_tokens, gw.info.config.vocab_size, retention
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
        hints = gw.hints.from_body(body)
        req = gw.gen_request(body, gw.completion_prompt(body), request, "completions", body.max_tokens, hints)
        return await gw.run(req, body, Formatter(False, settings.model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gw.check_model(body)
        salt = bound_salt(key_tenant(request), body.cache_salt)
        ends: list[list[int]] = []
        prompt = render_chat(gw.info.codec, body.messages, salt, gw.memo, ends)
        hints = gw.hints.from_body(body, body.messages, ends)
        req = gw.gen_request(body, prompt, request, "chat", body.output_limit(), hints)
        return await gw.run(req, body, Formatter(True, settings.model_id))

    @app.delete("/v1/prompt_cache/{key:path}")
    async def end_prompt_cache_session(key: str, request: Request) -> dict:
        """The client's session is over: release every chain retained under ``prompt_cache_key`` = key
        (for the tenant of the API key, or of ``?cache_salt=``). An extension of the OpenAI API."""
        gw.hints.check_key(key)
        salt = bound_salt(key_tenant(request), request.query_params.get("cache_salt"))
        try:
            released = await gw.probe.end_session(salt, key)
        except StoreError as exc:
            raise BackendUnavailable(f"the store could not release the session: {exc}") from None
        return {
            "id": key,
            "object": "prompt_cache.deleted",
            "deleted": released > 0,  # false: nothing was retained under this key (or it expired)
            "released_objects": released,
        }

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
