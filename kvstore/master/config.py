"""The master's tunables (``MasterConfig``, one field per CLI flag) and the limits it enforces on requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvpool.kvstore.index.admission import AdmissionConfig

MAX_KEYS_PER_CALL = 100_000
MAX_BLOCKS_PER_MATCH = 1 << 16  # 65,536 blocks x 512 tokens: far beyond any context
MAX_TENANT_CHARS = 256
MAX_PIN_MS = 24 * 3600 * 1000
# An inventory this large is a bulk load: the index is sized for it up front and the freed request memory
# is returned to the OS afterwards (smaller ones grow the index as puts do; their garbage is noise).
BULK_ADOPTION_OBJECTS = 4096
# From the first bulk load on, blocks this big are their own mappings (kvstore/master/malloc_ctl.py):
# above every per-call message of the hot paths (a 2,000-block MatchPrefix reply is ~0.2 MB), below the
# index's columns, slot lists and dict tables at scale and below a large inventory message.
BULK_MMAP_THRESHOLD = 1 << 20
# Sweeps that trim after a bulk load: the request is freed only after its reply went out, which a sweep
# can precede; a trim with nothing to release costs ~0.03 ms, the first one after 1 M objects ~4 ms.
TRIM_SWEEPS_AFTER_BULK = 3


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Tunables; the CLI flags map one to one."""

    policy: str = "hybrid"
    depth_weight: float = 0.5  # hybrid: how much a deeper checkpoint outweighs age (eviction.HybridPolicy)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # hybrid's admission control
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    heartbeat_ms: int = 1000
    node_timeout_ms: int = 5000
    lease_ms: int = 5000
    max_lease_ms: int = 60_000
    put_deadline_ms: int = 30_000
    node_call_timeout_ms: int = 2000
    sweep_ms: int = 100  # how often sweep() runs; a longer gap is treated as a master stall
    state_path: Path | None = None  # quotas and pins persisted here (JSON), None = not persisted

    def validate(self) -> None:
        self.admission.check()
        if not (0.0 <= self.depth_weight < float("inf")):
            raise ValueError("depth_weight must be finite and >= 0")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        for name in ("heartbeat_ms", "node_timeout_ms", "lease_ms", "max_lease_ms", "put_deadline_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.node_timeout_ms <= self.heartbeat_ms:
            raise ValueError("node_timeout_ms must exceed heartbeat_ms")
        if not 0 < self.sweep_ms * 2 <= self.node_timeout_ms:
            raise ValueError("sweep_ms must be at most half of node_timeout_ms")
