"""``worker/store_push.retain_prefixes`` against a scripted master: what a span pins for a hybrid and for a
pure-MLA chain, and that a refusal, a store error or a late store only means less is retained. The same
calls against the real services: tests/test_gateway_cluster.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvpool.kvstore.client.async_client import PinResult
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.worker.store_push import Retained, retain_prefixes

B = 64
HASHES = [bytes([i]) * 32 for i in range(1, 6)]  # a chain of 5 full blocks


class PinStore:
    """A master's pin as the serving path sees it: a chain whole or nothing (a key it does not hold pins
    nothing and is no refusal), refused past ``budget`` keys; every call recorded."""

    def __init__(self, held: set[bytes], budget: int = 1_000, fail: Exception | None = None) -> None:
        self.held, self.budget, self.fail = held, budget, fail
        self.calls: list[tuple[list[bytes], int, str]] = []
        self.delay_s = 0.0

    async def pin(self, keys: Sequence[bytes], ttl_ms: int, route: bytes, session: str) -> PinResult:
        self.calls.append((list(keys), ttl_ms, session))
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        if not all(k in self.held for k in keys):
            return PinResult(0)
        if len(keys) > self.budget:
            return PinResult(0, refused=True)
        return PinResult(len(keys))


def blocks(n: int) -> list[bytes]:
    return [mla_key(h) for h in HASHES[:n]]


def retain(store: PinStore, spans, checkpoints=(), hybrid=True, timeout_s=5.0) -> Retained:
    return asyncio.run(
        retain_prefixes(store, HASHES, spans, checkpoints, "conv", B, timeout_s, b"", hybrid)  # type: ignore[arg-type]
    )


def test_a_pure_mla_span_pins_its_blocks_with_no_checkpoint() -> None:
    """[0, n) pins the blocks [0, min(n, chain)) alone: a pure-MLA prefix is usable at any block. Spans ending
    at the same block are one pin at the longest TTL; a span deeper than the chain is cut to it."""
    store = PinStore(set(blocks(5)))
    got = retain(store, [(2, 1000), (2, 5000), (9, 300)], checkpoints=[], hybrid=False)
    assert got == Retained(5 * B, False)
    assert sorted(store.calls) == sorted([(blocks(2), 5000, "conv"), (blocks(5), 300, "conv")])
    # the same spans on a hybrid chain with no checkpoint pin nothing (a hybrid prefix needs its KDA state)
    hybrid = PinStore(set(blocks(5)))
    assert retain(hybrid, [(2, 1000), (5, 300)]) == Retained(0, False) and hybrid.calls == []


def test_a_hybrid_span_pins_up_to_its_checkpoint_and_tries_one_shallower() -> None:
    store = PinStore({*blocks(5), kda_key(HASHES[1])})  # the checkpoint at block 4 was not stored
    assert retain(store, [(5, 1000)], checkpoints=[2, 4]) == Retained(2 * B, False)
    assert [keys for keys, _, _ in store.calls] == [
        [*blocks(4), kda_key(HASHES[3])],
        [*blocks(2), kda_key(HASHES[1])],
    ]


def test_a_pure_mla_pin_refused_missing_failing_or_late_is_less_retained_never_an_error() -> None:
    assert retain(PinStore(set(blocks(5)), budget=3), [(4, 1000)], hybrid=False) == Retained(0, True)
    partial = PinStore(set(blocks(3)))  # block 4 is gone: nothing pinned, no refusal, nothing shallower tried
    assert retain(partial, [(4, 1000)], hybrid=False) == Retained(0, False) and len(partial.calls) == 1
    away = PinStore(set(blocks(5)), fail=StoreError("master away"))
    assert retain(away, [(4, 1000)], hybrid=False) == Retained(0, False)
    late = PinStore(set(blocks(5)))
    late.delay_s = 1.0
    assert retain(late, [(4, 1000)], hybrid=False, timeout_s=0.05) == Retained(0, False)
    # a span without a TTL, or one with no full block, asks nothing
    idle = PinStore(set(blocks(5)))
    assert retain(idle, [(4, 0), (0, 1000)], hybrid=False) == Retained(0, False) and idle.calls == []
