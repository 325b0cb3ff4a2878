from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "tenant", "sampling", "no_cache", "return_logits", "session", "retain")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    sampling: SamplingParams
    no_cache: bool
    return_logits: bool
    session: str
    retain: _containers.RepeatedCompositeFieldContainer[RetainSpan]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., no_cache: _Optional[bool] = ..., return_logits: _Optional[bool] = ..., session: _Optional[str] = ..., retain: _Optional[_Iterable[_Union[RetainSpan, _Mapping]]] = ...) -> None: ...

class RetainSpan(_message.Message):
    __slots__ = ("upto_tokens", "ttl_ms")
    UPTO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    upto_tokens: int
    ttl_ms: int
    def __init__(self, upto_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "tenant", "first_token", "sampling", "block_hashes", "tail_key", "tail_stored", "cached_tokens", "no_cache", "session", "retain_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    TAIL_STORED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    first_token: int
    sampling: SamplingParams
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tail_key: bytes
    tail_stored: bool
    cached_tokens: int
    no_cache: bool
    session: str
    retain_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., tail_key: _Optional[bytes] = ..., tail_stored: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., no_cache: _Optional[bool] = ..., session: _Optional[str] = ..., retain_ms: _Optional[int] = ...) -> None: ...

class PrefillUsage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "computed_tokens", "lost_to_checkpoint_tokens", "recomputed_tokens", "bytes_fetched", "bytes_pushed", "checkpoints_pushed", "ttft_s", "total_s", "cache_error", "fetch_s", "compute_s", "push_s", "retained_tokens", "retention_refused")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOST_TO_CHECKPOINT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_ERROR_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_S_FIELD_NUMBER: _ClassVar[int]
    RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    lost_to_checkpoint_tokens: int
    recomputed_tokens: int
    bytes_fetched: int
    bytes_pushed: int
    checkpoints_pushed: _containers.RepeatedScalarFieldContainer[int]
    ttft_s: float
    total_s: float
    cache_error: str
    fetch_s: float
    compute_s: float
    push_s: float
    retained_tokens: int
    retention_refused: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., lost_to_checkpoint_tokens: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., bytes_pushed: _Optional[int] = ..., checkpoints_pushed: _Optional[_Iterable[int]] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ..., cache_error: _Optional[str] = ..., fetch_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., push_s: _Optional[float] = ..., retained_tokens: _Optional[int] = ..., retention_refused: _Optional[bool] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("handoff", "first_token", "usage", "first_logits", "first_text")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGITS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    first_token: int
    usage: PrefillUsage
    first_logits: bytes
    first_text: str
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ..., first_token: _Optional[int] = ..., usage: _Optional[_Union[PrefillUsage, _Mapping]] = ..., first_logits: _Optional[bytes] = ..., first_text: _Optional[str] = ...) -> None: ...
