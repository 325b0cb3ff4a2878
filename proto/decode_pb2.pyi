from kvpool.proto import prefill_pb2 as _prefill_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("handoff",)
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    handoff: _prefill_pb2.Handoff
    def __init__(self, handoff: _Optional[_Union[_prefill_pb2.Handoff, _Mapping]] = ...) -> None: ...

class DecodeUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "resume_path", "recomputed_tokens", "resume_reason", "blocks_pushed", "checkpoint_pushed", "decode_s", "retained_tokens", "retention_refused")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_PATH_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PUSHED_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    RETAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    resume_path: str
    recomputed_tokens: int
    resume_reason: str
    blocks_pushed: int
    checkpoint_pushed: int
    decode_s: float
    retained_tokens: int
    retention_refused: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., resume_path: _Optional[str] = ..., recomputed_tokens: _Optional[int] = ..., resume_reason: _Optional[str] = ..., blocks_pushed: _Optional[int] = ..., checkpoint_pushed: _Optional[int] = ..., decode_s: _Optional[float] = ..., retained_tokens: _Optional[int] = ..., retention_refused: _Optional[bool] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("index", "token_id", "text", "final", "finish_reason", "usage")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    text: str
    final: bool
    finish_reason: str
    usage: DecodeUsage
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., final: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[DecodeUsage, _Mapping]] = ...) -> None: ...
