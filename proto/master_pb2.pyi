from kvpool.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("instance", "epoch", "leader", "leader_address", "shard_set", "shard", "shard_masters")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHARD_SET_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_MASTERS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    epoch: int
    leader: bool
    leader_address: str
    shard_set: str
    shard: int
    shard_masters: str
    def __init__(self, instance: _Optional[str] = ..., epoch: _Optional[int] = ..., leader: _Optional[bool] = ..., leader_address: _Optional[str] = ..., shard_set: _Optional[str] = ..., shard: _Optional[int] = ..., shard_masters: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "dram_capacity_bytes", "ssd_capacity_bytes", "inventory", "shard_set")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SHARD_SET_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeEndpoint
    dram_capacity_bytes: int
    ssd_capacity_bytes: int
    inventory: _containers.RepeatedCompositeFieldContainer[_common_pb2.ObjectMeta]
    shard_set: str
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeEndpoint, _Mapping]] = ..., dram_capacity_bytes: _Optional[int] = ..., ssd_capacity_bytes: _Optional[int] = ..., inventory: _Optional[_Iterable[_Union[_common_pb2.ObjectMeta, _Mapping]]] = ..., shard_set: _Optional[str] = ...) -> None: ...

class RegisterNodeReply(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "node_timeout_ms", "adopted_objects", "epoch")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    NODE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    node_timeout_ms: int
    adopted_objects: int
    epoch: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., node_timeout_ms: _Optional[int] = ..., adopted_objects: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "dram_used_bytes", "ssd_used_bytes", "fragmentation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    dram_used_bytes: int
    ssd_used_bytes: int
    fragmentation: float
    def __init__(self, node_id: _Optional[str] = ..., dram_used_bytes: _Optional[int] = ..., ssd_used_bytes: _Optional[int] = ..., fragmentation: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("reregister", "epoch")
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    reregister: bool
    epoch: int
    def __init__(self, reregister: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("meta", "replace_if_corrupt", "checksum_at_commit", "route", "token_ids", "retain")
    META_FIELD_NUMBER: _ClassVar[int]
    REPLACE_IF_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_AT_COMMIT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.ObjectMeta
    replace_if_corrupt: bool
    checksum_at_commit: bool
    route: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    retain: bool
    def __init__(self, meta: _Optional[_Union[_common_pb2.ObjectMeta, _Mapping]] = ..., replace_if_corrupt: _Optional[bool] = ..., checksum_at_commit: _Optional[bool] = ..., route: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., retain: _Optional[bool] = ...) -> None: ...

class PutStartReply(_message.Message):
    __slots__ = ("status", "put_id", "node", "deadline_ms", "epoch", "shard")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[PutStartReply.Status]
        STARTED: _ClassVar[PutStartReply.Status]
        EXISTS: _ClassVar[PutStartReply.Status]
        IN_PROGRESS: _ClassVar[PutStartReply.Status]
        NOT_ADMITTED: _ClassVar[PutStartReply.Status]
    STATUS_UNSPECIFIED: PutStartReply.Status
    STARTED: PutStartReply.Status
    EXISTS: PutStartReply.Status
    IN_PROGRESS: PutStartReply.Status
    NOT_ADMITTED: PutStartReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    status: PutStartReply.Status
    put_id: str
    node: _common_pb2.NodeEndpoint
    deadline_ms: int
    epoch: int
    shard: int
    def __init__(self, status: _Optional[_Union[PutStartReply.Status, str]] = ..., put_id: _Optional[str] = ..., node: _Optional[_Union[_common_pb2.NodeEndpoint, _Mapping]] = ..., deadline_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class PutCommitRequest(_message.Message):
    __slots__ = ("put_id", "checksum")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    checksum: int
    def __init__(self, put_id: _Optional[str] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutCommitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutAbortRequest(_message.Message):
    __slots__ = ("put_id", "reason")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    reason: str
    def __init__(self, put_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PutAbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message", "index")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    index: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class PutStartBatchRequest(_message.Message):
    __slots__ = ("shard_set", "keys", "kinds", "sizes", "parents", "tenants", "ttl_ms", "tiers", "checksums", "checksum_at_commit", "replace_if_corrupt", "routes", "token_ids", "token_counts", "retain")
    SHARD_SET_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_AT_COMMIT_FIELD_NUMBER: _ClassVar[int]
    REPLACE_IF_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    shard_set: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    kinds: _containers.RepeatedScalarFieldContainer[_common_pb2.ObjectKind]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[bytes]
    tenants: _containers.RepeatedScalarFieldContainer[str]
    ttl_ms: _containers.RepeatedScalarFieldContainer[int]
    tiers: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    checksum_at_commit: bool
    replace_if_corrupt: _containers.RepeatedScalarFieldContainer[bool]
    routes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    retain: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, shard_set: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., kinds: _Optional[_Iterable[_Union[_common_pb2.ObjectKind, str]]] = ..., sizes: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[bytes]] = ..., tenants: _Optional[_Iterable[str]] = ..., ttl_ms: _Optional[_Iterable[int]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ..., checksums: _Optional[_Iterable[int]] = ..., checksum_at_commit: _Optional[bool] = ..., replace_if_corrupt: _Optional[_Iterable[bool]] = ..., routes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., retain: _Optional[_Iterable[bool]] = ...) -> None: ...

class PutStartBatchReply(_message.Message):
    __slots__ = ("status", "put_ids", "nodes", "node", "deadline_ms", "epoch", "shard", "errors")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PUT_IDS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[PutStartReply.Status]
    put_ids: _containers.RepeatedScalarFieldContainer[str]
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeEndpoint]
    node: _containers.RepeatedScalarFieldContainer[int]
    deadline_ms: int
    epoch: int
    shard: int
    errors: _containers.RepeatedCompositeFieldContainer[ItemError]
    def __init__(self, status: _Optional[_Iterable[_Union[PutStartReply.Status, str]]] = ..., put_ids: _Optional[_Iterable[str]] = ..., nodes: _Optional[_Iterable[_Union[_common_pb2.NodeEndpoint, _Mapping]]] = ..., node: _Optional[_Iterable[int]] = ..., deadline_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., shard: _Optional[int] = ..., errors: _Optional[_Iterable[_Union[ItemError, _Mapping]]] = ...) -> None: ...

class PutCommitBatchRequest(_message.Message):
    __slots__ = ("put_ids", "checksums")
    PUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    put_ids: _containers.RepeatedScalarFieldContainer[str]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, put_ids: _Optional[_Iterable[str]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PutCommitBatchReply(_message.Message):
    __slots__ = ("errors",)
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    errors: _containers.RepeatedCompositeFieldContainer[ItemError]
    def __init__(self, errors: _Optional[_Iterable[_Union[ItemError, _Mapping]]] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("block_hashes", "tenant", "require_checkpoint", "acquire", "lease_ms", "counts_only", "route", "shard_set", "resume")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    SHARD_SET_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tenant: str
    require_checkpoint: bool
    acquire: bool
    lease_ms: int
    counts_only: bool
    route: bytes
    shard_set: str
    resume: bool
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tenant: _Optional[str] = ..., require_checkpoint: _Optional[bool] = ..., acquire: _Optional[bool] = ..., lease_ms: _Optional[int] = ..., counts_only: _Optional[bool] = ..., route: _Optional[bytes] = ..., shard_set: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class MatchPrefixReply(_message.Message):
    __slots__ = ("usable_blocks", "mla_run_blocks", "lease_id", "checkpoint_blocks", "usable_blocks_on_ssd", "nodes", "node", "size", "checksum", "tier")
    USABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MLA_RUN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USABLE_BLOCKS_ON_SSD_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    usable_blocks: int
    mla_run_blocks: int
    lease_id: str
    checkpoint_blocks: _containers.RepeatedScalarFieldContainer[int]
    usable_blocks_on_ssd: int
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeEndpoint]
    node: _containers.RepeatedScalarFieldContainer[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    checksum: _containers.RepeatedScalarFieldContainer[int]
    tier: _containers.RepeatedScalarFieldContainer[_common_pb2.Tier]
    def __init__(self, usable_blocks: _Optional[int] = ..., mla_run_blocks: _Optional[int] = ..., lease_id: _Optional[str] = ..., checkpoint_blocks: _Optional[_Iterable[int]] = ..., usable_blocks_on_ssd: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[_common_pb2.NodeEndpoint, _Mapping]]] = ..., node: _Optional[_Iterable[int]] = ..., size: _Optional[_Iterable[int]] = ..., checksum: _Optional[_Iterable[int]] = ..., tier: _Optional[_Iterable[_Union[_common_pb2.Tier, str]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "acquire", "lease_ms", "exists_only")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    EXISTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    acquire: bool
    lease_ms: int
    exists_only: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., acquire: _Optional[bool] = ..., lease_ms: _Optional[int] = ..., exists_only: _Optional[bool] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("found", "missing", "lease_id")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedCompositeFieldContainer[_common_pb2.ObjectLocation]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    lease_id: str
    def __init__(self, found: _Optional[_Iterable[_Union[_common_pb2.ObjectLocation, _Mapping]]] = ..., missing: _Optional[_Iterable[bytes]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "ttl_ms", "session", "end_session", "tenant")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    END_SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_ms: int
    session: str
    end_session: bool
    tenant: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_ms: _Optional[int] = ..., session: _Optional[str] = ..., end_session: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("pinned", "refused")
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    pinned: int
    refused: bool
    def __init__(self, pinned: _Optional[int] = ..., refused: _Optional[bool] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("tenant", "max_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    max_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class SetQuotaReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("objects", "bytes", "capacity_bytes", "evictions", "evicted_bytes", "nodes", "active_leases", "pending_puts", "bytes_per_tier", "bytes_per_tenant", "policy", "counters", "demotions", "expired", "admission_rate", "rss_bytes", "index_slots", "max_objects", "pinned_bytes", "pins_refused", "pin_budget_earned")
    class BytesPerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BytesPerTenantEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    PENDING_PUTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TENANT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_RATE_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_EARNED_FIELD_NUMBER: _ClassVar[int]
    objects: int
    bytes: int
    capacity_bytes: int
    evictions: int
    evicted_bytes: int
    nodes: int
    active_leases: int
    pending_puts: int
    bytes_per_tier: _containers.ScalarMap[str, int]
    bytes_per_tenant: _containers.ScalarMap[str, int]
    policy: str
    counters: _containers.ScalarMap[str, int]
    demotions: int
    expired: int
    admission_rate: float
    rss_bytes: int
    index_slots: int
    max_objects: int
    pinned_bytes: int
    pins_refused: int
    pin_budget_earned: float
    def __init__(self, objects: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., evicted_bytes: _Optional[int] = ..., nodes: _Optional[int] = ..., active_leases: _Optional[int] = ..., pending_puts: _Optional[int] = ..., bytes_per_tier: _Optional[_Mapping[str, int]] = ..., bytes_per_tenant: _Optional[_Mapping[str, int]] = ..., policy: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., demotions: _Optional[int] = ..., expired: _Optional[int] = ..., admission_rate: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., index_slots: _Optional[int] = ..., max_objects: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., pins_refused: _Optional[int] = ..., pin_budget_earned: _Optional[float] = ...) -> None: ...
