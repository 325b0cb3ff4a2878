"""A trace record (:class:`Request`) and its rules: what one request of a workload is, whatever the file.

Why apart from the readers (``trace`` for JSONL, ``trace_columnar`` for Parquet): both build and check the
same record, millions at a time (``collector_paused``), and neither form's reader should depend on the
other's.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvpool.workloads.errors import TraceFormatError

MOONCAKE_BLOCK = 512  # tokens per hash id in the FAST'25 traces
KVPOOL_FORMAT = "kvpool-trace/1"


@dataclass(slots=True)
class Request:
    """One request of a workload, in arrival order.

    ``tokens`` are the prompt ids (what a live replay sends); ``output_tokens`` the reply a later turn
    quotes (generators only, so the simulator can store output blocks as decode would). ``hash_ids`` are
    Mooncake-style block ids of ``block_size`` tokens, the last block possibly partial.
    """

    request_id: str
    arrival_ms: float
    input_length: int
    output_length: int
    tokens: list[int] | None = None
    output_tokens: list[int] | None = None
    hash_ids: list[int] | None = None
    block_size: int = MOONCAKE_BLOCK
    tenant: str = "default"
    workload: str = "trace"
    conversation_id: str | None = None
    turn: int = 0
    # Client retention hints (docs/design/eviction.md §1.3), as an API client states them: absent from
    # Mooncake traces. ``cache_key`` groups a session's chains (OpenAI ``prompt_cache_key``);
    # ``retention_tier`` / ``retention_ms`` ask the store to keep the prompt's chain that long (Anthropic
    # ``cache_control`` ttl "5m" / "1h"), and price its written tokens at that tier; the first
    # ``retained_prefix_tokens`` tokens (a system prompt, a repository) may carry their own, longer tier;
    # ``session_end`` says no turn follows, so the session's pins can go.
    cache_key: str | None = None
    retention_tier: str | None = None
    retention_ms: int = 0
    retained_prefix_tokens: int = 0
    prefix_retention_tier: str | None = None
    prefix_retention_ms: int = 0
    session_end: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_hints(self) -> bool:
        """Whether the record carries any retention hint (the simulator skips the rest cheaply)."""
        return bool(self.retention_ms or self.prefix_retention_ms or self.session_end)

    def validate(self) -> Request:
        """Raise ``TraceFormatError`` (no location) if the record is inconsistent; return self."""
        for name in ("input_length", "output_length", "turn", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise TraceFormatError(f"{name} must be a non-negative integer, got {value!r}")
        if self.block_size == 0:
            raise TraceFormatError("block_size must be positive")
        if not isinstance(self.arrival_ms, int | float) or isinstance(self.arrival_ms, bool):
            raise TraceFormatError(f"arrival time must be a number, got {self.arrival_ms!r}")
        if not math.isfinite(self.arrival_ms) or self.arrival_ms < 0:
            raise TraceFormatError(f"arrival time must be finite and >= 0, got {self.arrival_ms!r}")
        if self.tokens is None and self.hash_ids is None:
            raise TraceFormatError("a record needs 'tokens' or 'hash_ids'")
        if self.tokens is not None:
            _check_int_list("tokens", self.tokens)
            if len(self.tokens) != self.input_length:
                raise TraceFormatError(
                    f"input_length {self.input_length} != number of tokens {len(self.tokens)}"
                )
        if self.output_tokens is not None:
            _check_int_list("output_tokens", self.output_tokens)
            if len(self.output_tokens) != self.output_length:
                raise TraceFormatError(
                    f"output_length {self.output_length} != number of output tokens {len(self.output_tokens)}"
                )
        if self.hash_ids is not None:
            _check_int_list("hash_ids", self.hash_ids)
            want = -(-self.input_length // self.block_size)
            if len(self.hash_ids) != want:
                raise TraceFormatError(
                    f"{len(self.hash_ids)} hash_ids for input_length {self.input_length}: expected "
                    f"ceil({self.input_length}/{self.block_size}) = {want}"
                )
        if not isinstance(self.tenant, str) or not isinstance(self.workload, str):
            raise TraceFormatError("tenant and workload must be strings")
        self._validate_hints()
        return self

    def _validate_hints(self) -> None:
        if self.cache_key is not None:
            if not isinstance(self.cache_key, str):
                raise TraceFormatError(f"cache_key must be a string, got {self.cache_key!r}")
            if not 0 < len(self.cache_key) <= MAX_CACHE_KEY_CHARS:
                raise TraceFormatError(
                    f"cache_key must be 1 to {MAX_CACHE_KEY_CHARS} characters, got {len(self.cache_key)}"
                )
        if type(self.session_end) is not bool:
            raise TraceFormatError(f"session_end must be true or false, got {self.session_end!r}")
        for tier_name, ms_name in (
            ("retention_tier", "retention_ms"),
            ("prefix_retention_tier", "prefix_retention_ms"),
        ):
            tier, ms = getattr(self, tier_name), getattr(self, ms_name)
            if type(ms) is not int or ms < 0:
                raise TraceFormatError(f"{ms_name} must be a non-negative integer, got {ms!r}")
            if tier is not None and (not isinstance(tier, str) or not tier):
                raise TraceFormatError(f"{tier_name} must be a non-empty string, got {tier!r}")
            if (tier is None) != (ms == 0):
                raise TraceFormatError(f"{tier_name} and {ms_name} come together (a tier names its TTL)")
        if type(self.retained_prefix_tokens) is not int or self.retained_prefix_tokens < 0:
            raise TraceFormatError(
                f"retained_prefix_tokens must be a non-negative integer, got {self.retained_prefix_tokens!r}"
            )
        if (self.retained_prefix_tokens == 0) != (self.prefix_retention_tier is None):
            raise TraceFormatError("retained_prefix_tokens and prefix_retention_tier come together")
        if self.retained_prefix_tokens > self.input_length:
            raise TraceFormatError(
                f"retained_prefix_tokens {self.retained_prefix_tokens} > input_length {self.input_length}"
            )


# The gateway's bound on a session key (gateway/cache_hints.py MAX_KEY_CHARS, the master's session bound):
# a trace's cache_key must fit it to be replayed live as sent.
MAX_CACHE_KEY_CHARS = 256

# The TTL of each retention tier a client may name (Anthropic's cache_control ttl values; OpenAI's
# ``prompt_cache_retention`` "24h" too). A trace may state another tier with its own ``retention_ms``.
RETENTION_TIERS_MS: dict[str, int] = {"5m": 300_000, "1h": 3_600_000, "24h": 86_400_000}


def tier_ms(tier: str | None, ms: Any = None) -> int:
    """The TTL of ``tier``: ``ms`` when the record states it, else the standard tier's; 0 without a tier.
    A tier that is neither standard nor given a TTL is a ``TraceFormatError`` naming the known ones."""
    if tier is None:
        return 0 if ms is None else ms
    if ms is not None:
        return ms
    try:
        return RETENTION_TIERS_MS[tier]
    except (KeyError, TypeError):
        known = sorted(RETENTION_TIERS_MS)
        raise TraceFormatError(
            f"retention tier {tier!r} has no TTL: give its *_ms, or use one of {known}"
        ) from None


def _check_int_list(name: str, values: object) -> None:
    if not isinstance(values, list):
        raise TraceFormatError(f"{name} must be a list of integers")
    for v in values:
        if type(v) is not int or v < 0:
            raise TraceFormatError(f"{name} must hold non-negative integers, found {v!r}")


# Objects built while the collector was paused past which the pause ends by freezing them (see below).
FREEZE_AFTER_OBJECTS = 200_000


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Python's cyclic collector off while a whole trace is built. Why: a trace is millions of new records
    and lists, none in a cycle, and every few hundred allocations the collector walks everything built so
    far: 45 % of a 1 M-request JSONL load (14.5 s against 8.0 s) and a third of a Parquet one.

    ``freeze`` (a whole trace loaded at once, ``read_trace``): when the pause built more than
    :data:`FREEZE_AFTER_OBJECTS` tracked objects, it ends with ``gc.freeze()``. All of them are still in
    the youngest generation, so the first allocation after ``gc.enable()`` would walk them all (0.67 s
    after a 1 M-request trace), and later collections again as they age. Frozen objects are still freed by
    reference counting when dropped (records and lists hold no cycles); a cycle among the objects alive at
    that moment would never be collected, which a command that loads a trace or two can afford. Never
    while streaming (each batch would freeze what the consumer holds, again and again)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if freeze and gc.get_count()[0] > FREEZE_AFTER_OBJECTS:
                gc.freeze()
            gc.enable()
