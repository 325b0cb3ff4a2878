from kvpool.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfoReply(_message.Message):
    __slots__ = ("node", "dram_capacity_bytes", "dram_used_bytes", "ssd_capacity_bytes", "ssd_used_bytes", "fragmentation", "objects", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeEndpoint
    dram_capacity_bytes: int
    dram_used_bytes: int
    ssd_capacity_bytes: int
    ssd_used_bytes: int
    fragmentation: float
    objects: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeEndpoint, _Mapping]] = ..., dram_capacity_bytes: _Optional[int] = ..., dram_used_bytes: _Optional[int] = ..., ssd_capacity_bytes: _Optional[int] = ..., ssd_used_bytes: _Optional[int] = ..., fragmentation: _Optional[float] = ..., objects: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys", "epoch", "shard")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    epoch: int
    shard: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., epoch: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class KeysReply(_message.Message):
    __slots__ = ("done", "missing")
    DONE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    done: int
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, done: _Optional[int] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("put_id", "meta")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    meta: _common_pb2.ObjectMeta
    def __init__(self, put_id: _Optional[str] = ..., meta: _Optional[_Union[_common_pb2.ObjectMeta, _Mapping]] = ...) -> None: ...
