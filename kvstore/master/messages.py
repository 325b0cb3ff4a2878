"""Building the master's replies (locations, compact location tables) and checking its requests' keys and
tenants: plain functions over proto messages, shared by every RPC of ``MasterCore``."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from kvpool.kvstore.errors import BadRequestError
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import (
    MAX_KEY_BYTES,
    LocationRow,
    ObjectInfo,
    Tier,
)
from kvpool.kvstore.master.config import MAX_KEYS_PER_CALL, MAX_TENANT_CHARS
from kvpool.proto import common_pb2, master_pb2


def copy_endpoint(ep: common_pb2.NodeEndpoint) -> common_pb2.NodeEndpoint:
    out = common_pb2.NodeEndpoint()
    out.CopyFrom(ep)
    return out


def fill_location(loc: common_pb2.ObjectLocation, info: ObjectInfo, ep: common_pb2.NodeEndpoint) -> None:
    m = loc.meta
    m.key = info.key
    m.kind = int(info.kind)
    m.size = info.size
    m.checksum = info.checksum
    m.tenant = info.tenant
    m.parent = info.parent
    m.ttl_ms = info.ttl_ms
    m.tier = int(info.tier)
    loc.node.CopyFrom(ep)


def fill_table(
    table: master_pb2.LocationTable,
    index: PrefixIndex,
    keys: list[bytes],
    n_mla: int,
    endpoint: Callable[[str], common_pb2.NodeEndpoint],
    with_keys: bool = True,
) -> int:
    """Fill a column-wise ``LocationTable`` for ``keys`` (all committed: the caller just matched them);
    returns how many of the first ``n_mla`` rows sit on SSD.

    Why it reads the index's columns directly: a 2,000-block MatchPrefix spent ~7 ms building one
    ObjectLocation per block (``index.rows`` alone ~0.9 ms) against ~0.1 ms for a numpy gather of the same
    columns, and the MatchPrefix latency goal is 1 ms end to end. Same fields as ``fill_row``.
    """
    slots = index._slot
    idx = np.fromiter(map(slots.__getitem__, keys), dtype=np.int64, count=len(keys))
    cols = index._cols
    table.rows = len(keys)
    if not keys:
        return 0
    nodes = cols.node[idx]
    if (nodes == nodes[0]).all():  # the common case: one node holds the whole chain
        node_ids, node_index = nodes[:1], np.zeros(len(keys), dtype="<u2")
    else:
        node_ids, node_index = np.unique(nodes, return_inverse=True)
    for nid in node_ids.tolist():
        table.nodes.append(endpoint(index._node_names[nid]))
    table.node_index = node_index.astype("<u2").tobytes()
    if with_keys:
        width = len(keys[0])
        blob = b"".join(keys)
        if len(blob) != width * len(keys):  # cannot happen: every key is a kind tag + a validated hash
            raise BadRequestError("matched keys differ in length")
        table.key_width = width
        table.keys = blob
    table.kind = cols.kind[idx].astype("u1").tobytes()
    tiers = cols.tier[idx]
    table.tier = tiers.astype("u1").tobytes()
    table.size = cols.size[idx].astype("<u8").tobytes()
    table.checksum = cols.checksum[idx].astype("<u8").tobytes()
    tenants = cols.tenant[idx]
    if tenants.any():
        tenant_ids, tenant_index = np.unique(tenants, return_inverse=True)
        table.tenants.extend(index._tenants[t] for t in tenant_ids.tolist())
        table.tenant_index = tenant_index.astype("<u2").tobytes()
    ttl = index._ttl
    if ttl and any(s in ttl for s in idx.tolist()):
        now = index._clock()
        table.ttl_ms = np.array(
            [max(1, int((ttl[s] - now) * 1000)) if s in ttl else 0 for s in idx.tolist()], dtype="<u4"
        ).tobytes()
    return int(np.count_nonzero(tiers[:n_mla] == Tier.SSD))


def fill_row(loc: common_pb2.ObjectLocation, row: LocationRow, ep: common_pb2.NodeEndpoint) -> None:
    """Like fill_location for the MatchPrefix fast path; ``meta.parent`` is left out (the previous
    entry of the reply is the parent)."""
    m = loc.meta
    m.key = row.key
    m.kind = row.kind
    m.size = row.size
    m.checksum = row.checksum
    m.tier = row.tier
    if row.tenant:
        m.tenant = row.tenant
    if row.ttl_ms:
        m.ttl_ms = row.ttl_ms
    loc.node.CopyFrom(ep)


def check_key(key: bytes) -> None:
    if not key or len(key) > MAX_KEY_BYTES:
        raise BadRequestError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def check_keys(keys: Iterable[bytes]) -> list[bytes]:
    out = list(keys)
    if len(out) > MAX_KEYS_PER_CALL:
        raise BadRequestError(f"more than {MAX_KEYS_PER_CALL} keys in one call")
    for key in out:
        check_key(key)
    return out


def check_tenant(tenant: str) -> None:
    if len(tenant) > MAX_TENANT_CHARS:
        raise BadRequestError(f"tenant name longer than {MAX_TENANT_CHARS} characters")
