"""Node membership: registration with a full inventory (bulk adoption after a master restart), heartbeats,
and forgetting a node that died, so its objects leave the index within a deadline.
"""

from __future__ import annotations

import logging

from kvpool.kvstore.errors import BadRequestError
from kvpool.kvstore.index.records import (
    DuplicateKeyError,
    ObjectKind,
    StoreIndexError,
    Tier,
    UnknownNodeError,
)
from kvpool.kvstore.master.base import MasterBase
from kvpool.kvstore.master.config import BULK_ADOPTION_OBJECTS, BULK_MMAP_THRESHOLD, TRIM_SWEEPS_AFTER_BULK
from kvpool.kvstore.master.malloc_ctl import fix_mmap_threshold, release_free_heap
from kvpool.kvstore.master.messages import copy_endpoint
from kvpool.kvstore.master.records import NodeAction, NodeRecord
from kvpool.proto import common_pb2, master_pb2

log = logging.getLogger(__name__)


class NodeMembership(MasterBase):
    """The storage-node side of the master."""

    def register_node(self, req: master_pb2.RegisterNodeRequest) -> master_pb2.RegisterNodeReply:
        """(Re)join a node and adopt its inventory: how a restarted master rebuilds its index, and how a
        restarted node's surviving (SSD) objects become visible again. Whatever the index believed about
        this node before is replaced by what the node says it holds."""
        ep = req.node
        if not ep.node_id or not ep.host or not 0 < ep.grpc_port < 65536:
            raise BadRequestError("node needs node_id, host and a grpc_port in 1..65535")
        if req.dram_capacity_bytes == 0 and req.ssd_capacity_bytes == 0:
            raise BadRequestError("node must offer DRAM or SSD capacity")
        if ep.node_id in self._nodes:
            self._forget_node(ep.node_id, reason="reregistered")
        self.index.add_node(ep.node_id, req.dram_capacity_bytes, req.ssd_capacity_bytes)
        self._nodes[ep.node_id] = NodeRecord(copy_endpoint(ep), self._clock())
        inventory = req.inventory
        bulk = len(inventory) >= BULK_ADOPTION_OBJECTS
        if bulk:
            self._prepare_bulk_adoption(len(inventory))
        adopted = 0
        for meta in inventory:
            if self._adopt(ep.node_id, meta):
                adopted += 1
        self.index.evict()  # once everything is linked: leaf-first is only meaningful on a complete forest
        self._absorb_index_events()
        if bulk:  # not now: the request still lives (the caller holds it), trimming would keep its pages
            self._trim_sweeps_left = TRIM_SWEEPS_AFTER_BULK
        self._count("nodes_registered")
        self._count("objects_adopted", adopted)
        log.info("node %s registered: %d objects adopted of %d", ep.node_id, adopted, len(req.inventory))
        return master_pb2.RegisterNodeReply(
            heartbeat_interval_ms=self.config.heartbeat_ms,
            node_timeout_ms=self.config.node_timeout_ms,
            adopted_objects=adopted,
            epoch=self.epoch,
        )

    def _adopt(self, node_id: str, meta: common_pb2.ObjectMeta) -> bool:
        tier = Tier.SSD if meta.tier == common_pb2.SSD else Tier.DRAM
        try:
            self.index.insert(
                meta.key,
                ObjectKind(meta.kind) if meta.kind in ObjectKind._value2member_map_ else ObjectKind.BLOB,
                meta.size,
                node_id=node_id,
                tier=tier,
                tenant=meta.tenant,
                parent=meta.parent,
                checksum=meta.checksum,
                ttl_ms=meta.ttl_ms,
                evict=False,
            )
        except DuplicateKeyError:
            # already indexed elsewhere (one replica is tracked): this copy is unreachable bytes on the node
            self._count("adopt_duplicates")
            self._queue(node_id, NodeAction.DELETE, meta.key)
            return False
        except StoreIndexError as exc:
            self._count("adopt_rejected")
            log.warning("node %s: cannot adopt %s: %s", node_id, meta.key[:9].hex(), exc)
            self._queue(node_id, NodeAction.DELETE, meta.key)
            return False
        self._restore_pin(meta.key)
        return True

    def _prepare_bulk_adoption(self, objects: int) -> None:
        """Before adopting a large inventory: size the index for it once, and (first time) pin the mmap
        threshold so the big blocks of this and later loads go back to the OS when freed (overview §7)."""
        if not self._mmap_threshold_fixed:
            self._mmap_threshold_fixed = fix_mmap_threshold(BULK_MMAP_THRESHOLD)
        self.index.reserve(objects)

    def _release_adoption_garbage(self) -> None:
        """Run by the sweep for a few rounds after a bulk adoption, by when its request has been freed: hand
        the pages it occupied back to the OS (``kvstore/master/malloc_ctl.py``). Never on a put/get path."""
        if not self._trim_sweeps_left:
            return
        self._trim_sweeps_left -= 1
        if release_free_heap():
            self._count("heap_trims")

    def _restore_pin(self, key: bytes) -> None:
        """Re-apply a pin that outlived an earlier master (or an earlier copy of the object)."""
        remaining = self.state.pin_remaining_ms(key)
        if remaining:
            self.index.pin([key], remaining)
            self._count("pins_restored")

    def heartbeat(self, req: master_pb2.HeartbeatRequest) -> master_pb2.HeartbeatReply:
        if not req.node_id:
            raise BadRequestError("heartbeat without node_id")
        rec = self._nodes.get(req.node_id)
        if rec is None:
            self._count("heartbeats_unknown")
            return master_pb2.HeartbeatReply(reregister=True, epoch=self.epoch)
        rec.last_heartbeat = self._clock()
        rec.dram_reported = req.dram_used_bytes
        rec.ssd_reported = req.ssd_used_bytes
        return master_pb2.HeartbeatReply(reregister=False, epoch=self.epoch)

    def _forget_node(self, node_id: str, reason: str) -> int:
        """Drop a node and everything indexed on it (dead, or about to re-adopt its inventory)."""
        self._nodes.pop(node_id, None)
        self._outbox.pop(node_id, None)
        for put_id in [p.put_id for p in self._puts.values() if p.node_id == node_id]:
            put = self._puts.pop(put_id)
            if self._put_of_key.get(put.key) == put_id:
                del self._put_of_key[put.key]
        try:
            dropped = self.index.remove_node(node_id)
        except UnknownNodeError:
            return 0
        self._count(f"objects_dropped_{reason}", len(dropped))
        return len(dropped)
