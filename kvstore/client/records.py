"""What the store client's callers hand it and get back: ``PutItem`` (one object to put) and
``LocationColumns`` (a compact ``MatchPrefix`` reply read column by column).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from kvpool.kvstore.errors import ProtocolError
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG
from kvpool.kvstore.transport.base import Buffer
from kvpool.kvstore.transport.payload import Payload, payload_size
from kvpool.proto import common_pb2, master_pb2

ObjectKind = common_pb2.ObjectKind


@dataclass
class PutItem:
    """One object of a ``batch_put``: ``data`` is one buffer, or a ``Payload`` of parts in order (a cache
    unit's header and tensors, put without being joined first)."""

    key: bytes
    data: Buffer | Payload
    kind: int = common_pb2.BLOB
    tenant: str | None = None
    parent: bytes = b""
    ttl_ms: int = 0

    @property
    def nbytes(self) -> int:
        return payload_size(self.data)


class LocationColumns:
    """A ``LocationTable`` (``match_prefix(compact=True)``) as numpy views over the reply's bytes.

    Decoding is O(number of distinct nodes), not O(rows): routers and schedulers read the columns
    (``size``, ``tier``, ``node_index``...) as arrays; a fetch turns the rows it needs into
    ``ObjectLocation`` messages with ``locations()`` only then.
    """

    def __init__(
        self,
        table: master_pb2.LocationTable,
        block_hashes: Sequence[bytes] | None = None,
        usable_blocks: int = 0,
    ) -> None:
        self.rows = table.rows
        self._hashes = block_hashes
        self._usable = usable_blocks
        self.nodes = list(table.nodes)
        self.node_index = np.frombuffer(table.node_index, dtype="<u2")
        self.key_width = table.key_width
        self.keys_blob = table.keys
        self.kind = np.frombuffer(table.kind, dtype=np.uint8)
        self.tier = np.frombuffer(table.tier, dtype=np.uint8)
        self.size = np.frombuffer(table.size, dtype="<u8")
        self.checksum = np.frombuffer(table.checksum, dtype="<u8")
        self.tenants = list(table.tenants)
        self.tenant_index = np.frombuffer(table.tenant_index, dtype="<u2") if table.tenant_index else None
        self.ttl_ms = np.frombuffer(table.ttl_ms, dtype="<u4") if table.ttl_ms else None
        for name in ("node_index", "kind", "tier", "size", "checksum"):
            got = len(getattr(self, name))
            if got != self.rows:
                raise ProtocolError(f"LocationTable column {name} has {got} rows, not {self.rows}")
        if self.keys_blob or self.rows == 0:
            if len(self.keys_blob) != self.rows * self.key_width:
                raise ProtocolError("LocationTable keys do not match rows * key_width")
        elif block_hashes is None or not usable_blocks or len(block_hashes) < usable_blocks:
            raise ProtocolError("LocationTable without keys: use LocationColumns.of_match(reply, hashes)")

    @classmethod
    def of_match(cls, reply: master_pb2.MatchPrefixReply, block_hashes: Sequence[bytes]) -> LocationColumns:
        """The compact locations of a ``match_prefix(block_hashes, compact=True)`` reply."""
        return cls(reply.table, block_hashes, reply.usable_blocks)

    def __len__(self) -> int:
        return self.rows

    def key(self, i: int) -> bytes:
        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} of {self.rows}")
        if self.keys_blob:
            w = self.key_width
            return self.keys_blob[i * w : (i + 1) * w]
        assert self._hashes is not None
        if i < self._usable:
            return MLA_TAG + bytes(self._hashes[i])
        return KDA_TAG + bytes(self._hashes[self._usable - 1])

    def location(self, i: int) -> common_pb2.ObjectLocation:
        loc = common_pb2.ObjectLocation(node=self.nodes[int(self.node_index[i])])
        m = loc.meta
        m.key = self.key(i)
        m.kind = int(self.kind[i])
        m.tier = int(self.tier[i])
        m.size = int(self.size[i])
        m.checksum = int(self.checksum[i])
        if self.tenant_index is not None:
            m.tenant = self.tenants[int(self.tenant_index[i])]
        if self.ttl_ms is not None:
            m.ttl_ms = int(self.ttl_ms[i])
        return loc

    def locations(self, start: int = 0, stop: int | None = None) -> list[common_pb2.ObjectLocation]:
        """Rows ``[start, stop)`` as ObjectLocation messages (what ``fetch_into`` takes)."""
        return [self.location(i) for i in range(*slice(start, stop).indices(self.rows))]
