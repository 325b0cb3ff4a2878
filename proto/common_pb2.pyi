from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ObjectKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECT_KIND_UNSPECIFIED: _ClassVar[ObjectKind]
    MLA_BLOCK: _ClassVar[ObjectKind]
    KDA_CHECKPOINT: _ClassVar[ObjectKind]
    REQUEST_TAIL: _ClassVar[ObjectKind]
    BLOB: _ClassVar[ObjectKind]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    DRAM: _ClassVar[Tier]
    SSD: _ClassVar[Tier]
OBJECT_KIND_UNSPECIFIED: ObjectKind
MLA_BLOCK: ObjectKind
KDA_CHECKPOINT: ObjectKind
REQUEST_TAIL: ObjectKind
BLOB: ObjectKind
TIER_UNSPECIFIED: Tier
DRAM: Tier
SSD: Tier

class ObjectMeta(_message.Message):
    __slots__ = ("key", "kind", "size", "checksum", "tenant", "parent", "ttl_ms", "tier", "epoch", "shard")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    kind: ObjectKind
    size: int
    checksum: int
    tenant: str
    parent: bytes
    ttl_ms: int
    tier: Tier
    epoch: int
    shard: int
    def __init__(self, key: _Optional[bytes] = ..., kind: _Optional[_Union[ObjectKind, str]] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., tenant: _Optional[str] = ..., parent: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., epoch: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class NodeEndpoint(_message.Message):
    __slots__ = ("node_id", "host", "grpc_port", "tcp_port", "ucx_port", "shm_name", "host_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    UCX_PORT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    grpc_port: int
    tcp_port: int
    ucx_port: int
    shm_name: str
    host_id: str
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., grpc_port: _Optional[int] = ..., tcp_port: _Optional[int] = ..., ucx_port: _Optional[int] = ..., shm_name: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class ObjectLocation(_message.Message):
    __slots__ = ("meta", "node")
    META_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    meta: ObjectMeta
    node: NodeEndpoint
    def __init__(self, meta: _Optional[_Union[ObjectMeta, _Mapping]] = ..., node: _Optional[_Union[NodeEndpoint, _Mapping]] = ...) -> None: ...
