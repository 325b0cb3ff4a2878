"""A manual clock for the pure, clock-injected parts (``PrefixIndex``, ``MasterCore``, the simulator).

Tests move time explicitly (``clock.t = ...`` or ``clock.advance(s)``), so every run is identical and nothing
waits on the wall clock.
"""

from __future__ import annotations


class Clock:
    """Callable like ``time.monotonic``; starts at ``start`` seconds."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
