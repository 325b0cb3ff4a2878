"""Request bodies of the OpenAI-compatible endpoints (pydantic, so FastAPI publishes an OpenAPI schema).

Why permissive on unknown fields: OpenAI clients send fields we do not implement (``logit_bias``, ``tools``
...); like vLLM we ignore unknown ones, but fields whose silent loss would change the answer (``n > 1``,
``logprobs``, ``echo``, ``best_of``) are rejected with a 400 naming the field. Numeric ranges follow OpenAI's
documented ones; limits that depend on the deployment (max prompt / output tokens) are checked by the app.
Why strict: the published schema says ``boolean`` and ``integer``; lax validation would take ``0`` as
``false`` and ``false`` as a token id, answering requests the document calls invalid.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

SEED_MAX = (1 << 53) - 1  # the largest seed a client that sends JSON numbers as doubles can send exactly
TOKEN_ID_MAX = (1 << 32) - 1


def _integral(value: object) -> object:
    """JSON Schema's ``integer`` includes ``1.0``; a boolean is not one (strict mode then checks the rest)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


INTEGRAL = BeforeValidator(_integral)  # after the Field, so the schema keeps minimum/maximum


def _only_false(value: object) -> object:
    """``false`` or ``null`` only: a JSON 0 is not ``false`` (the document says boolean; pydantic's lax
    mode would take 0 as False since ``0 == False``)."""
    if value is not None and value is not False:
        raise ValueError("only false (or null) is supported")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = (
        None  # the limit is the server's: one rule, one message
    )
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1 << 20), INTEGRAL] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX), INTEGRAL] | None = None
    stop: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1), INTEGRAL] = 1
    user: str | None = None
    cache_salt: str | None = Field(
        default=None, max_length=1024, description="tenant isolation: part of the block-hash root"
    )
    metadata: dict[str, str] | None = Field(
        default=None, description="'workload' labels the request in metrics (like the X-Workload header)"
    )
    ignore_eos: bool = False
    # cache hints (gateway/cache_hints.py checks them against the deployment: a 400 names what it offers)
    prompt_cache_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="session key: groups a conversation's retained chains (OpenAI's field)",
    )
    prompt_cache_retention: str | None = Field(
        default=None,
        description="keep the prompt and its answer: 'in_memory' (the shortest tier) or a tier such as "
        "'1h' / '24h' (OpenAI's field; the tiers are the deployment's --retention-tiers)",
    )


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX), INTEGRAL]], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]  # one prompt: no batches
    )
    echo: Literal[False] | None = None
    logprobs: None = None
    best_of: Annotated[int, Field(ge=1, le=1), INTEGRAL] | None = None
    suffix: None = None

    _echo_is_false = field_validator("echo", mode="before")(_only_false)


class CacheControl(BaseModel):
    """Anthropic's breakpoint: keep the prompt up to here for ``ttl`` (a tier the deployment offers)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: None = None

    _logprobs_is_false = field_validator("logprobs", mode="before")(_only_false)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
