"""Which master shard owns a chain: rendezvous hashing of the chain's root (``docs/design/sharding.md``).

A fleet outgrows one master long before its storage fills (every lookup, put and eviction goes through the
leader). So the index is split into ``count`` shards, and every chain lives whole on one of them: its
*route* is the block hash that closes block ``min(depth, n) - 1`` of the chain (the first ``depth`` blocks,
chained, so the hash names all of them), and its shard is the one whose seed scores highest for that route
(rendezvous, or highest-random-weight, hashing). A whole chain on one shard keeps ``match_prefix`` one call
and leaf-first eviction meaningful; a depth of 2 instead of 1 spreads chains that share only their first
block (a common system prompt) across shards.

Rendezvous rather than ``hash % count``: adding shard ``count`` moves exactly the routes for which the new
seed scores highest (about ``1 / (count + 1)`` of them), and no route moves between two old shards.

Objects that belong to no chain (a request's tail) route by their own key.

Pure and dependency-free on purpose: the master, the storage nodes, every client (workers, gateway, vLLM
connector) and the simulator call the same function, so they cannot disagree while their parameters agree;
and when parameters disagree, :meth:`ShardSet.require_same` names both.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash
from kvpool.kvstore.errors import ShardSetError, WrongShardError

DEFAULT_DEPTH = 2
MAX_SHARDS = 64
MAX_DEPTH = 64


@dataclass(frozen=True, slots=True)
class ShardSet:
    """``count`` master shards, chains routed by their first ``depth`` blocks; ``ShardSet()`` = one master."""

    count: int = 1
    depth: int = DEFAULT_DEPTH

    def __post_init__(self) -> None:
        if type(self.count) is not int or not 1 <= self.count <= MAX_SHARDS:
            raise ShardSetError(f"shard count must be an integer in 1..{MAX_SHARDS}, got {self.count!r}")
        if type(self.depth) is not int or not 1 <= self.depth <= MAX_DEPTH:
            raise ShardSetError(f"shard depth must be an integer in 1..{MAX_DEPTH}, got {self.depth!r}")

    @property
    def sharded(self) -> bool:
        return self.count > 1

    def route_of_chain(self, block_hashes: Sequence[bytes]) -> bytes:
        """The hash that names the chain's first ``depth`` blocks (b"" for an empty chain)."""
        if not block_hashes:
            return b""
        return bytes(block_hashes[min(self.depth, len(block_hashes)) - 1])

    def shard_of_route(self, route: bytes) -> int:
        """The shard whose seed scores highest for ``route`` (always 0 with one shard)."""
        if self.count == 1:
            return 0
        best, best_score = 0, -1
        for shard in range(self.count):
            score = xxhash.xxh64_intdigest(route, seed=shard)
            if score > best_score:
                best, best_score = shard, score
        return best

    def shard_of_chain(self, block_hashes: Sequence[bytes]) -> int:
        return self.shard_of_route(self.route_of_chain(block_hashes))

    def describe(self) -> str:
        return f"{self.count} shard{'s' if self.count != 1 else ''} at depth {self.depth}"

    def require_owner(self, route: bytes, shard: int) -> None:
        """Raise :class:`WrongShardError` unless ``route`` belongs to ``shard``."""
        owner = self.shard_of_route(route)
        if owner != shard:
            raise WrongShardError(
                f"route {route[:8].hex()}… belongs to shard {owner} of {self.describe()}, "
                f"not to shard {shard}"
            )

    def require_same(self, other: ShardSet, mine: str, theirs: str) -> None:
        """Raise :class:`ShardSetError` naming both sets unless ``other`` equals this one."""
        if other != self:
            raise ShardSetError(f"{mine} has {self.describe()}, {theirs} has {other.describe()}")

    @classmethod
    def parse(cls, text: str) -> ShardSet:
        """``"COUNT"`` or ``"COUNTxDEPTH"`` (how flags, etcd and the master wire spell a shard set)."""
        count, _, depth = text.strip().partition("x")
        try:
            return cls(int(count), int(depth) if depth else DEFAULT_DEPTH)
        except ValueError:
            raise ShardSetError(f"a shard set is COUNT or COUNTxDEPTH, got {text!r}") from None

    def __str__(self) -> str:
        return f"{self.count}x{self.depth}"


def add_depth_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--shard-depth``, as every party (masters, nodes, workers, gateway) takes it: they must agree."""
    parser.add_argument(
        "--shard-depth",
        type=int,
        default=DEFAULT_DEPTH,
        help=f"with master shards: blocks of a chain that choose its shard (default {DEFAULT_DEPTH}; the "
        "same on every party)",
    )


def master_groups(spec: str) -> list[str]:
    """``"A;B,B2;C"`` -> ``["A", "B,B2", "C"]``: the master address every party is given lists the shards
    in order, separated by ``;`` (each one master or an HA group ``a,b``). One group = no shards."""
    groups = [g.strip() for g in spec.split(";")]
    if not all(groups):
        raise ShardSetError(f"an empty shard in the master address {spec!r} (shards are separated by ';')")
    ShardSet(len(groups))  # the count's range
    return groups
