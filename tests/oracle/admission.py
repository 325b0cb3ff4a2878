"""The oracle of the compiled admission control (``kvstore/index/admission.pyx`` over ``admission.h``): the
plain-Python original, kept as it was; the oracle index (tests/oracle/prefix_index.py) runs on it, so the
index's differential test holds the compiled one to its answers.

The mechanism and its reasons are in the compiled module's docstring (``kvstore/index/admission.pyx``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvpool.kvstore.index.admission import AdmissionConfig


def _unit(block_hash: bytes) -> float:
    """A block hash read as a number in [0, 1): SHA-256 output, so uniform and the same on every master."""
    return int.from_bytes(block_hash[:8], "big") / 2.0**64


class Admission:
    """Ghosts, tickets and the adaptive sampling rate of one index (see the module docstring)."""

    __slots__ = ("_clock", "_expiry", "_ghost", "_tickets", "admitted", "config", "floor", "rate", "refused")

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float]) -> None:
        config.check()
        self.config = config
        self.rate = config.initial_rate
        # the sampling rate in force is at least this: the default policy raises it as far as its recency
        # guard has fallen back towards LRU (1 - w), so a cache where refusals cost hits admits everything
        self.floor = 0.0
        self._clock = clock
        # block hash -> bytes it held, > 0 when refused, < 0 when evicted
        self._ghost: OrderedDict[bytes, int] = OrderedDict()
        self._tickets: dict[bytes, tuple[bool, float]] = {}
        self._expiry: deque[tuple[float, bytes]] = deque()
        self.refused = 0  # objects refused since start
        self.admitted = 0  # ticketed objects admitted since start

    # ------------------------------------------------------------------ learning

    def remember(self, block_hash: bytes, size: int, *, refused: bool) -> None:
        """Add a block hash to the ghosts (``size`` bytes refused, or evicted), oldest forgotten first."""
        g = self._ghost
        old = g.pop(block_hash, 0)
        g[block_hash] = max(abs(old), size) * (1 if refused else -1)
        if len(g) > self.config.ghost_entries:
            g.popitem(last=False)

    def evicted(self, block_hash: bytes, size: int, capacity: int, *, unread: bool) -> None:
        """An MLA block or checkpoint left the cache by pressure; ``unread``: never read after its write,
        so admission spent its bytes for nothing."""
        self.remember(block_hash, size, refused=False)
        if unread:
            self._shrink(size, capacity)

    def _shrink(self, size: int, capacity: int) -> None:
        if capacity > 0:
            cut = min(1.0, self.config.step * size / capacity)
            self.rate = max(self.config.min_rate, self.rate * (1.0 - cut))

    def on_lookup(self, block_hashes: Sequence[bytes], run: int, capacity: int) -> None:
        """A writer's lookup (``run`` MLA blocks cached): learn from its ghost run, then ticket the blocks
        it will write."""
        n = len(block_hashes)
        if run >= n:
            return
        g = self._ghost
        end, refused, evicted = run, 0, 0
        while end < n and (size := g.get(block_hashes[end])) is not None:
            if size > 0:
                refused += size
            else:
                evicted -= size
            end += 1
        if refused and capacity > 0:  # a chain admission turned away came back: it would have hit
            self.rate = min(1.0, self.rate + self.config.step * refused / capacity)
        if evicted:  # a chain the cache let go came back: what was admitted since pushed it out
            self._shrink(evicted, capacity)
        rate = max(self.rate, self.floor)
        verdict = end >= self.config.continuation_fraction * n or _unit(block_hashes[run]) < rate
        now = self._clock()
        self._expire(now)
        until = now + self.config.ticket_ms / 1000.0
        ticket, tickets, expiry = (verdict, until), self._tickets, self._expiry.append
        for h in block_hashes[run:]:
            tickets[h] = ticket
            expiry((until, h))

    # ------------------------------------------------------------------ deciding

    def admit(
        self, block_hash: bytes, size: int, hangs_on: bytes, find: Callable[[bytes], object | None]
    ) -> bool:
        """Whether an MLA block or checkpoint of ``block_hash`` (``size`` bytes) may be written. An
        unticketed object follows its chain: refused when ``hangs_on`` (the key of its parent block, or of
        a checkpoint's own block; b"" for none) was refused and is not cached (``find`` gives None)."""
        ticket = self._tickets.get(block_hash)
        if ticket is not None and ticket[1] >= self._clock():
            ok = ticket[0]
        else:
            ok = not (hangs_on and find(hangs_on) is None and self.was_refused(hangs_on[1:]))
        if ok:
            self.admitted += 1
        else:
            self.refused += 1
            self.remember(block_hash, size, refused=True)
        return ok

    def was_refused(self, block_hash: bytes) -> bool:
        """Whether the latest ghost of ``block_hash`` is a refusal."""
        return self._ghost.get(block_hash, 0) > 0

    def _expire(self, now: float) -> None:
        q, t = self._expiry, self._tickets
        while q and q[0][0] < now:
            until, h = q.popleft()
            ticket = t.get(h)
            if ticket is not None and ticket[1] == until:
                del t[h]
