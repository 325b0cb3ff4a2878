"""The ``labels`` yardstick: the default policy given perfect reuse labels and nothing else.

Why: between the online default (which must *predict* whether a chain returns) and the offline
``reference`` (which knows every future read, when it comes and where the chain stops sharing) a reader
needs to see what better prediction alone could buy. ``labels`` knows, for each checkpoint at its write and
after each read, only **whether** a later lookup will pass its block (a potential read, as the reference
counts them); **when** it comes is not told: the wait is the return-time curve the policy learns online
from the whole population of returning checkpoints (one class for "will be read", one for "will not").
Everything else is the shipped default: the same index, admission, dead blocks first, placement of
checkpoints by the workers' rules. Its predictions are exact, so the recency guard is off (weight 1).

It is a simulator-only policy (``--policy labels``): the labels come from the trace, which a store never
has. Runs on a list of requests (the future must be known), not a stream.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from kvpool.kvstore.index.eviction import HybridPolicy, PolicyColumns
from kvpool.workloads.chains import ChainBuilder
from kvpool.workloads.trace import Request

WILL_READ, WILL_NOT = 0, 1
YARDSTICKS = ("labels",)  # simulator policies that read the future (online otherwise)


class ReuseOracle:
    """For each block hash, the times (simulator clock) of the lookups that would *read* a checkpoint on it:
    the deepest block of the lookup's range that an earlier request already computed (where the deepest
    checkpoint of an unbounded cache that checkpoints every block would sit)."""

    def __init__(self, requests: Sequence[Request], spec_name: str, block_size: int) -> None:
        builder = ChainBuilder(spec_name, block_size)
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
        times: dict[bytes, list[float]] = {}
        seen: set[bytes] = set()
        for seq, i in enumerate(order):
            req = requests[i]
            chain = builder.chain(req, with_output=True)
            cap = min((req.input_length - 1) // block_size, chain.prompt_blocks) if req.input_length else 0
            now = req.arrival_ms / 1000.0 + seq * 1e-6  # the simulator's clock for this lookup
            for j in range(cap - 1, -1, -1):
                if chain.hashes[j] in seen:
                    times.setdefault(chain.hashes[j], []).append(now)
                    break
            seen.update(chain.hashes)
        self._times = times

    def read_after(self, block_hash: bytes, now: float) -> bool:
        """Whether some lookup after ``now`` would read a checkpoint on ``block_hash``."""
        t = self._times.get(block_hash)
        return t is not None and bisect_right(t, now) < len(t)


class LabelsPolicy(HybridPolicy):
    """The default's ranking with the class replaced by the oracle's label (module docstring)."""

    name = "labels"

    def __init__(self, oracle: ReuseOracle) -> None:
        super().__init__(guard_step=0.0, initial_weight=1.0)
        self.oracle = oracle

    def on_insert(self, cols: PolicyColumns, slot: int, key: bytes, kind: int, anchor_slot: int) -> None:
        super().on_insert(cols, slot, key, kind, anchor_slot)
        now = float(cols.last_use[slot])  # set to the insert's clock before the hook
        self._klass[slot] = WILL_READ if self.oracle.read_after(key[1:], now) else WILL_NOT

    def on_hint(self, cols: PolicyColumns, slots: Sequence[int], ttl_ms: int) -> None:
        """A client's hint changes nothing: the classes are the oracle's labels."""

    def class_after_read(self, block_hash: bytes, request_class: int, now: float) -> int:
        return WILL_READ if self.oracle.read_after(block_hash, now) else WILL_NOT
