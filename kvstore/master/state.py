"""The master's small durable state: tenant quotas and soft pins, so they survive a master restart.

Everything else the master knows is rebuilt from the storage nodes' inventories (RegisterNode); quotas and
pins are operator/client intent that no node holds, and losing them on failover is a known Mooncake gap
(soft pins are not replicated). The file is tiny (one entry per tenant and per pinned key), JSON, and
replaced atomically (write to a temp file, fsync, rename) on every change, so a crash leaves the old or
the new version, never a torn one. Pin deadlines are wall-clock seconds: monotonic clocks do not survive
a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1


class StateFileError(ValueError):
    """The state file exists but is not a master state file this version can read."""


@dataclass
class DurableState:
    """Quotas (tenant -> bytes) and pins (key -> wall-clock deadline, seconds)."""

    quotas: dict[str, int] = field(default_factory=dict)
    pins: dict[bytes, float] = field(default_factory=dict)


class StateStore:
    """Load once at start, then ``save()`` after each change. ``path=None`` keeps state in memory only."""

    def __init__(self, path: Path | None, wall_clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._wall = wall_clock
        self.state = self._load()

    def _load(self) -> DurableState:
        if self.path is None or not self.path.exists():
            return DurableState()
        try:
            raw = json.loads(self.path.read_text())
            if raw.get("format") != FORMAT:
                raise StateFileError(f"{self.path}: format {raw.get('format')!r}, expected {FORMAT}")
            quotas = {str(t): int(b) for t, b in raw["quotas"].items()}
            pins = {bytes.fromhex(k): float(until) for k, until in raw["pins"].items()}
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StateFileError):
                raise
            raise StateFileError(f"{self.path}: unreadable master state ({exc})") from None
        now = self._wall()
        return DurableState(quotas, {k: u for k, u in pins.items() if u > now})

    def set_quota(self, tenant: str, max_bytes: int) -> None:
        if max_bytes:
            self.state.quotas[tenant] = max_bytes
        else:
            self.state.quotas.pop(tenant, None)
        self.save()

    def set_pins(self, keys: list[bytes], ttl_ms: int) -> None:
        now = self._wall()
        for key in keys:
            if ttl_ms:
                self.state.pins[key] = now + ttl_ms / 1000.0
            else:
                self.state.pins.pop(key, None)
        self.state.pins = {k: u for k, u in self.state.pins.items() if u > now}
        self.save()

    def pin_remaining_ms(self, key: bytes) -> int:
        """Milliseconds left on a persisted pin of ``key`` (0 if none or expired)."""
        until = self.state.pins.get(key)
        if until is None:
            return 0
        return max(0, int((until - self._wall()) * 1000))

    def save(self) -> None:
        if self.path is None:
            return
        body = json.dumps(
            {
                "format": FORMAT,
                "quotas": self.state.quotas,
                "pins": {k.hex(): u for k, u in self.state.pins.items()},
            },
            sort_keys=True,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name, dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
