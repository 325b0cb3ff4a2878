"""A dependency-free progress bar on stderr for long replays; silent when stderr is not a terminal
(CI logs, pipes) unless forced, so ``--json`` output stays clean either way."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Callable ``(done, total)``; redraws at most ~10 times a second."""

    def __init__(self, label: str, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self._last = 0.0
        self._start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = done / max(now - self._start, 1e-9)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {rate:,.0f}/s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
