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


class PointProgress:
    """One line per finished sweep point on stderr, ``[k/N] label, GiB: seconds, ETA``, whether or not it is
    a terminal: a sweep or a report takes minutes, and a log of a CI or batch run should show where it is.
    ``--no-progress`` turns it off; ``--json`` output on stdout is never touched."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.monotonic()
        self._point = self._start

    def begin(self) -> None:
        self._point = time.monotonic()

    def finished(self, label: str, capacity_bytes: int | None, seconds: float | None = None) -> None:
        """One point done; ``seconds`` is its own time when it ran elsewhere (a worker of a parallel sweep:
        the ETA, mean wall time per point so far x points left, then counts the workers' overlap)."""
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        eta = (now - self._start) / self.done * max(self.total - self.done, 0)
        cap = "unbounded" if capacity_bytes is None else f"{capacity_bytes / 2**30:,.1f} GiB"
        took = now - self._point if seconds is None else seconds
        self.stream.write(f"[{self.done}/{self.total}] {label} @ {cap}: {took:.1f} s, ETA {_duration(eta)}\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s" if whole >= 60 else f"{whole} s"


class StepProgress:
    """One line per finished step of a long command on stderr, ``[k/N] what: seconds, ETA``, whether or not
    it is a terminal (benches and the demo run for minutes in CI logs too). The ETA is the mean step so far
    times the steps left: steps of one command are alike enough for that to be a fair guide."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.monotonic()
        self._step = self._start

    def finished(self, what: str) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled:
            eta = (now - self._start) / self.done * max(self.total - self.done, 0)
            self.stream.write(
                f"[{self.label} {self.done}/{self.total}] {what}: {now - self._step:.1f} s, "
                f"ETA {_duration(eta)}\n"
            )
            self.stream.flush()
        self._step = now
