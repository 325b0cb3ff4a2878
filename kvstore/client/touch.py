"""Batched use reports for reads that never asked the master.

Why: a get of a key whose location the client already knows goes straight to the storage node (no master
round trip on the read path), so the master's eviction policy would never hear of that use and would treat
a hot object as cold. The client notes each such read here and reports them in one
``Lookup(touch=true)`` per batch (at most ``max_keys`` keys, at least every ``interval_s``), off the critical
path. A lost report only makes the policy see the use later (or not at all): it never affects a read.

``note`` may be called from any thread (the sync client's same-host fast path runs in the caller's thread);
flushing runs on the client's event loop.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

MAX_KEYS = 256
INTERVAL_S = 0.2


class TouchReporter:
    """Collects keys read directly from nodes and sends them to the master in batches."""

    def __init__(
        self,
        send: Callable[[list[bytes]], Awaitable[None]],
        loop: asyncio.AbstractEventLoop,
        *,
        max_keys: int = MAX_KEYS,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self._send = send
        self._loop = loop
        self.max_keys = max_keys
        self.interval_s = interval_s
        self._pending: collections.deque[bytes] = collections.deque()
        self._armed = False  # a flush is scheduled; read and written without a lock (a race costs one flush)
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0

    def note(self, key: bytes) -> None:
        """Record one direct read (thread-safe: deque.append is atomic)."""
        self._pending.append(key)
        if not self._armed or len(self._pending) == self.max_keys:
            self._armed = True
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                self._arm()
            else:
                self._loop.call_soon_threadsafe(self._arm)

    def _arm(self) -> None:
        delay = 0.0 if len(self._pending) >= self.max_keys else self.interval_s
        self._loop.call_later(delay, self._start_flush)

    def _start_flush(self) -> None:
        self._armed = False
        if not self._pending:
            return
        task = self._loop.create_task(self.flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Send everything pending now (also used at close)."""
        while self._pending:
            batch: list[bytes] = []
            while self._pending and len(batch) < self.max_keys:
                batch.append(self._pending.popleft())
            await self._send(batch)
            self.sent += len(batch)

    async def close(self, timeout_s: float) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        await asyncio.wait_for(self.flush(), timeout_s)
