"""The master's small durable state: tenant quotas and soft pins, so they survive a master restart.

Everything else the master knows is rebuilt from the storage nodes' inventories (RegisterNode); quotas and
pins are operator/client intent that no node holds, and losing them on failover is a known Mooncake gap
(soft pins are not replicated). The file is tiny (one entry per tenant and per pinned key), JSON, and
replaced atomically (write to a temp file, fsync, rename) on every change, so a crash leaves the old or
the new version, never a torn one. Pin deadlines are wall-clock seconds: monotonic clocks do not survive
a restart.

With HA the same document lives in etcd instead of a file (``ha.EtcdState``): the store is built from the
text read at election (``text=``) and hands every new version to ``on_save``, which writes it under the
leader's epoch so that a deposed leader's late write cannot land.
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

    def __init__(
        self,
        path: Path | None,
        wall_clock: Callable[[], float] = time.time,
        *,
        text: str | None = None,
        on_save: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self._wall = wall_clock
        self._on_save = on_save
        where = str(path) if path is not None else "master state"
        if text is None and path is not None and path.exists():
            text = self._read(path)
        self.state = self._parse(text, where) if text else DurableState()

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text()
        except OSError as exc:
            raise StateFileError(f"{path}: unreadable master state ({exc})") from None

    def _parse(self, text: str, where: str) -> DurableState:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise StateFileError(f"{where}: format {raw.get('format')!r}, expected {FORMAT}")
            quotas = {str(t): int(b) for t, b in raw["quotas"].items()}
            pins = {bytes.fromhex(k): float(until) for k, until in raw["pins"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, StateFileError):
                raise
            raise StateFileError(f"{where}: unreadable master state ({exc})") from None
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

    def has_pins(self) -> bool:
        """Whether any operator's pin is persisted (a commit then checks whether its key had one)."""
        return bool(self.state.pins)

    def pin_remaining_ms(self, key: bytes) -> int:
        """Milliseconds left on a persisted pin of ``key`` (0 if none or expired)."""
        until = self.state.pins.get(key)
        if until is None:
            return 0
        return max(0, int((until - self._wall()) * 1000))

    def save(self) -> None:
        if self.path is None and self._on_save is None:
            return
        body = json.dumps(
            {
                "format": FORMAT,
                "quotas": self.state.quotas,
                "pins": {k.hex(): u for k, u in self.state.pins.items()},
            },
            sort_keys=True,
        )
        if self._on_save is not None:
            self._on_save(body)
        if self.path is None:
            return
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
