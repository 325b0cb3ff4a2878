"""Request bodies of the OpenAI-compatible endpoints (pydantic, so FastAPI publishes an OpenAPI schema).

Why permissive on unknown fields: OpenAI clients send fields we do not implement (``logit_bias``, ``tools``
...); like vLLM we ignore unknown ones, but fields whose silent loss would change the answer (``n > 1``,
``logprobs``, ``echo``, ``best_of``) are rejected with a 400 naming the field. Numeric ranges follow OpenAI's
documented ones; limits that depend on the deployment (max prompt / output tokens) are checked by the app.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MAX = (1 << 63) - 1
TOKEN_ID_MAX = (1 << 32) - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # the limit is the server's: one rule, one message
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    user: str | None = None
    cache_salt: str | None = Field(
        default=None, max_length=1024, description="tenant isolation: part of the block-hash root"
    )
    metadata: dict[str, str] | None = Field(
        default=None, description="'workload' labels the request in metrics (like the X-Workload header)"
    )
    ignore_eos: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]] | list[str]
    echo: Literal[False] | None = None
    logprobs: None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
