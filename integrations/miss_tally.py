"""What an engine's storage plug-in counts and says while serving, where every store problem is a miss.

Why: inside another engine (SGLang's cache controller, LMCache's server) a store failure must not raise;
it becomes a miss, a counter the operator can read, and a warning, at most one per kind per interval so a
dead store does not flood the engine's log. Shared by the SGLang and LMCache backends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvpool.kvstore.errors import ObjectNotAdmittedError


class MissTally:
    """Thread-safe counters and rate-limited warnings (one per kind per ``warn_every_s``)."""

    def __init__(self, log: logging.Logger, warn_every_s: float) -> None:
        self._log = log
        self._every = warn_every_s
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._warned: dict[str, float] = {}

    def count(self, name: str, n: float = 1) -> None:
        if n:
            with self._lock:
                self._counters[name] = self._counters.get(name, 0) + n

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    def put_errors(self, errors: Sequence[BaseException | None], kind: str, what: str) -> None:
        """A ``batch_put``'s per-item errors: an object admission turned away counts as ``not_admitted``
        (the store chose not to keep it, nothing failed), any other failure as ``<kind>_errors`` with a
        rate-limited warning ``<what> failed: <error>``."""
        for err in errors:
            if isinstance(err, ObjectNotAdmittedError):
                self.count("not_admitted")
            elif err is not None:
                self.count(f"{kind}_errors")
                self.warn(kind, f"{what} failed: {err}")

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get(kind, -self._every) < self._every:
                return
            self._warned[kind] = now
        self._log.warning("%s (a miss; counted)", message)
