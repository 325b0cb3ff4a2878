"""The oracle of the compiled admission control (``kvstore/index/admission.pyx`` over ``admission.h``): the
plain-Python original, kept as it was; the oracle index (tests/oracle/prefix_index.py) runs on it, so the
index's differential test holds the compiled one to its answers.

Admission control for a hybrid cache: which new chains are worth their bytes, learned from ghosts.

Why: on a K3-class model a chain's new objects cost one 429 MiB KDA checkpoint plus 13.5 MiB per MLA
block, and most of them are never read again (on the Mooncake conversation trace two in three checkpoints
are not). Under LRU every write pushes out something older, so at small capacities everything is evicted
before its reuse arrives. Refusing the writes least likely to be reused lets the admitted ones live long
enough to hit.

Mechanism (docs/design/eviction.md, "hybrid"), decided per *chain* at the writer's lookup and applied
per object at its put:

1. **Ghosts.** A bounded LRU set of block hashes (32 bytes each, no object bytes) of what was refused or
   evicted. A lookup that walks past the real MLA run over ghost hashes proves that a chain the cache did
   not keep came back: the new turn of a conversation, a re-sent document.
2. **Verdict at the lookup** (``on_lookup``, the prefill's fetch): the request will write the blocks its
   lookup missed. They are admitted when the chain is a *continuation* (real run + ghost run covers at
   least ``continuation_fraction`` of the looked-up blocks: continued chains are reused about twice as
   often as new ones) or, for new chains, when the chain is *sampled*: the first missing block's hash,
   read as a number in [0, 1), is below the sampling rate ``q``. The verdict is remembered per missing
   block hash (a *ticket*) for ``ticket_ms``, the time a put may follow its lookup.
3. **Verdict at the put** (``admit``): a ticketed block (or the checkpoint keyed by it) gets its ticket's
   verdict. An unticketed object (a reply's blocks, a put without a lookup) follows its chain: refused when
   its parent (MLA) or its own block (checkpoint) was refused and is not cached, admitted otherwise.
4. **Adaptive q** (ARC-style; every signal weighs bytes / capacity): a lookup whose ghost run covers
   *refused* blocks is a hit that admission cost: q grows by ``step`` x their bytes / capacity. One that
   covers *evicted* blocks is a reuse that came too late for what the cache admitted, and an object
   evicted never read after its write was an admission wasted: both shrink q by the factor
   (1 - ``step`` x bytes / capacity). Large caches evict little, so q stays at 1 (admit everything: the
   eviction order alone); small ones settle where refused reuse and wasted writes balance.

Pure and clock-injected like the index that owns it, so the master and the simulator decide alike.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Admission tunables (master flags ``--admission-*``)."""

    continuation_fraction: float = 0.8  # real + ghost run share of the lookup that marks a continuation
    initial_rate: float = 1.0  # q at start: admit everything until evictions say otherwise
    min_rate: float = 0.02  # q never drops below this, so new chains can always prove themselves
    step: float = 0.2  # learning rate of q: per signal, bytes / capacity x step
    ghost_entries: int = 1 << 18  # block hashes remembered (~100 bytes each)
    ticket_ms: int = 30_000  # how long a lookup's verdict waits for its puts

    def check(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("continuation_fraction", "initial_rate", "min_rate", "step"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"admission {name} must be in [0, 1], got {v!r}")
        if self.min_rate > self.initial_rate:
            raise ValueError("admission min_rate must not exceed initial_rate")
        if self.ghost_entries < 0 or self.ticket_ms <= 0:
            raise ValueError("admission ghost_entries must be >= 0 and ticket_ms > 0")


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
