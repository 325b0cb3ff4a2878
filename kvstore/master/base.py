"""The master's state and the helpers every part of it uses: the index, nodes, puts in flight, the per-node
order outbox, counters and endpoint lookups. ``MasterCore`` (``core``) is this plus membership and the RPCs.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.index.eviction import make_policy
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import (
    Removal,
)
from kvpool.kvstore.master.config import MasterConfig
from kvpool.kvstore.master.records import NodeAction, NodeRecord, PendingPut
from kvpool.kvstore.master.state import StateStore
from kvpool.proto import common_pb2

log = logging.getLogger(__name__)


class MasterBase:
    """State of a master; see ``core`` for the RPC semantics."""

    def __init__(
        self,
        config: MasterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        state: StateStore | None = None,
        epoch: int = 0,
    ) -> None:
        self.config = config or MasterConfig()
        self.config.validate()
        self._clock = clock
        self.index = PrefixIndex(
            make_policy(self.config.policy, depth_weight=self.config.depth_weight),
            admission=self.config.admission if self.config.policy == "hybrid" else None,
            high_watermark=self.config.high_watermark,
            low_watermark=self.config.low_watermark,
            lease_ms=self.config.lease_ms,
            clock=clock,
        )
        self.instance = secrets.token_hex(4)  # lease/put ids of an earlier master life never match
        self._nodes: dict[str, NodeRecord] = {}
        self._puts: dict[str, PendingPut] = {}
        self._put_of_key: dict[bytes, str] = {}
        self._put_seq = 0
        self._outbox: dict[str, dict[bytes, NodeAction]] = {}
        self._last_sweep = clock()
        self.counters: dict[str, int] = {}
        self._trim_sweeps_left = 0  # after a bulk adoption: sweeps that return freed memory to the OS
        self._mmap_threshold_fixed = False
        # StateFileError if unreadable: refuse to start. With HA the caller passes the state read from etcd.
        self.state = state if state is not None else StateStore(self.config.state_path)
        self.epoch = epoch  # HA leadership epoch (0 = no HA): on every put placement and node order
        for tenant, max_bytes in self.state.state.quotas.items():
            self.index.set_quota(tenant, max_bytes)

    def count(self, name: str, n: int = 1) -> None:
        """Public counter hook for the server (node call outcomes)."""
        self._count(name, n)

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            self.counters[name] = self.counters.get(name, 0) + n

    def _queue(self, node_id: str, action: NodeAction, key: bytes) -> None:
        if node_id in self._nodes:
            self._outbox.setdefault(node_id, {})[key] = action

    def _absorb_index_events(self) -> None:
        for ev in self.index.drain_events():
            self._on_removal(ev)

    def _on_removal(self, ev: Removal) -> None:
        if ev.reason == "node_lost":
            return
        self._queue(ev.node_id, NodeAction.DEMOTE if ev.demoted else NodeAction.DELETE, ev.key)

    def _endpoint(self, node_id: str) -> common_pb2.NodeEndpoint:
        rec = self._nodes.get(node_id)
        if rec is None:
            raise StoreError(f"node {node_id!r} is not registered")
        return rec.endpoint

    def _endpoint_cached(
        self, node_id: str, cache: dict[str, common_pb2.NodeEndpoint]
    ) -> common_pb2.NodeEndpoint:
        ep = cache.get(node_id)
        if ep is None:
            ep = cache[node_id] = self._endpoint(node_id)
        return ep

    @property
    def node_count(self) -> int:
        return len(self._nodes)
