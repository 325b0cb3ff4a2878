"""Online model of *when a checkpoint's chain will be read next*, per request class (the default policy's
predictor; docs/design/eviction.md §1.1).

Why: on conversation traffic the time to a chain's next read has a shape LRU cannot follow: some reads
come within a second (duplicates), few in the next 5-30 s, most at 30-120 s (think time), and almost none
after 5-10 min. An object's *age* (seconds since its last use) therefore says very different things
about its future depending on the request that wrote it. This module learns that distribution from the
store's own reads and turns (class, age) into an expected read rate.

Mechanism:

1. **Classes.** A writer's lookup (``on_lookup``) gives its request a class: continuation or not (the
   deepest checkpoint on its chain, cached or a ghost, covers at least half of the lookup), a bucket of the
   blocks it will compute (<= 1, 2-3, 4-7, 8-15, 16+) and whether the chain had been read before. The
   missing block hashes are *ticketed* with it; a checkpoint or MLA block put under a ticket takes its
   class, an unticketed one (a reply's blocks, decode's end-of-output checkpoint) inherits its anchor's
   class with the *beyond the prompt* bit set. A checkpoint that is read takes its reader's class with
   the *read* bit: its next return is that of a re-read chain. A checkpoint a client names in a
   retention hint (a pin, granted or refused) takes the *hinted* bit of its TTL tier: the client says it
   will come back, and how often that is true, and how soon, is learned like everything else.
2. **Observations** (ages are seconds since the object's last use): a read of a cached checkpoint is a
   return at its age; an evicted checkpoint becomes a *ghost* (its hash, class and last use, no bytes)
   and a later lookup through its block is a return too (the deepest one on the lookup's path: the read
   the cache would have served). A ghost forgotten (bounded count, or older than the horizon) is censored
   at its age: it survived that long without a read.
3. **Estimate.** Kaplan-Meier over log-spaced age bins per class, each class's hazard shrunk toward the
   pooled one by ``prior`` pseudo-observations (sparse classes borrow the population's curve). From the
   survival S: P(read before the horizon | unread at age a) = 1 - S(H)/S(a), and the expected wait
   E[T - a | a < T <= H]. Their ratio is the expected reads per second, the rate the policy prices per
   byte. Ages past every observed return give a rate near zero: overdue objects go first.

Pure and clock-free (ages are given), so the master and the simulator learn alike.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from kvpool.kvstore.index.lru_map import LruMap

# age bins: [0, E_1), [E_1, E_2), ... with E_i = FIRST_EDGE_S * 2^((i-1)/2); the last is open-ended
FIRST_EDGE_S = 0.125
BINS = 36  # 0.125 s .. ~5.8 h in half-octaves
HORIZON_BIN = BINS - 1  # reads later than the start of the last bin do not count as returns
NEW_BUCKETS = (1, 3, 7, 15)  # blocks to compute: <= 1, 2-3, 4-7, 8-15, 16+
CONTINUATION = 1
GAP_BUCKETS = (20.0, 120.0)  # seconds since the chain's previous read: none, < 20 s, 20-120 s, longer
LONG_HINT_MS = 600_000  # a retention hint longer than 10 min is a "long" one (a shared prefix, not a turn)
# class = cont (0/1) + 2 x new bucket (0..4) + READ x read + BEYOND x beyond the prompt + GAP x gap bucket
#         + HINT x hint tier (0 none, 1 short, 2 long)
READ = 10
BEYOND = 20
GAP = 40
HINT = GAP * (len(GAP_BUCKETS) + 2)
CLASSES = HINT * 3
RATE_FLOOR = 1e-12  # reads per second below which every rate is the same (log2 stays finite)


def _edges() -> np.ndarray:
    return np.concatenate(([0.0], FIRST_EDGE_S * np.exp2(np.arange(BINS - 1) / 2.0)))


EDGES = _edges()  # EDGES[b] = start of bin b (seconds)
MIDS = np.concatenate((EDGES[1:2] / 2, np.sqrt(EDGES[1:-1] * EDGES[2:]), EDGES[-1:] * 1.41))


_EDGE_LIST: list[float] = EDGES.tolist()
_HORIZON_S = _EDGE_LIST[HORIZON_BIN]


def age_bins(ages: np.ndarray) -> np.ndarray:
    """Bin index of each age (seconds), vectorised."""
    return np.minimum(np.searchsorted(EDGES, ages, side="right") - 1, BINS - 1)


def age_bin(age: float) -> int:
    """``age_bins`` of one age, by bisection over the same edges (no arrays: one observation at a time)."""
    return min(bisect.bisect_right(_EDGE_LIST, age) - 1, BINS - 1)


def request_class(deep: int, looked_up: int, gap_s: float | None = None) -> int:
    """Class of a request whose lookup covered ``looked_up`` blocks and whose deepest checkpoint (cached
    or a ghost) closes ``deep`` of them, read ``gap_s`` seconds after its last use (None: no read)."""
    new = looked_up - deep
    bucket = sum(new > b for b in NEW_BUCKETS)
    cont = CONTINUATION if deep > 0 and 2 * deep >= looked_up else 0
    gap = 0 if gap_s is None else 1 + sum(gap_s >= b for b in GAP_BUCKETS)
    return cont + 2 * bucket + GAP * gap


def hinted_class(cls: int, ttl_ms: int) -> int:
    """``cls`` with the hint tier of a client's retention hint of ``ttl_ms``, replacing an earlier tier: the
    latest hint is the client's current word (keeping the longer tier instead cost the generated mix 1.5
    points of token hit at 29 GiB: 54.43 % against 55.92 %)."""
    return cls % HINT + HINT * (2 if ttl_ms > LONG_HINT_MS else 1)


class ReturnTimeModel:
    """Per-class Kaplan-Meier estimate of the time to a checkpoint's next read, plus the tickets and ghosts
    that feed it (see the module docstring)."""

    def __init__(
        self,
        prior: float = 4.0,
        ghost_entries: int = 1 << 16,
        ticket_entries: int = 1 << 16,
        rebuild_every: int = 32,
        rebuild_s: float = 10.0,
    ) -> None:
        if not (math.isfinite(prior) and prior > 0):
            raise ValueError("prior must be finite and > 0")
        if ghost_entries <= 0 or ticket_entries <= 0:
            raise ValueError("ghost_entries and ticket_entries must be > 0")
        self.prior = prior
        self.ghost_entries = ghost_entries
        self.rebuild_every = rebuild_every
        self.rebuild_s = rebuild_s
        self._ends = np.zeros((CLASSES, BINS))  # finished observations (returns, forgotten ghosts) per bin
        self._events = np.zeros((CLASSES, BINS))  # returns in each bin
        self._table = np.full((CLASSES, BINS), math.log2(RATE_FLOOR))
        self._fresh = 0  # observations since the table was built
        self._built_at = -math.inf
        self.observed = 0  # returns + censored observations so far
        self._tickets = LruMap(ticket_entries)  # missing block hash -> writer's class, newest set last
        # evicted checkpoints not yet returned nor forgotten: hash -> row of the two arrays
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()
        self._g_cls = np.zeros(ghost_entries, dtype=np.int64)
        self._g_t = np.zeros(ghost_entries)
        self._g_live = np.zeros(ghost_entries, dtype=bool)
        self._g_free = list(range(ghost_entries - 1, -1, -1))

    # ------------------------------------------------------------------ observations

    def observe(self, cls: int, age: float, returned: bool) -> None:
        """One object of class ``cls`` was read at ``age`` seconds (``returned``) or is known to have gone
        unread for ``age`` seconds (censored)."""
        b = age_bin(max(age, 0.0))
        if returned and b >= HORIZON_BIN:
            returned = False  # past the horizon: counts as never within it
        self._ends[cls, b] += 1.0
        if returned:
            self._events[cls, b] += 1.0
        self.observed += 1
        self._fresh += 1

    def ticket(self, block_hashes: Sequence[bytes], cls: int) -> None:
        """The request of class ``cls`` will write these blocks (and checkpoints keyed by them); the oldest
        tickets beyond ``ticket_entries`` are forgotten. A compiled map: the index reads a put's ticket
        from it without calling the policy (``PrefixIndex``'s class of a put)."""
        self._tickets.set_newest(block_hashes, cls)

    @property
    def tickets(self) -> LruMap:
        """Block hash -> the class of the request that will write it (the index reads it per put)."""
        return self._tickets

    def class_of_put(self, block_hash: bytes, anchor_class: int | None) -> int:
        """Class of an object put for ``block_hash``: its ticket's, else its anchor's beyond the prompt."""
        cls = self._tickets.get(block_hash)
        if cls is not None:
            return cls
        if anchor_class is None:
            return BEYOND
        base = anchor_class % HINT  # a hint names its own checkpoints: the reply's are not hinted
        return (base % READ) + BEYOND + GAP * (base // GAP)

    def ghost(self, block_hash: bytes, cls: int, last_use: float, now: float) -> None:
        """A checkpoint left the cache unread since ``last_use``: remember it (oldest forgotten first, each
        forgotten one censored at its age)."""
        g = self._ghosts
        row = g.pop(block_hash, None)
        if row is None:
            if not self._g_free:
                self._forget(next(iter(g)), now)
            row = self._g_free.pop()
        g[block_hash] = row
        self._g_cls[row], self._g_t[row], self._g_live[row] = cls, last_use, True
        g_t = self._g_t
        while g:
            h, oldest = next(iter(g.items()))
            if now - g_t.item(oldest) < _HORIZON_S:
                break
            self._forget(h, now)

    def _forget(self, block_hash: bytes, now: float) -> None:
        row = self._ghosts.pop(block_hash)
        self._g_live[row] = False
        self._g_free.append(row)
        self.observe(self._g_cls.item(row), now - self._g_t.item(row), returned=False)

    def deepest_ghost(self, block_hashes: Sequence[bytes], start: int) -> int:
        """Blocks closed by the deepest ghost checkpoint among ``block_hashes[start:]`` (0 if none)."""
        g = self._ghosts
        if not g:
            return 0
        for i in range(len(block_hashes) - 1, start - 1, -1):
            if block_hashes[i] in g:
                return i + 1
        return 0

    def ghost_returned(self, block_hash: bytes, now: float) -> float:
        """A lookup passed the ghost of ``block_hash`` as its deepest checkpoint: a return; its age."""
        row = self._ghosts.pop(block_hash)
        self._g_live[row] = False
        self._g_free.append(row)
        age = now - self._g_t.item(row)
        self.observe(self._g_cls.item(row), age, returned=True)
        return age

    # ------------------------------------------------------------------ estimate

    def stale(self, now: float) -> bool:
        """Whether the table should be rebuilt before ranking (enough new observations or time)."""
        return self._fresh >= self.rebuild_every or (
            self._fresh > 0 and now - self._built_at >= self.rebuild_s
        )

    def rebuild(self, now: float, live_classes: np.ndarray, live_ages: np.ndarray) -> None:
        """Rebuild the table; ``live_*``: the cached checkpoints, unread for their ages so far. They and
        the ghosts not yet returned count as censored at their current ages (still at risk: Kaplan-Meier
        needs them, or every long wait would look like a sure return)."""
        live = self._g_live
        ghost_ages = now - self._g_t[live]
        # each at-risk object adds 1 to its (class, bin): counted in one pass (integer counts, so the sums
        # are exact in any order)
        cells = np.concatenate(
            (
                self._g_cls[live] * BINS + age_bins(np.maximum(ghost_ages, 0.0)),
                live_classes.astype(np.int64) * BINS + age_bins(np.maximum(live_ages, 0.0)),
            )
        )
        ends = self._ends + np.bincount(cells, minlength=CLASSES * BINS).reshape(CLASSES, BINS)
        self._table = self._build(ends, self._events)
        self._fresh = 0
        self._built_at = now

    def log_rates(self, classes: np.ndarray, ages: np.ndarray) -> np.ndarray:
        """log2 of the expected reads per second of objects of ``classes`` at ``ages`` seconds."""
        return self._table[classes, age_bins(ages)]

    def _build(self, ends: np.ndarray, events: np.ndarray) -> np.ndarray:
        """The table from the counts. Every step is per class (row) but the pooled hazard, and a class
        with no observation gets the pooled rates: such rows are computed once and copied, since most of
        the classes are empty in any one run (the same floats as row by row: the counts are integers)."""
        observed = (ends.sum(axis=1) + events.sum(axis=1)) > 0  # (counts are >= 0)
        seen = np.flatnonzero(observed)
        rows = seen if len(seen) == CLASSES else np.append(seen, np.argmin(observed))  # and one empty class
        rates = self._rates(ends[rows], events[rows])
        table = np.empty((CLASSES, BINS))
        table[:] = rates[-1]  # an empty class's row (or the last class's, overwritten below)
        table[seen] = rates[: len(seen)]
        return table

    def _rates(self, ends: np.ndarray, events: np.ndarray) -> np.ndarray:
        """log2 read rates per row of ``ends`` / ``events`` (classes) and age bin."""
        # at risk entering bin b = observations ending in b or later
        at_risk = np.cumsum(ends[:, ::-1], axis=1)[:, ::-1]
        pool_risk, pool_ev = at_risk.sum(axis=0), events.sum(axis=0)
        pool_h = np.divide(pool_ev, pool_risk, out=np.zeros(BINS), where=pool_risk > 0)
        hazard = (events + self.prior * pool_h) / (at_risk + self.prior)
        hazard[:, HORIZON_BIN:] = 0.0
        surv = np.cumprod(np.concatenate((np.ones((len(ends), 1)), 1.0 - hazard[:, :-1]), axis=1), axis=1)
        mass = surv * hazard  # P(read in bin b)
        # for an object entering bin b: P(read before the horizon) and E[wait | read]
        tail_mass = np.cumsum(mass[:, ::-1], axis=1)[:, ::-1]
        tail_time = np.cumsum((mass * MIDS)[:, ::-1], axis=1)[:, ::-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            p_read = np.where(surv > 0, tail_mass / surv, 0.0)
            wait = np.where(tail_mass > 0, tail_time / tail_mass - EDGES, np.inf)
            rate = np.where(p_read > 0, p_read / np.maximum(wait, FIRST_EDGE_S / 2), 0.0)
        return np.log2(np.maximum(rate, RATE_FLOOR))
