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
    __slots__ = ("keys", "epoch")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    epoch: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., epoch: _Optional[int] = ...) -> None: ...

class KeysReply(_message.Message):
    __slots__ = ("done", "missing")
    DONE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    done: int
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, done: _Optional[int] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ShmExtent(_message.Message):
    __slots__ = ("key", "offset", "size", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    offset: int
    size: int
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class LocateReply(_message.Message):
    __slots__ = ("shm_name", "extents", "missing")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    extents: _containers.RepeatedCompositeFieldContainer[ShmExtent]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, shm_name: _Optional[str] = ..., extents: _Optional[_Iterable[_Union[ShmExtent, _Mapping]]] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ShmReserveRequest(_message.Message):
    __slots__ = ("put_id", "meta")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    meta: _common_pb2.ObjectMeta
    def __init__(self, put_id: _Optional[str] = ..., meta: _Optional[_Union[_common_pb2.ObjectMeta, _Mapping]] = ...) -> None: ...

class ShmReserveReply(_message.Message):
    __slots__ = ("shm_name", "offset", "exists")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    offset: int
    exists: bool
    def __init__(self, shm_name: _Optional[str] = ..., offset: _Optional[int] = ..., exists: _Optional[bool] = ...) -> None: ...

class ShmSealRequest(_message.Message):
    __slots__ = ("put_id", "abort")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    abort: bool
    def __init__(self, put_id: _Optional[str] = ..., abort: _Optional[bool] = ...) -> None: ...

class ShmSealReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("put_id", "meta", "arena_offset")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    ARENA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    meta: _common_pb2.ObjectMeta
    arena_offset: int
    def __init__(self, put_id: _Optional[str] = ..., meta: _Optional[_Union[_common_pb2.ObjectMeta, _Mapping]] = ..., arena_offset: _Optional[int] = ...) -> None: ...
