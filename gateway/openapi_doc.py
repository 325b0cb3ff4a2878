"""The gateway's OpenAPI document, made to say what the server does: every status it answers with the
OpenAI error body, ``/metrics`` as Prometheus text, and ``model`` as the one id served.

Why: clients and contract fuzzers (``schemathesis run .../openapi.json --checks all``) read the document.
FastAPI's generated one declares a 422 the gateway never sends (validation errors are OpenAI-style 400s)
and none of the 400/401/404/413/429/503 answers it does send.
"""

from __future__ import annotations

from typing import Any

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ERRORS = {
    "400": "invalid request (bad JSON, bad field, prompt + max_tokens over max_model_len)",
    "401": "missing or wrong API key",
    "404": "unknown model or path",
    "413": "request body too large",
    "429": "too many requests in flight, or the TTFT SLO cannot be met",
    "503": "no prefill or decode worker available",
}
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def document(
    schema: dict[str, Any],
    model_id: str,
    max_tokens: int,
    vocab_size: int,
    retention: list[str] | None = None,
) -> dict[str, Any]:
    """Rewrite FastAPI's generated ``schema`` in place (see the module docstring) and return it. The
    deployment's limits are written in: ``max_tokens`` at most the server's output limit, token ids
    below the vocabulary size, the retention tiers it offers (``retention``: the values of
    ``prompt_cache_retention``, ``in_memory`` first; None = cache hints disabled, the fields not offered)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    _document_hints(components, retention)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"]["enum"] = [model_id]
        for field in ("max_tokens", "max_completion_tokens"):
            for choice in props.get(field, {}).get("anyOf", []):
                if choice.get("type") == "integer":
                    choice["maximum"] = max_tokens
        for choice in props.get("prompt", {}).get("anyOf", []):
            if choice.get("items", {}).get("type") == "integer":
                choice["items"]["maximum"] = vocab_size - 1
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in schema.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status, why in ERRORS.items():
                responses.setdefault(status, {"description": why, "content": error})
            ok = responses.get("200", {}).get("content", {})
            if path in ("/v1/completions", "/v1/chat/completions") and "application/json" in ok:
                ok["text/event-stream"] = {}  # "stream": true; events carry chunk objects, then [DONE]
            if path == "/metrics":
                responses["200"] = {
                    "description": "Prometheus text exposition",
                    "content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}},
                }
    for op in schema.get("paths", {}).get("/v1/prompt_cache/{key}", {}).values():
        op["responses"]["200"]["content"]["application/json"]["schema"] = {
            "type": "object",
            "required": ["id", "object", "deleted", "released_objects"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "prompt_cache.deleted"},
                "deleted": {"type": "boolean"},
                "released_objects": {"type": "integer", "minimum": 0},
            },
        }
    schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
    schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
    return schema


def _document_hints(components: dict[str, Any], retention: list[str] | None) -> None:
    """``prompt_cache_retention`` and ``cache_control.ttl`` as enums of what this deployment offers; with
    hints off, the three fields are declared as not accepted (a request carrying one is a 400)."""
    tiers = [t for t in retention or () if t != "in_memory"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components.get(name, {}).get("properties", {})
        for field, values in (("prompt_cache_retention", retention), ("prompt_cache_key", None)):
            if field not in props:
                continue
            if retention is None:
                props[field] = {"not": {}, "description": "cache hints are disabled on this deployment"}
            elif values is not None:
                props[field]["anyOf"] = [{"enum": values}, {"type": "null"}]
    control = components.get("CacheControl", {}).get("properties", {})
    if "ttl" in control:
        control["ttl"]["anyOf"] = (
            [{"enum": tiers}, {"type": "null"}] if retention is not None else [{"not": {}}]
        )
