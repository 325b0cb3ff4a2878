"""HA fencing on the node: refuse orders and puts from a master whose leadership epoch is stale.

With HA on, the master leader holds an etcd lease and its **epoch** is the etcd revision at which it
created the leader key, so every later leader has a larger one. A leader that was paused (SIGSTOP, a GC
stall) or cut off from etcd can wake up believing it still leads; the node is where its word would turn
into deleted or written bytes, so the node keeps the newest epoch it has heard (from RegisterNode and
Heartbeat replies, and from the orders and puts themselves) and refuses anything older with
``StaleEpochError``. Epoch 0 means "no HA" and is never fenced, so single-master clusters are unchanged.
"""

from __future__ import annotations

import logging

from kvpool.kvstore.errors import StaleEpochError

log = logging.getLogger(__name__)


class EpochFence:
    """The newest leader epoch this node has seen, and the check every master-ordered action passes."""

    __slots__ = ("epoch", "refused")

    def __init__(self) -> None:
        self.epoch = 0
        self.refused = 0

    def observe(self, epoch: int) -> None:
        """A leader with ``epoch`` spoke to this node (a reply to our RegisterNode/Heartbeat, or an order)."""
        if epoch > self.epoch:
            if self.epoch:
                log.info(
                    "leader epoch %d -> %d: orders and puts of older leaders are refused", self.epoch, epoch
                )
            self.epoch = epoch

    def check(self, epoch: int, what: str) -> None:
        """Raise ``StaleEpochError`` if ``epoch`` is older than the newest seen; else remember it."""
        if epoch and epoch < self.epoch:
            self.refused += 1
            log.warning("refused %s from a deposed leader (epoch %d < %d)", what, epoch, self.epoch)
            raise StaleEpochError(f"{what} carries leader epoch {epoch}, older than {self.epoch}: refused")
        self.observe(epoch)
