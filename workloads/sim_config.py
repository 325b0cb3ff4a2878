"""``SimConfig``: what one simulated replay is asked to model (spec, eviction policy, DRAM and SSD
capacity, watermarks, checkpoint policy, admission, the TTFT model, master shards, client hints), checked
before anything runs so a bad flag is a ``ReplayError`` naming it, not a wrong figure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.eviction import POLICIES
from kvpool.kvstore.shards import ShardSet
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.labels import YARDSTICKS
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.ttft import TtftModel


@dataclass(frozen=True, slots=True)
class SimConfig:
    spec: ModelSpec
    policy: str = "hybrid"
    capacity: int | None = None  # None: unbounded
    capacity_unit: str = "bytes"  # or "blocks"
    block_size: int | None = None  # for token records; default the spec's
    checkpoints: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    store_output: bool = True
    visibility_delay_ms: float = 0.0  # objects of a request become visible this long after its arrival
    ssd_capacity: int = 0  # bytes of SSD tier under the DRAM capacity: demote on eviction, promote on hit
    admission: AdmissionConfig | None = None  # policy hybrid's admission tunables; None: the defaults
    ttft: TtftModel = field(default_factory=TtftModel)  # tier bandwidths and compute rate of the estimate
    shards: ShardSet = field(default_factory=ShardSet)  # master shards, each with its slice of the capacity
    hints: bool = True  # honour the requests' retention hints (pins, session ends); False ignores them
    pin_share: float = 0.5  # pinned bytes stay within this share of the DRAM capacity (the index's budget)
    pin_budget_step: float = 0.02  # how fast pins earn or lose that share (0: fixed; index/pin_budget.py)
    # a session's new chain pin releases its previous chain (the serving path keeps every turn's pin until
    # its TTL or the session's end: False models it; True is what a store could do instead)
    supersede: bool = False

    def check(self) -> None:
        if self.policy not in POLICIES and self.policy not in YARDSTICKS:
            valid = [*sorted(POLICIES), *YARDSTICKS]
            raise ReplayError(f"unknown eviction policy {self.policy!r}; choose one of {valid}")
        if self.capacity_unit not in ("bytes", "blocks"):
            raise ReplayError("capacity unit must be 'bytes' or 'blocks'")
        if self.capacity is not None and (type(self.capacity) is not int or self.capacity <= 0):
            raise ReplayError(f"capacity must be a positive integer, got {self.capacity!r}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ReplayError("need 0 < low watermark <= high watermark <= 1")
        if type(self.ssd_capacity) is not int or self.ssd_capacity < 0:
            raise ReplayError(f"SSD capacity must be a non-negative integer, got {self.ssd_capacity!r}")
        if self.ssd_capacity and (self.capacity is None or self.capacity_unit != "bytes"):
            raise ReplayError("an SSD tier needs a DRAM capacity in bytes (--capacity-bytes)")
        if not math.isfinite(self.visibility_delay_ms) or self.visibility_delay_ms < 0:
            raise ReplayError(f"visibility delay must be >= 0 ms, got {self.visibility_delay_ms!r}")
        bs = self.block_size or self.spec.default_block_size
        if bs <= 0 or bs % 64:
            raise ReplayError(f"block size must be a positive multiple of 64, got {bs}")
        if not 0.0 <= self.pin_share <= 1.0:
            raise ReplayError(f"pin share must be in [0, 1], got {self.pin_share!r}")
        if not 0.0 <= self.pin_budget_step <= 1.0:
            raise ReplayError(f"pin budget step must be in [0, 1], got {self.pin_budget_step!r}")
        self.ttft.check()
        if self.capacity is not None and self.capacity < self.shards.count:
            raise ReplayError(f"capacity {self.capacity} cannot be split between {self.shards.count} shards")
