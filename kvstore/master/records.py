"""What the master keeps about nodes and puts in flight, and the orders it queues for storage nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvpool.proto import common_pb2


class NodeAction(StrEnum):
    DELETE = "delete"
    DEMOTE = "demote"
    PROMOTE = "promote"


@dataclass(slots=True)
class NodeRecord:
    endpoint: common_pb2.NodeEndpoint
    last_heartbeat: float
    dram_reported: int = 0
    ssd_reported: int = 0


@dataclass(slots=True)
class PendingPut:
    put_id: str
    key: bytes
    node_id: str
    deadline: float
    checksum_at_commit: bool = False  # the writer declares the checksum in PutCommit (hashed while copying)


@dataclass(slots=True)
class PendingActions:
    """Keys a node must act on, per action, in the order they were decided."""

    node: common_pb2.NodeEndpoint
    epoch: int = 0  # HA: the leadership epoch of the master that decided them (nodes fence older ones)
    keys: dict[NodeAction, list[bytes]] = field(default_factory=dict)
